"""``polytrain`` as a user runs it: help, config errors before any process starts, and ``fit`` with
``trainer.devices=2`` starting its workers through torch's elastic agent, then resuming."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import POLYTRAIN, SCRIPTS, TINY_CONFIG, read_records, reference_weights, run  # noqa: E402

pytestmark = pytest.mark.torch_api

RUN_TIMEOUT = 120  # per launch; a launch hit by the known exit-time abort runs once more (procs.py)
CONSOLE_SCRIPT = Path(sys.executable).parent / "polytrain"


def _last_checkpoint(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)


def _flat(state: dict) -> list[float]:
    return [float(v) for t in state.values() for v in t.flatten().tolist()]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_help():
    result = run([*POLYTRAIN, "--help"], timeout=50)
    assert result.returncode == 0, result.describe()
    for command in ("fit", "validate", "test", "predict", "checkpoint"):
        assert command in result.stdout
    if CONSOLE_SCRIPT.exists():  # the installed console script is the same program
        result = run([CONSOLE_SCRIPT, "fit", "--help"], timeout=50)
        assert result.returncode == 0, result.describe()
        assert "--config" in result.stdout and "overrides" in result.stdout


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("override, named", [
    ("trainer.max_epoch=3", ["trainer has no key 'max_epoch'", "did you mean 'max_epochs'"]),
    ("trainer.strategy=dpp", ["unknown strategy 'dpp' (did you mean 'dp' or 'ddp'?)"]),
    ("trainer.precision=bf16-mixd",
     ["trainer.precision='bf16-mixd' is not valid (did you mean 'bf16-mixed'?)"]),
    ("trainer.accelerator=cpuu", ["trainer.accelerator='cpuu' is not valid (did you mean 'cpu'?)"]),
    ("trainer.strategy.find_unused=true",
     ["strategy 'ddp' has no option 'find_unused'", "find_unused_parameters"]),
    ("modle.lr=0.1", ["config has no key 'modle'", "did you mean 'module'"]),
    # The module's own keywords, checked against TinyRegressor.__init__ in the launching process.
    ("module.lrr=0.1", ["module: tiny_module.TinyRegressor() got an unexpected keyword 'lrr'",
                        "did you mean 'lr'?", "Valid: n, batch_size, lr"]),
    ("module._target_=tiny_modul.TinyRegressor",
     ["cannot import module 'tiny_modul'", "did you mean 'tiny_module'"]),
    ("trainer.callbacks=[{_target_: polytrain.callbacks.EarlyStopping, monitr: val/loss}]",
     ["trainer.callbacks[0]: polytrain.callbacks.EarlyStopping() got an unexpected keyword 'monitr'",
      "did you mean 'monitor'?"]),
])
def test_config_typo_exits_2_before_starting_any_process(tmp_path, override, named):
    run_dir = tmp_path / "run"
    extra = ["trainer.strategy=ddp"] if override.startswith("trainer.strategy.") else []
    result = run([*POLYTRAIN, "fit", "-c", TINY_CONFIG, "trainer.devices=2", f"trainer.run_dir={run_dir}",
                  *extra, override], timeout=50)
    assert result.returncode == 2, result.describe()
    message = result.stderr.strip()
    assert message.startswith("polytrain: config error:") and "\n" not in message, result.describe()
    for text in named:
        assert text in message, result.describe()
    assert "Traceback" not in result.stderr
    # No worker ever started: a worker's first act is creating the run directory. (How fast the error
    # comes is not asserted: wall time on a loaded CI machine proves nothing.)
    assert not run_dir.exists()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_TIMEOUT + 30)
def test_fit_with_two_devices_through_elastic_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    base = [*POLYTRAIN, "fit", "-c", TINY_CONFIG, "trainer.devices=2", f"trainer.run_dir={run_dir}"]

    first = run([*base, f"module.record_dir={tmp_path / 'first'}"], RUN_TIMEOUT)
    assert first.returncode == 0, first.describe()
    assert first.stdout.count("final metrics:") == 1, first.describe()  # rank 0 only
    assert "train/loss=" in first.stdout and "val/loss=" in first.stdout
    assert f"run directory: {run_dir / 'version_0'}" in first.stdout.splitlines(), first.describe()
    records = read_records(tmp_path / "first")
    assert sorted(records) == [0, 1]
    for rec in records.values():
        assert (rec["world_size"], rec["strategy"], rec["start_step"], rec["global_step"]) == (2, "ddp", 0, 8)
        assert rec["env"]["TORCHELASTIC_RUN_ID"].startswith("polytrain-"), rec["env"]  # torch's elastic agent
    assert records[0]["ppid"] == records[1]["ppid"]
    assert records[0]["weights"] == records[1]["weights"]
    assert records[0]["weights"] == pytest.approx(reference_weights(epochs=2), abs=1e-5)
    ckpt = _last_checkpoint(run_dir)
    assert (ckpt["loop"]["global_step"], ckpt["loop"]["epoch"], ckpt["loop"]["world_size"]) == (8, 2, 2)
    assert _flat(ckpt["model"]) == records[0]["weights"]

    saved = tmp_path / "run-after-first"
    shutil.copytree(run_dir, saved)

    def restore() -> None:  # a retried resume must start from the first run's checkpoints again
        shutil.rmtree(run_dir)
        shutil.copytree(saved, run_dir)

    second = run([*base, "trainer.resume=last", "trainer.max_epochs=3",
                  f"module.record_dir={tmp_path / 'second'}"],
                 RUN_TIMEOUT, before_retry=restore)
    assert second.returncode == 0, second.describe()
    assert second.stdout.count("final metrics:") == 1, second.describe()
    assert "restoring from" in second.stderr, second.describe()
    assert second.stderr.count("continuing the run in") == 1, second.describe()  # the launcher checks quietly
    records = read_records(tmp_path / "second")
    assert sorted(records) == [0, 1]
    for rec in records.values():
        assert (rec["start_step"], rec["global_step"]) == (8, 12), rec  # continued, not restarted
    # Exact continuation: the same weights as three uninterrupted epochs.
    assert records[0]["weights"] == pytest.approx(reference_weights(epochs=3), abs=1e-5)
    ckpt = _last_checkpoint(run_dir)
    assert (ckpt["loop"]["global_step"], ckpt["loop"]["epoch"]) == (12, 3)
    assert _flat(ckpt["model"]) == records[0]["weights"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_fit_worker_failure_ends_the_job_with_that_ranks_traceback(tmp_path):
    result = run([*POLYTRAIN, "fit", "-c", TINY_CONFIG, "trainer.devices=2",
                  f"trainer.run_dir={tmp_path / 'run'}",
                  "trainer.timeout=600", "module.fail_rank=1", f"module.record_dir={tmp_path}"], RUN_TIMEOUT,
                 retry_exit_abort=False)
    assert result.returncode == 1, result.describe()
    assert "final metrics" not in result.stdout
    # Rank 1's own traceback once, torch's and polytrain's frames left out, then one line: 6 lines in all.
    said = result.stderr.strip().splitlines()
    assert said[0] == ("polytrain: rank 1 failed (torch's and polytrain's frames left out; "
                       "POLYTRAIN_FULL_ERROR=1 shows them):"), result.describe()
    module_file = SCRIPTS / "tiny_module.py"
    source = module_file.read_text().splitlines()
    raised = next(n for n, line in enumerate(source, 1) if 'raise RuntimeError(f"tiny-module' in line)
    frames = [line.strip() for line in said if line.strip().startswith("File ")]
    assert frames == [f'File "{module_file}", line {raised}, in training_step'], result.describe()
    error = "RuntimeError: tiny-module deliberate failure on rank 1"
    assert said[-2:] == [error, f"polytrain: fit failed on rank 1: {error}"], result.describe()
    assert len(said) <= 30 and said.count(error) == 1, result.describe()
    failed_at = json.loads((tmp_path / "failed-rank1.json").read_text())["time"]
    lingered = result.ended - failed_at
    assert lingered < 60, f"the job took {lingered:.1f}s to end after rank 1 failed\n{result.describe()}"
