"""Nothing a user wrote is overwritten: each run writes into its own version directory
(``<run_dir>/version_<n>``, or the ``version`` the user names), evaluation stages of a new Trainer get
their own, ``resume: last`` continues one run (the newest with a checkpoint) in its directory and says
which, and a ``ModelCheckpoint`` pointed at a shared directory never writes over another run's files.
Every test reads the files back."""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import TinyModule
from distributed import run_distributed

from polytrain import Trainer
from polytrain.callbacks import ModelCheckpoint
from polytrain.core.errors import ConfigError

pytestmark = pytest.mark.own_logic


def _kwargs(run_dir: str, **over: Any) -> dict[str, Any]:
    return {**dict(strategy="single", accelerator="cpu", devices=1, run_dir=run_dir,
                   enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                   num_sanity_val_steps=0, max_epochs=2), **over}


def _snapshot(root: str) -> dict[str, str]:
    """Every file under ``root``, by relative path -> content hash."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_a_second_fresh_fit_gets_its_own_version_and_leaves_the_first_untouched(run_dir: str) -> None:
    first = Trainer(**_kwargs(run_dir))
    first.fit(TinyModule())
    assert first.log_dir == os.path.join(run_dir, "version_0")
    before = _snapshot(os.path.join(run_dir, "version_0"))
    assert {"metrics.csv", "checkpoints/last.ckpt", "checkpoints/latest"} <= set(before)
    assert any(name.startswith("events.out.tfevents")
               for name in before)  # TensorBoard, in the same directory

    second = Trainer(**_kwargs(run_dir, max_epochs=1))
    second.fit(TinyModule(lr=0.05))
    assert second.log_dir == os.path.join(run_dir, "version_1")
    assert _snapshot(os.path.join(run_dir, "version_0")) == before  # not a byte changed
    assert sorted(os.listdir(run_dir)) == ["version_0", "version_1"]
    assert second.checkpoint_callback.best_model_path.startswith(os.path.join(run_dir, "version_1",
                                                                              "checkpoints"))
    assert (len(_rows(os.path.join(run_dir, "version_1", "metrics.csv")))
            < len(_rows(os.path.join(run_dir, "version_0", "metrics.csv"))))


@pytest.mark.parametrize("stage", ["test", "validate", "predict"])
def test_evaluation_in_a_new_trainer_writes_its_own_files(run_dir: str, stage: str) -> None:
    fit = Trainer(**_kwargs(run_dir))
    fit.fit(TinyModule())
    run0 = os.path.join(run_dir, "version_0")
    before = _snapshot(run0)
    lines = len(_rows(os.path.join(run0, "metrics.csv")))
    assert lines > 2

    evaluator = Trainer(**_kwargs(run_dir))
    getattr(evaluator, stage)(TinyModule(), ckpt_path=os.path.join(run0, "checkpoints", "last.ckpt"), **(
        {} if stage == "predict" else {"verbose": False}))
    assert _snapshot(run0) == before  # metrics.csv keeps its rows; nothing in the run changed
    # Told apart from trainings (TensorBoard lists it as what it is): <stage>_<n>, not the next version_<n>.
    assert evaluator.log_dir == os.path.join(run_dir, f"{stage}_0")
    assert sorted(os.listdir(run_dir)) == sorted(["version_0", f"{stage}_0"])
    if stage != "predict":
        rows = _rows(os.path.join(run_dir, f"{stage}_0", "metrics.csv"))
        assert rows and any(k.startswith(("test", "val")) for k in rows[0])


def test_a_stage_that_fails_before_writing_leaves_no_directory(run_dir: str, tmp_path: Any) -> None:
    """Failed attempts do not clutter run_dir: a validate whose checkpoint is torn, and a fit whose module
    fails in setup, raise and leave no empty directory behind; the next run still gets the next number."""
    from polytrain.core.errors import CheckpointError

    Trainer(**_kwargs(run_dir)).fit(TinyModule())
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes(open(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"), "rb").read()[:500])
    with pytest.raises(CheckpointError, match="torn.ckpt"):
        Trainer(**_kwargs(run_dir)).validate(TinyModule(), ckpt_path=str(torn), verbose=False)

    class FailsInSetup(TinyModule):
        def setup(self, stage: str) -> None:
            raise RuntimeError("no data here")

    with pytest.raises(RuntimeError, match="no data here"):
        Trainer(**_kwargs(run_dir)).fit(FailsInSetup())
    assert sorted(os.listdir(run_dir)) == ["version_0"]
    second = Trainer(**_kwargs(run_dir, max_epochs=1))
    second.fit(TinyModule())
    assert second.log_dir == os.path.join(run_dir, "version_1")


def test_the_same_trainer_logs_a_later_stage_beside_its_fit(run_dir: str) -> None:
    trainer = Trainer(**_kwargs(run_dir))
    module = TinyModule()
    trainer.fit(module)
    fit_rows = _rows(os.path.join(trainer.log_dir, "metrics.csv"))
    trainer.test(module, verbose=False)
    assert trainer.log_dir == os.path.join(run_dir, "version_0")
    rows = _rows(os.path.join(trainer.log_dir, "metrics.csv"))
    assert ([r["step"] for r in rows[:len(fit_rows) - 1]]
            == [r["step"] for r in fit_rows[:-1]])  # fit's rows stay
    assert rows[-1].get("test/loss")


def test_resume_last_continues_the_newest_run_in_its_directory_and_says_which(
        run_dir: str, caplog: Any) -> None:
    Trainer(**_kwargs(run_dir, max_epochs=3)).fit(TinyModule())  # version_0: 3 epochs, its own top-k
    run0 = _snapshot(os.path.join(run_dir, "version_0"))
    Trainer(**_kwargs(run_dir, max_epochs=1)).fit(TinyModule(lr=0.05))  # version_1, written later
    rows_before = _rows(os.path.join(run_dir, "version_1", "metrics.csv"))

    with caplog.at_level(logging.INFO, logger="polytrain"):
        resumed = Trainer(**_kwargs(run_dir, max_epochs=2, resume="last"))
        resumed.fit(TinyModule(lr=0.05))
    run1 = os.path.join(run_dir, "version_1")
    assert resumed.log_dir == run1 and resumed.ckpt_path.startswith(os.path.join(run1, "checkpoints"))
    said = [r for r in caplog.records if f"continuing the run in {run1}" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]  # what a resume does, not a warning
    assert _snapshot(os.path.join(run_dir, "version_0")) == run0
    assert sorted(os.listdir(run_dir)) == ["version_0", "version_1"]
    rows = _rows(os.path.join(run1, "metrics.csv"))
    assert (rows[:len(rows_before)] == rows_before
            and len(rows) > len(rows_before))  # the run's file, continued
    assert resumed.global_step == 8 and int(rows[-1]["step"]) == 8


def test_resume_last_takes_the_newest_step_recorded_inside_not_the_newest_file_time(tmp_path: Any) -> None:
    """A run copied elsewhere (``cp -r``: file times are the copy's, the last.ckpt hard link becomes a file of
    its own) whose ``latest`` names last.ckpt, and last.ckpt torn: the newest complete checkpoint is the one
    with the highest step recorded inside, whatever the file times say."""
    import shutil

    original = tmp_path / "original"
    saver = ModelCheckpoint(save_last=True, every_n_epochs=1, save_top_k=-1)
    Trainer(**_kwargs(str(original), max_epochs=3, callbacks=[saver])).fit(TinyModule())
    copied = tmp_path / "copied"
    shutil.copytree(original, copied, copy_function=shutil.copyfile)
    ckpt_dir = copied / "version_0" / "checkpoints"
    names = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("epoch="))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    for age, name in enumerate(names):  # the copy left the oldest checkpoint the newest file
        os.utime(ckpt_dir / name, (2_000_000_000 - 1000 * age,) * 2)
    (ckpt_dir / "latest").write_text("last.ckpt")
    with open(ckpt_dir / "last.ckpt", "r+b") as fh:
        fh.truncate(100)
    resumed = Trainer(**_kwargs(str(copied), max_epochs=4, resume="last"))
    resumed.fit(TinyModule())
    assert os.path.basename(resumed.ckpt_path) == "epoch=2-step=12.ckpt"
    assert resumed.global_step == 16


def test_resume_last_with_a_named_version_looks_only_in_that_run(run_dir: str, caplog: Any) -> None:
    Trainer(**_kwargs(run_dir, max_epochs=1)).fit(TinyModule())  # version_0, step 4
    Trainer(**_kwargs(run_dir, max_epochs=2)).fit(TinyModule())  # version_1, step 8 (newer)
    with caplog.at_level(logging.WARNING, logger="polytrain"):
        trainer = Trainer(**_kwargs(run_dir, max_epochs=2, resume="last", version=0))
        trainer.fit(TinyModule())
    assert trainer.ckpt_path.startswith(os.path.join(run_dir, "version_0", "checkpoints"))
    assert trainer.global_step == 8 and trainer.log_dir == os.path.join(run_dir, "version_0")


def test_a_fresh_fit_into_a_named_version_that_holds_a_run_is_refused(run_dir: str) -> None:
    Trainer(**_kwargs(run_dir, version="baseline")).fit(TinyModule())
    before = _snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"baseline.*already holds a run .*resume=last.*version_0"):
        Trainer(**_kwargs(run_dir, version="baseline")).fit(TinyModule())
    assert _snapshot(run_dir) == before


def test_a_shared_checkpoint_directory_never_loses_another_runs_files(tmp_path: Any, run_dir: str) -> None:
    shared = str(tmp_path / "shared")

    def fit() -> ModelCheckpoint:
        callback = ModelCheckpoint(save_last=True, dirpath=shared, save_top_k=-1)
        Trainer(**_kwargs(run_dir, callbacks=[callback])).fit(TinyModule())
        return callback

    fit()
    before = _snapshot(shared)
    assert {"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"} <= set(before)
    second = fit()
    after = _snapshot(shared)
    assert ({k: after[k] for k in before if k != "latest"}
            == {k: v for k, v in before.items() if k != "latest"})
    assert {"epoch=0-step=4-v1.ckpt", "epoch=1-step=8-v1.ckpt", "last-v1.ckpt"} <= set(after)
    assert second.best_model_path == os.path.join(shared, "epoch=1-step=8-v1.ckpt")


def test_an_explicit_logger_sets_the_run_directory_as_in_lightning(tmp_path: Any, run_dir: str) -> None:
    from polytrain.loggers import CSVLogger, TensorBoardLogger

    save_dir = str(tmp_path / "logs")
    for expected in ("version_0", "version_1"):
        tb, csv_logger = TensorBoardLogger(save_dir, name="exp"), CSVLogger(save_dir, name="exp")
        trainer = Trainer(**_kwargs(run_dir, logger=[tb, csv_logger]))
        trainer.fit(TinyModule())
        path = os.path.join(save_dir, "exp", expected)
        assert trainer.log_dir == tb.log_dir == csv_logger.log_dir == path
        assert os.path.exists(os.path.join(path, "checkpoints", "last.ckpt"))
        assert os.path.exists(os.path.join(path, "metrics.csv"))
    assert not os.path.exists(run_dir)  # nothing went to the default root


def _ddp_fit(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    trainer = Trainer(**_kwargs(run_dir, strategy="ddp", devices=world, max_epochs=1))
    trainer.fit(TinyModule())
    return {"log_dir": trainer.log_dir, "last": trainer.checkpoint_callback.last_model_path}


def test_ddp_ranks_agree_on_one_new_version(run_dir: str) -> None:
    first = run_distributed(_ddp_fit, 2, run_dir, timeout=240)
    second = run_distributed(_ddp_fit, 2, run_dir, timeout=240)
    assert {r["log_dir"] for r in first} == {os.path.join(run_dir, "version_0")}
    assert {r["log_dir"] for r in second} == {os.path.join(run_dir, "version_1")}
    assert sorted(os.listdir(run_dir)) == ["version_0", "version_1"]
    assert os.path.exists(second[0]["last"]) and "version_1" in second[1]["last"]


@pytest.mark.timeout(300)
def test_a_spawned_fit_reports_its_run_directory_to_the_launching_trainer(run_dir: str) -> None:
    Trainer(**_kwargs(run_dir, max_epochs=1)).fit(TinyModule())  # version_0 exists
    trainer = Trainer(**_kwargs(run_dir, strategy="ddp", devices=2, max_epochs=1, launcher="spawn"))
    trainer.fit(TinyModule())  # started from here: worker processes, spawned
    assert trainer.log_dir == os.path.join(run_dir, "version_1")
    assert os.path.exists(os.path.join(trainer.log_dir, "checkpoints", "last.ckpt"))


@pytest.mark.timeout(300)
def test_cli_test_after_fit_keeps_the_runs_files_and_prints_its_table(tmp_path: Any) -> None:
    """The issue's case as a user types it: ``polytrain fit`` then ``polytrain test --ckpt last`` into the
    same run_dir; the fit's metrics.csv keeps every row, the test writes its own."""
    run_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(f"""module:
  _target_: conftest.TinyModule
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  log_every_n_steps: 1
  enable_progress_bar: false
  run_dir: {run_dir}
""", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                        os.environ.get("PYTHONPATH", "")])}
    fit = subprocess.run([sys.executable, "-m", "polytrain", "fit", "-c", str(config)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert fit.returncode == 0, fit.stderr[-3000:]
    metrics = run_dir / "version_0" / "metrics.csv"
    rows = _rows(str(metrics))
    # A row per step (the default logger's layout): each epoch's validation and the fit's goodput on the
    # row of the step they followed.
    assert len(rows) == 8 and len([r for r in rows if r.get("train/loss")]) == 8
    assert len([r for r in rows if r.get("val/loss")]) == 2 and rows[-1].get("goodput/productive_fraction")
    test = subprocess.run([sys.executable, "-m", "polytrain", "test", "-c", str(config), "--ckpt", "last"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert test.returncode == 0, test.stderr[-3000:]
    assert "Test metric" in test.stdout and "test/loss" in test.stdout
    assert _rows(str(metrics)) == rows  # every row of the fit is still there
    assert _rows(str(run_dir / "test_0" / "metrics.csv"))[-1]["test/loss"]
    assert ("test: the newest checkpoint of the run in" in test.stderr
            and "version_0" in test.stderr)  # which it read


def test_only_rank_zero_looks_at_a_failed_stages_directory(tmp_path: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed stage rank 0 removes the directory it claimed if it is empty. Another rank listing it at
    that moment found it gone and raised FileNotFoundError, which replaced the stage's own error: the other
    ranks do not look, and rank 0 takes a directory already gone in its stride."""
    from polytrain.trainer.persistence.run_directory import RunDirectory, discard_if_unused

    claimed = tmp_path / "version_1"
    claimed.mkdir()
    run = RunDirectory(str(claimed), claimed=True)

    def removed_meanwhile(path: Any) -> list[str]:
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(os, "listdir", removed_meanwhile)
    discard_if_unused(run, is_global_zero=False)  # the race: rank 0 removed it between isdir and listdir
    discard_if_unused(run, is_global_zero=True)  # gone already: nothing to do
    monkeypatch.undo()
    assert claimed.is_dir()  # not rank 1's to remove
    discard_if_unused(run, is_global_zero=True)
    assert not claimed.exists()  # empty: removed by rank 0
