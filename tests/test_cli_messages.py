"""What the command line prints besides errors: the final metrics line and the warning an elastic config
that cannot continue after a restart gets."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import POLYTRAIN, TINY_CONFIG, run  # noqa: E402

from polytrain.commands import _print_metrics  # noqa: E402
from polytrain.trainer.configuration.config import TrainerConfig, elastic_warning, load_config  # noqa: E402

pytestmark = pytest.mark.own_logic


def test_final_metrics_keep_four_significant_digits(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = SimpleNamespace(callback_metrics={"train/loss": torch.tensor(0.000194),
                                                "val/acc": torch.tensor(0.98333),
                                                "val/loss": torch.tensor(12.3456)})
    _print_metrics(trainer)
    assert capsys.readouterr().out == "final metrics: train/loss=0.000194  val/acc=0.9833  val/loss=12.35\n"


STEP_CHECKPOINTS = ("trainer.callbacks=[{_target_: polytrain.callbacks.ModelCheckpoint, "
                    "every_n_train_steps: 4}]")


@pytest.mark.parametrize("overrides, missing", [
    (["trainer.max_restarts=2"], ["trainer.resume: auto", "a ModelCheckpoint with every_n_train_steps"]),
    (["trainer.max_restarts=2", "trainer.resume=auto"], ["a ModelCheckpoint with every_n_train_steps"]),
    (["trainer.num_nodes=1:2", STEP_CHECKPOINTS], ["trainer.resume: auto"]),
    (["trainer.max_restarts=2", "trainer.resume=auto", STEP_CHECKPOINTS], []),
    ([], []),
])
def test_an_elastic_config_that_would_start_over_is_warned(overrides: list[str], missing: list[str]) -> None:
    config = load_config(str(TINY_CONFIG), overrides)
    warning = elastic_warning(TrainerConfig(**config["trainer"]))
    if not missing:
        assert warning is None
        return
    assert warning is not None and "each restart will start the training over" in warning
    assert all(m in warning for m in missing) and "docs/reliability.md" in warning
    assert ("resume: auto" in warning) == ("trainer.resume: auto" in missing)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_cli_prints_the_elastic_warning_as_one_line(tmp_path: Path) -> None:
    result = run([*POLYTRAIN, "fit", "-c", str(TINY_CONFIG), f"trainer.run_dir={tmp_path / 'run'}",
                  "trainer.max_restarts=1", "trainer.max_epochs=1"], timeout=150)
    assert result.returncode == 0, result.describe()
    warnings = [line for line in result.stderr.splitlines() if line.startswith("polytrain: warning:")]
    assert len(warnings) == 1 and "trainer.max_restarts=1 restarts the workers" in warnings[0], (
        result.describe())


# --------------------------------------------------------------------------- callback options and _target_s

DIGITS = Path(__file__).resolve().parent.parent / "examples" / "digits"


@pytest.mark.parametrize("override", ["trainer.callbacks.ModelCheckpoint.async_save=true",
                                      "trainer.callbacks.1.async_save=true",
                                      "trainer.callbacks.-1.async_save=true"])
def test_a_callback_option_is_set_by_class_name_or_index(override: str) -> None:
    config = load_config(str(DIGITS / "config.yaml"), [override])
    [checkpoint] = [cb for cb in config["trainer"]["callbacks"] if cb["_target_"].endswith("ModelCheckpoint")]
    assert checkpoint["async_save"] is True and checkpoint["monitor"] == "val/acc"  # the rest of it kept


@pytest.mark.parametrize("override, message", [
    ("trainer.callbacks.EarlyStoping.patience=3",
     "trainer.callbacks.EarlyStoping: trainer.callbacks has no entry of class EarlyStoping; its entries: "
     "0: LearningRateMonitor, 1: ModelCheckpoint. Name an entry by its class or its index, or set the "
     "whole list: trainer.callbacks=[...]"),
    ("trainer.callbacks.5.async_save=true", "trainer.callbacks.5: trainer.callbacks has 2 entries (0 to 1)"),
    ("trainer.callbacks.ModelCheckpoint.asyncsave=true",
     "trainer.callbacks[1]: polytrain.callbacks.ModelCheckpoint() got an unexpected keyword 'asyncsave'; "
     "did you mean 'async_save'?"),
])
def test_a_bad_callback_override_is_one_line_naming_the_key(override: str, message: str) -> None:
    from polytrain.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(str(DIGITS / "config.yaml"), [override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_copied_config_finds_its_target_from_the_working_directory(tmp_path: Path) -> None:
    """The example's config copied anywhere, run with the ``polytrain`` command from the example's folder:
    ``digits_module`` is found in the working directory, and a callback option is set on the command line."""
    copied = tmp_path / "elsewhere" / "my.yaml"
    copied.parent.mkdir()
    shutil.copyfile(DIGITS / "config.yaml", copied)
    command = Path(sys.executable).parent / "polytrain"
    result = run([str(command), "fit", "-c", str(copied), f"trainer.run_dir={tmp_path / 'run'}",
                  "trainer.devices=1",
                  "trainer.strategy=single", "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false",
                  "trainer.callbacks.ModelCheckpoint.async_save=true"], timeout=150, cwd=DIGITS)
    assert result.returncode == 0, result.describe()
    assert "final metrics:" in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["fit", "--help"], ["validate"]])
def test_help_and_a_malformed_command_answer_without_importing_torch(args: list[str]) -> None:
    """``--help`` (and a command line argparse refuses) parse before anything heavy loads: no torch."""
    import subprocess

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "polytrain", *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == (2 if args == ["validate"] else 0), done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "argparse" in imported and "torch" not in imported and "polytrain.commands" not in imported


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.max_epoch=3",
     "trainer has no key 'max_epoch' (did you mean 'max_epochs'?); valid: accelerator,"),
    ("trainer.precision=fp17", "trainer.precision='fp17' is not valid; choose one of: 32, 16-mixed,"),
    ("modul.hidden=8", "config has no key 'modul' (did you mean 'module'?); valid: module, data,"),
    ("trainer.max_time=12h", "trainer.max_time='12h'; write it as DD:HH:MM:SS"),
    ("trainer.strategy=ddpp", "unknown strategy 'ddpp' (did you mean 'ddp' or 'dp'?); valid: auto, single,"),
    ("trainer.strategy.bucket_cap=1", "strategy 'ddp' has no option 'bucket_cap'; valid: backend,"),
    ("trainer.strategy={name: parallel, schedule: gpipee}",
     "pipeline schedule='gpipee' is not known; valid:"),
    ("trainer.strategy={name: parallel, plan: true, hardware: h1000}",
     "trainer.strategy (parallel) hardware='h1000' is not valid; choose one of: a100, cpu, h100"),
    ("trainer.strategy={name: parallel, tp: auto, tpp: 2}",
     "strategy 'parallel' has no option 'tpp'; valid:"),
    ("trainer.strategy={name: parallel, cp: 2}", "cp=2 (context parallel) runs only on CUDA"),
    ("module.lerning_rate=0.1",
     "module: digits_module.DigitsClassifier() got an unexpected keyword 'lerning_rate'."),
    ("module._target_=digits_module.DigitClassifier",
     "module: _target_ 'digits_module.DigitClassifier': module 'digits_module' has no attribute "
     "'DigitClassifier'; did you"),
    ("trainer.callbacks.ModelCheckpoint.asyncsave=true",
     "trainer.callbacks[1]: polytrain.callbacks.ModelCheckpoint() got an unexpected keyword 'asyncsave'; "
     "did you mean 'async_save'?"),
])
def test_a_typo_in_the_config_answers_in_one_line_before_torch_loads(override: str, message: str) -> None:
    """The file, its sections, the trainer keys, the strategy's name and options (a planner request and
    context parallel on CPU included) and the ``_target_`` arguments are checked by
    ``trainer/configuration/config_file.py`` (with ``strategies/options.py`` and
    ``trainer/configuration/target_source.py``) before the command imports torch: a typo costs a tenth of
    a second, not the seconds torch takes to load."""
    import subprocess

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "polytrain", "fit", "-c",
                           str(DIGITS / "config.yaml"), override], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert len(said) == 1 and said[0].startswith(f"polytrain: config error: {message}"), said
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "yaml.loader" in imported and "torch" not in imported and "polytrain.commands" not in imported


def test_the_root_cause_is_the_rank_that_raised_not_a_rank_that_stopped_for_it(tmp_path: Path) -> None:
    """Error files carry whole seconds: the rank stopping because rank 0 raised (RankFailedError) can record
    its error in the same second as rank 0, or earlier. The job's last line names rank 0's own error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from polytrain.commands import root_cause

    def failure(rank: int, message: str, timestamp: int) -> ProcessFailure:
        made = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(tmp_path / "none"))
        made.message, made.timestamp = {"message": message}, timestamp
        return made

    echo = ("RankFailedError: prepare_data raised on rank 0, so every rank stops (this is rank 1). "
            "Rank 0's error:")
    cause = "RuntimeError: module.data_root=/x: CIFAR-10 is not there\nTraceback ..."
    for echo_time in (5, 6, 7):  # before, with and after the rank that raised
        err = ChildFailedError("fit", {1: failure(1, echo, echo_time), 0: failure(0, cause, 6)})
        assert root_cause(err) == "rank 0: RuntimeError: module.data_root=/x: CIFAR-10 is not there"
    # The agent stopped rank 0 (a signal) before it recorded its error, or it is not listed at all: the
    # echo carries rank 0's traceback, whose last line is the error.
    carried = (f"{echo}\nTraceback (most recent call last):\n  File ...\n"
               "RuntimeError: module.data_root=/x: gone")
    stopped = failure(0, "Signal 15 (SIGTERM) received by PID 100", 6)
    stopped.exitcode = -15
    for failures in ({1: failure(1, carried, 6), 0: stopped}, {1: failure(1, carried, 6)}):
        assert root_cause(ChildFailedError("fit", failures)) == (
            "rank 0: RuntimeError: module.data_root=/x: gone")
    killed = ChildFailedError("fit", {0: failure(0, "", 6)})
    assert root_cause(killed) == "rank 0: exit code 1"


def test_the_failure_report_keeps_the_users_frames_of_every_traceback_and_the_full_one_on_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real traceback through torch and polytrain into a user's function, chained to a second error: each
    traceback of the chain keeps the user's frames only (one that has none keeps where it raised);
    POLYTRAIN_FULL_ERROR=1 prints it whole."""
    import traceback

    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from polytrain.core.worker_failure import failure_report

    def users_step(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a user's bug")

    def users_hook() -> None:
        try:
            torch.nn.Module.__call__(Wrapped(), torch.zeros(1))  # through torch's frames
        except ValueError as err:
            raise RuntimeError("the hook gave up") from err

    class Wrapped(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return users_step(x)

    try:
        users_hook()
    except RuntimeError:
        stack = traceback.format_exc()
    failure = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(tmp_path / "none"))
    failure.message = {"message": "RuntimeError: the hook gave up", "extraInfo": {"py_callstack": stack}}
    failure.timestamp = 5
    err = ChildFailedError("fit", {1: failure})

    short = failure_report(err).splitlines()
    assert short[0].startswith("polytrain: rank 1 failed (torch's and polytrain's frames left out")
    functions = [line.rsplit(" in ", 1)[1] for line in short if line.strip().startswith("File ")]
    assert functions == ["users_hook", "forward", "users_step",  # the first error: torch's frames left out
                         "test_the_failure_report_keeps_the_users_frames_of_every_traceback_and_the_full_one_on_"
                         "request", "users_hook"]  # the second
    assert "torch/nn/modules/module.py" not in "\n".join(short)
    assert short[-1] == "RuntimeError: the hook gave up"
    assert "The above exception was the direct cause of the following exception:" in short
    assert "ValueError: a user's bug" in short

    monkeypatch.setenv("POLYTRAIN_FULL_ERROR", "1")
    full = failure_report(err)
    assert full == f"polytrain: rank 1 failed:\n{stack.rstrip()}" and "torch/nn/modules/module.py" in full


@pytest.mark.parametrize("stage", ["fit", "test"])
def test_a_run_dir_through_a_file_is_one_line_before_any_worker_starts(tmp_path: Path, stage: str) -> None:
    in_the_way = tmp_path / "runs"
    in_the_way.write_text("a file where the run directory would go\n")
    run_dir = in_the_way / "tiny"
    args = [*POLYTRAIN, stage, "-c", TINY_CONFIG, "trainer.devices=2", f"trainer.run_dir={run_dir}"]
    if stage == "test":
        args += ["--ckpt", str(tmp_path / "some.ckpt")]
    result = run(args, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.describe()  # no worker started
    assert result.stderr.strip().splitlines() == [
        f"polytrain {stage}: cannot write trainer.run_dir={run_dir} (this run's directory: {run_dir}): "
        f"{in_the_way} is a file. Point trainer.run_dir at a writable directory"], result.describe()


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["elastic", "spawn"])
def test_a_config_error_a_worker_finds_is_one_line_as_the_launchers_own(tmp_path: Path,
                                                                          launcher: str) -> None:
    """A class named in the config that only the built module can be checked against (fsdp's wrap_modules):
    the worker finds it; the launcher says it as it says its own config errors, one line and exit code 2,
    with the rank that found it (it was a traceback and a summary, exit code 1)."""
    run_dir = tmp_path / "run"
    result = run([*POLYTRAIN, "fit", "-c", TINY_CONFIG, "trainer.devices=2", f"trainer.launcher={launcher}",
                  "trainer.strategy.name=fsdp", "trainer.strategy.wrap_modules=[Lineer]",
                  f"trainer.run_dir={run_dir}"], timeout=100)
    assert result.returncode == 2, result.describe()
    said = result.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(
        "polytrain fit: fsdp wrap_modules names ['Lineer'], but TinyRegressor has no submodule of that "
        "class; classes present: Linear, TinyRegressor (found on rank "), result.describe()  # both find it


def test_a_spawned_rank_stopping_for_another_names_the_one_that_raised() -> None:
    """Under launcher: spawn, torch reports the first process to end with an error; where that is a rank
    stopping because another raised in prepare_data (its RankFailedError carries the other's traceback),
    the report and its last line name the rank that raised, with its own traceback alone."""
    from polytrain.core.worker_failure import spawned_failure_report, spawned_root_cause

    echo = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
            '  File "/site/polytrain/trainer/loops/lifecycle.py", line 174, in _raise_first_failure\n'
            '    raise RankFailedError(f"{step} raised on rank {rank}")\n'
            "polytrain.core.errors.RankFailedError: prepare_data raised on rank 0, so every rank stops (this "
            "is rank 1). Rank 0's error:\nTraceback (most recent call last):\n"
            '  File "/data/download.py", line 8, in fetch_archive\n'
            '    raise ConnectionError("cannot reach")\n'
            "ConnectionError: cannot reach the mirror\n")
    err = RuntimeError(echo)
    assert spawned_root_cause(err) == "rank 0: ConnectionError: cannot reach the mirror"
    assert spawned_failure_report(err).splitlines() == [
        "polytrain: rank 0 failed (torch's and polytrain's frames left out; POLYTRAIN_FULL_ERROR=1 shows "
        "them):",
        "Traceback (most recent call last):", '  File "/data/download.py", line 8, in fetch_archive',
        '    raise ConnectionError("cannot reach")', "ConnectionError: cannot reach the mirror"]
