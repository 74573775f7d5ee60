"""Smoke tests for examples/cifar10, examples/toy_spawn and examples/collectives.

The multi-process ones run the examples as a user would (the CLI, a plain script, torchrun) in
subprocesses, on 2 CPU processes with tiny data and a handful of steps.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.own_logic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
CIFAR_DIR = os.path.join(EXAMPLES, "cifar10")


def _run(args: list[str], cwd: str, timeout: float, expect_rc: int = 0) -> subprocess.CompletedProcess:
    # One thread per worker: two workers on two cores, no oversubscription.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the examples must start their own workers
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect_rc, (f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n"
                                          f"{proc.stderr}")
    return proc


def _polytrain(*args: str, cwd: str, timeout: float = 200, expect_rc: int = 0) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "polytrain", *args], cwd, timeout, expect_rc)


def documented_command(readme: str, marker: str) -> list[str]:
    """The arguments of the ``.venv/bin/polytrain`` command in ``readme`` whose text holds ``marker`` (line
    continuations joined, the trailing comment dropped)."""
    with open(readme, encoding="utf-8") as fh:
        text = fh.read().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith(".venv/bin/polytrain ") and marker in ln)
    return shlex.split(line.split("#", 1)[0])[1:]


def _quiet(run_dir: str) -> list[str]:
    return [f"trainer.run_dir={run_dir}", "trainer.enable_progress_bar=false", "trainer.logger=false",
            "trainer.max_epochs=1", "trainer.limit_val_batches=1", "trainer.accelerator=cpu",
            "trainer.devices=2"]


@pytest.fixture
def cifar_module() -> Any:
    if CIFAR_DIR not in sys.path:
        sys.path.insert(0, CIFAR_DIR)
    import cifar10_module

    return cifar10_module


# --------------------------------------------------------------------------- configs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["cifar10", "toy_spawn"])
def test_example_config_is_valid(name: str) -> None:
    from polytrain.trainer.configuration.config import load_config

    cfg = load_config(os.path.join(EXAMPLES, name, "config.yaml"))
    assert cfg["trainer"]["strategy"]["name"] == "ddp"
    assert cfg["trainer"]["devices"] == 2


@pytest.mark.timeout(60)
def test_cifar10_config_asks_for_ddp_amp_and_sync_batchnorm() -> None:
    from polytrain.trainer.configuration.config import load_config

    trainer = load_config(os.path.join(CIFAR_DIR, "config.yaml"))["trainer"]
    assert trainer["precision"] == "16-mixed"
    assert trainer["strategy"]["sync_batchnorm"] is True


# --------------------------------------------------------------------------- cifar10: data preparation


@pytest.mark.timeout(60)
def test_cifar10_prepare_data_downloads_and_fake_data_needs_no_download(cifar_module: Any,
                                                                        tmp_path: Any) -> None:
    """One process: ``prepare_data`` downloads (which rank calls it is the Trainer's job, proven end to end
    below)."""
    root = str(tmp_path / "data")
    cifar_module.CIFAR10ResNet(data_root=root, dataset_class="offline_cifar.RehearsalCIFAR10").prepare_data()
    assert [f for f in os.listdir(root) if f.startswith("download-")]
    fake = cifar_module.CIFAR10ResNet(batch_size=2, num_workers=0, fake=True, fake_size=8,
                                      data_root=str(tmp_path / "none"))
    fake.prepare_data()
    assert not os.path.exists(tmp_path / "none")  # nothing downloaded or created
    x, y = next(iter(fake.train_dataloader()))
    assert x.shape == (2, 3, 32, 32) and y.shape == (2,)
    assert fake(x).shape == (2, 10)


# --------------------------------------------------------------------------- cifar10: end to end


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cifar10_cli_ddp_16_mixed_sync_batchnorm_fake_data(tmp_path: Any) -> None:
    """The shipped config (DDP + 16-mixed + SyncBatchNorm) on 2 CPU processes with FakeData, 2 steps."""
    run_dir = str(tmp_path / "run")
    _polytrain("fit", "-c", os.path.join(CIFAR_DIR, "config.yaml"), *_quiet(run_dir),
               "module.fake=true", "module.fake_size=16", "module.batch_size=2", "module.num_workers=0",
               "trainer.limit_train_batches=2", cwd=str(tmp_path))
    ckpt = os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt")
    assert os.path.isfile(ckpt)
    payload = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert payload["loop"]["global_step"] == 2
    assert payload["config"]["trainer"]["precision"] == "16-mixed"
    assert payload["config"]["trainer"]["strategy"]["sync_batchnorm"] is True
    assert "scale" in payload["precision"]  # the GradScaler's state was saved: AMP was on
    stem = next(v for k, v in payload["model"].items() if k.endswith("conv1.weight") and v.shape[1] == 3)
    assert tuple(stem.shape) == (64, 3, 3, 3)  # the 32x32 stem, not ImageNet's 7x7


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cifar10_cli_download_path_offline(tmp_path: Any) -> None:
    """The ``fake: false`` code path on 2 processes, with torchvision's real ``CIFAR10`` class except
    for ``download()``, which ``offline_cifar.RehearsalCIFAR10`` replaces by writing tiny synthetic
    files in CIFAR-10's on-disk format (after a 1 s pause) and whose checksum table matches them.

    What this proves: ``download=True`` reaches ``download()`` in exactly one process, global
    rank 0 (local rank 0 on this node); the other rank opens the files only after they are
    complete (without the barrier it would find no files during the 1 s pause and fail with
    torchvision's "Dataset not found or corrupted", as a one-off check without the barrier showed);
    torchvision's integrity check and pickle reader accept the files; training and checkpointing
    then work on them. What it cannot prove offline: that the real archive downloads and
    matches torchvision's published md5 sums.
    """
    run_dir, data_root = str(tmp_path / "run"), str(tmp_path / "data")
    _polytrain("fit", "-c", os.path.join(CIFAR_DIR, "config.yaml"), *_quiet(run_dir),
               "module.dataset_class=offline_cifar.RehearsalCIFAR10", f"module.data_root={data_root}",
               "module.batch_size=2", "module.num_workers=0", "trainer.precision=32",
               "trainer.limit_train_batches=1", cwd=str(tmp_path))
    markers = sorted(f for f in os.listdir(data_root) if f.startswith("download-"))
    assert len(markers) == 1 and markers[0].startswith("download-rank0-"), markers
    with open(os.path.join(data_root, markers[0])) as fh:
        assert fh.read().strip() == "LOCAL_RANK=0"
    files = set(os.listdir(os.path.join(data_root, "cifar-10-batches-py")))
    assert {"batches.meta", "test_batch", *(f"data_batch_{i}" for i in range(1, 6))} <= files
    assert os.path.isfile(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cifar10_documented_offline_command_runs_on_cpu(tmp_path: Any) -> None:
    """The offline command of examples/cifar10/README.md as printed (run from the repository root; only the
    run directory moved to a temporary one): 1 epoch of 256 FakeData pictures on 2 CPU processes."""
    args = documented_command(os.path.join(CIFAR_DIR, "README.md"), "module.fake=true")
    run_dir = tmp_path / "run"
    proc = _polytrain(*args, f"trainer.run_dir={run_dir}", cwd=ROOT, timeout=280)
    loss = float(re.search(r"final metrics: train/loss=([\d.e+-]+)", proc.stdout).group(1))
    assert loss < 3.0, proc.stdout  # noise pictures: near ln 10, not diverging
    assert list(run_dir.rglob("last.ckpt")), sorted(map(str, run_dir.rglob("*")))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cifar10_failed_download_shows_the_download_error_on_two_processes(tmp_path: Any) -> None:
    """No network and a mistyped data_root: local rank 0's download raises; the job ends with that error (not
    with the waiting rank's view of it), said in one sentence on the last line, and the mistyped path is not
    left behind."""
    typo = tmp_path / "dat" / "cifar"
    proc = _polytrain("fit", "-c", os.path.join(CIFAR_DIR, "config.yaml"), *_quiet(str(tmp_path / "run")),
                      "module.dataset_class=offline_cifar.UnreachableCIFAR10", f"module.data_root={typo}",
                      "module.num_workers=0", "trainer.precision=32", cwd=str(tmp_path), expect_rc=1)
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"polytrain: fit failed on rank 0: RuntimeError: module.data_root={typo}: CIFAR-10 is "
                    f"not there, and downloading it failed (URLError: <urlopen error [Errno -3] Temporary "
                    f"failure in name resolution (fetching "
                    f"https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz)>). Point module.data_root at "
                    f"your copy, run where the download can reach the internet, or train on stand-in "
                    f"pictures with module.fake=true"), proc.stderr[-3000:]
    assert "in prepare_data" in proc.stderr, proc.stderr
    assert not (tmp_path / "dat").exists()


# --------------------------------------------------------------------------- README: resuming the default job


def _logged_learning_rates(run_dir: Any) -> list[tuple[int, float]]:
    """(step, lr) from every metrics.csv under ``run_dir`` (a resumed run may write a file of its own)."""
    import csv

    rates = {}
    for path in sorted(run_dir.rglob("metrics.csv")):
        with open(path, encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                lr = next((v for k, v in row.items() if k.startswith("lr-") and v), None)
                if lr is not None:
                    rates[int(float(row["step"]))] = float(lr)
    return sorted(rates.items())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_resume_test_and_validate_commands_run_as_printed(tmp_path: Any) -> None:
    """README.md's two resume commands as printed (run directory moved to a temporary one): a run cut short,
    then ``trainer.resume=last``. The learning rate logged over both never rises, and the job reaches the
    config's last epoch (12) and the cosine's floor. Then README's test (best checkpoint) and validate
    (newest checkpoint) commands on that run print their results and write beside it."""
    readme = os.path.join(ROOT, "README.md")
    run_dir = tmp_path / "run"
    quiet = [f"trainer.run_dir={run_dir}", "trainer.enable_progress_bar=false"]
    _polytrain(*documented_command(readme, "trainer.max_steps=100"), *quiet, cwd=ROOT, timeout=180)
    cut_short = _logged_learning_rates(run_dir)
    assert cut_short[-1][0] == 100, cut_short
    _polytrain(*documented_command(readme, "trainer.resume=last"), *quiet, cwd=ROOT, timeout=180)
    rates = _logged_learning_rates(run_dir)
    assert rates[-1][0] > 200, rates  # the resumed run logged its own steps
    assert all(later <= earlier for (_, earlier), (_, later) in zip(rates, rates[1:])), rates
    assert rates[-1][1] < 0.001 * 1.01, rates  # epoch 11 of cosine(T_max=12) from lr 0.05: 0.00085
    # README's test and validate commands as printed, on the checkpoints of that run
    fitted = sorted(os.listdir(run_dir))
    for marker, folder in (("--ckpt best", "test_0"), ("--ckpt last", "validate_0")):
        proc = _polytrain(*documented_command(readme, marker), *quiet, cwd=ROOT, timeout=240)
        assert "metric" in proc.stdout and "val/acc" in proc.stdout, proc.stdout  # the results table
        assert (run_dir / folder / "metrics.csv").exists()
    assert sorted(os.listdir(run_dir)) == sorted([*fitted, "test_0", "validate_0"])


# --------------------------------------------------------------------------- toy_spawn


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_toy_spawn_script_returns_trained_weights_to_parent(tmp_path: Any) -> None:
    proc = _run([sys.executable, os.path.join(EXAMPLES, "toy_spawn", "train.py"), "--epochs", "3",
                 "--run-dir", str(tmp_path / "run")], cwd=str(tmp_path), timeout=180)
    out = proc.stdout
    before = float(re.search(r"loss before training = ([\d.]+)", out).group(1))
    after = float(re.search(r"loss after training = ([\d.]+)", out).group(1))
    assert re.search(r"last logged train/loss = [\d.]+", out), out
    assert "received trained weights = True" in out, out
    assert after < before, out  # measured in the parent, with the weights the workers trained


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_toy_spawn_cli_config(tmp_path: Any) -> None:
    run_dir = str(tmp_path / "run")
    proc = _polytrain("fit", "-c", os.path.join(EXAMPLES, "toy_spawn", "config.yaml"),
                      f"trainer.run_dir={run_dir}", "trainer.max_epochs=1",
                      "trainer.enable_progress_bar=false", "trainer.logger=false", cwd=str(tmp_path),
                      timeout=180)
    assert "final metrics: train/loss=" in proc.stdout
    assert os.path.isfile(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"))


# --------------------------------------------------------------------------- collectives


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_collectives_demo_under_torchrun(tmp_path: Any) -> None:
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 os.path.join(EXAMPLES, "collectives", "demo.py")], cwd=str(tmp_path), timeout=130)
    results = {(int(r), demo): value for r, demo, value in
               re.findall(r"^\[rank (\d+)\] (\w+): (.*)$", proc.stdout, flags=re.MULTILINE)}
    expected = {
        "send_recv": ["[1.0]", "[1.0]"],  # rank 0 added one and sent it to rank 1
        "isend_irecv": ["[1.0]", "[1.0]"],
        "all_reduce": ["[3.0]", "[3.0]"],  # (0 + 1) + (1 + 1)
        "broadcast": ["[42.0]", "[42.0]"],
        "reduce": ["(not the destination)", "[3.0]"],  # onto the last rank
        "all_gather": ["[[0.0], [10.0]]", "[[0.0], [10.0]]"],
        "gather": ["[0.0, 10.0]", "None"],  # onto rank 0
        "scatter": ["[100.0]", "[101.0]"],  # chunk i to rank i
    }
    for demo, values in expected.items():
        for rank, value in enumerate(values):
            assert results.get((rank, demo)) == value, f"{demo} on rank {rank}\n{proc.stdout}\n{proc.stderr}"


# --------------------------------------------------------------------------- README: as printed


def _readme_block(heading: str, language: str = "python") -> str:
    """The first ``language`` code block after ``heading`` in README.md."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    after = text[text.index(heading):]
    start = after.index(f"```{language}\n") + len(f"```{language}\n")
    return after[start:after.index("```", start)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_module_runs_as_printed_and_validates(tmp_path: Any) -> None:
    """README.md's "Writing a module" block saved as a script and run as it is: two DDP workers, three
    epochs, and its validation_step runs (it has a val_dataloader)."""
    import csv

    script = tmp_path / "classifier.py"
    script.write_text(_readme_block("## Writing a module"), encoding="utf-8")
    _run([sys.executable, str(script)], str(tmp_path), timeout=240)
    with open(tmp_path / "runs" / "default" / "version_0" / "metrics.csv", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["epoch"] for r in rows if r.get("val/acc")] == ["0", "1", "2"]


