"""Callbacks on the ``single`` strategy: checkpointing, early stopping, loggers, monitors, progress bar."""

from __future__ import annotations

import csv
import os
import stat
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TinyModule

from polytrain.callbacks import (
    Callback,
    CSVLogger,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    TensorBoardLogger,
)
from polytrain.core.errors import CheckpointError

pytestmark = pytest.mark.own_logic

MakeTrainer = Callable[..., Any]


def ckpt_files(run_dir: str) -> list[str]:
    """The named checkpoints (not last.ckpt), sorted."""
    d = os.path.join(run_dir, "version_0", "checkpoints")
    return sorted(n for n in os.listdir(d) if n.endswith(".ckpt") and n != "last.ckpt")


def latest(run_dir: str) -> str:
    with open(os.path.join(run_dir, "version_0", "checkpoints", "latest"), encoding="utf-8") as fh:
        return fh.read().strip()


class ScoredModule(TinyModule):
    """Logs ``val/score`` = scores[epoch] and remembers its weights at each validation."""

    def __init__(self, scores: list[float], **kwargs: Any) -> None:
        kwargs.setdefault("n", 8)
        kwargs.setdefault("val_n", 4)
        kwargs.setdefault("lr", 0.05)
        super().__init__(**kwargs)
        self.scores = scores
        self.weights_at: dict[int, dict[str, torch.Tensor]] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("val/score", self.scores[self.current_epoch])
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self.weights_at[self.current_epoch] = {k: v.clone() for k, v in self.state_dict().items()}


# --------------------------------------------------------------------------- ModelCheckpoint


def test_every_n_train_steps(make_trainer: MakeTrainer, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=1, callbacks=[
        ModelCheckpoint(save_last=True, every_n_train_steps=2, every_n_epochs=None, save_top_k=-1)])
    trainer.fit(TinyModule(n=32, batch_size=4, lr=0.05, val_n=None))  # 8 steps
    assert ckpt_files(run_dir) == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)]
    assert latest(run_dir) == "epoch=0-step=8.ckpt"
    ckpt = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "epoch=0-step=4.ckpt"),
                      weights_only=True)
    assert ckpt["loop"]["global_step"] == 4 and ckpt["loop"]["batch_in_epoch"] == 4


def test_step_saving_switched_on_between_epochs_takes_effect_in_the_next_one(make_trainer: MakeTrainer,
                                                                            run_dir: str) -> None:
    # Without every_n_train_steps the loop skips the callback's batch hook; it asks again each epoch.
    saver = ModelCheckpoint(save_last=True, every_n_epochs=None, save_top_k=-1, save_on_fit_end=False)

    called: list[list[Any]] = []

    class SwitchOn(Callback):
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            called.append([fn.func.__self__ for fn in trainer.hooks.batch_plan("on_train_batch_end")])
            saver.every_n_train_steps = 3

    trainer = make_trainer(max_epochs=2, callbacks=[saver, SwitchOn()])
    trainer.fit(TinyModule(n=16, batch_size=4, lr=0.05, val_n=None))  # 4 steps per epoch
    assert ckpt_files(run_dir) == ["epoch=1-step=6.ckpt"]
    assert [saver in plan for plan in called] == [False, True]


def test_every_n_epochs(make_trainer: MakeTrainer, run_dir: str) -> None:
    saver = ModelCheckpoint(save_last=True, every_n_epochs=2, save_top_k=-1)
    trainer = make_trainer(max_epochs=4, callbacks=[saver])
    trainer.fit(TinyModule(n=8, batch_size=4, lr=0.05, val_n=None))  # 2 steps per epoch
    assert ckpt_files(run_dir) == ["epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt"]
    ckpt = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "epoch=1-step=4.ckpt"),
                      weights_only=True)
    assert ckpt["loop"]["epoch"] == 2 and ckpt["loop"]["batch_in_epoch"] == 0  # resumes at epoch 2


class MomentumModule(TinyModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def test_checkpoint_contents_load_with_weights_only(make_trainer: MakeTrainer, run_dir: str) -> None:
    module = MomentumModule(n=8, lr=0.05, val_n=None)
    trainer = make_trainer(max_epochs=1, enable_checkpointing=True, seed=7)
    trainer.fit(module)
    path = os.path.join(run_dir, "version_0", "checkpoints", latest(run_dir))
    ckpt = torch.load(path, weights_only=True)
    # Optimizer state is stored under "optimizer", flattened and keyed by parameter name (the
    # format sharded checkpoints share; see checkpoint/checkpoint_io.py).
    assert {"model", "optimizer", "loop", "rng", "config", "polytrain"} <= set(ckpt)
    for k, v in module.state_dict().items():
        assert torch.equal(ckpt["model"][k], v)
    assert ckpt["loop"]["global_step"] == trainer.global_step == 2
    assert ckpt["config"]["trainer"]["seed"] == 7
    assert ckpt["polytrain"]["version"]
    assert len(ckpt["rng"]) == 1 and "torch" in ckpt["rng"][0]
    live = trainer.strategy.optimizers[0]
    assert torch.equal(ckpt["optimizer"]["state.net.weight.momentum_buffer"],
                       live.state[module.net.weight]["momentum_buffer"])
    assert ckpt["optimizer"]["param_groups.net.weight.lr"] == pytest.approx(0.05)


def test_last_ckpt_is_the_newest_checkpoint(make_trainer: MakeTrainer, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=3, callbacks=[ModelCheckpoint(save_last=True, save_top_k=1)])
    trainer.fit(TinyModule(n=8, lr=0.05, val_n=None))
    d = os.path.join(run_dir, "version_0", "checkpoints")
    # Without a monitor, top-k keeps the newest; last.ckpt and the `latest` pointer name it.
    assert ckpt_files(run_dir) == ["epoch=2-step=6.ckpt"]
    assert latest(run_dir) == "epoch=2-step=6.ckpt"
    assert os.path.samefile(os.path.join(d, "last.ckpt"), os.path.join(d, "epoch=2-step=6.ckpt"))


@pytest.mark.parametrize(("mode", "expected_epochs"), [("min", [3, 4]), ("max", [0, 2])])
def test_top_k_with_monitor(make_trainer: MakeTrainer, run_dir: str, mode: str,
                            expected_epochs: list[int]) -> None:
    scores = [5.0, 3.0, 4.0, 1.0, 2.0]
    module = ScoredModule(scores)
    cb = ModelCheckpoint(save_last=True, monitor="val/score", mode=mode, save_top_k=2)
    make_trainer(max_epochs=5, callbacks=[cb]).fit(module)

    # On disk: exactly the top-k (plus last.ckpt, the newest state for `resume: last`).
    assert ckpt_files(run_dir) == [f"epoch={e}-step={2 * (e + 1)}.ckpt" for e in expected_epochs]
    best_epoch = min(expected_epochs, key=lambda e: scores[e] if mode == "min" else -scores[e])
    assert cb.best_model_score == scores[best_epoch]
    assert os.path.basename(cb.best_model_path) == f"epoch={best_epoch}-step={2 * (best_epoch + 1)}.ckpt"
    # The best file holds the weights the module had when it scored best.
    best = torch.load(cb.best_model_path, weights_only=True)
    for k, v in module.weights_at[best_epoch].items():
        assert torch.equal(best["model"][k], v)
    last = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"), weights_only=True)
    assert last["loop"]["global_step"] == 10
    for k, v in module.state_dict().items():
        assert torch.equal(last["model"][k], v)


def test_save_top_k_minus_one_keeps_all(make_trainer: MakeTrainer, run_dir: str) -> None:
    cb = ModelCheckpoint(save_last=True, monitor="val/score", save_top_k=-1)
    make_trainer(max_epochs=3, callbacks=[cb]).fit(ScoredModule([3.0, 1.0, 2.0]))
    assert ckpt_files(run_dir) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"]
    assert cb.best_model_score == 1.0 and cb.best_model_path.endswith("epoch=1-step=4.ckpt")


def test_save_top_k_zero_keeps_only_last(make_trainer: MakeTrainer, run_dir: str) -> None:
    saver = ModelCheckpoint(save_last=True, save_top_k=0)
    make_trainer(max_epochs=2, callbacks=[saver]).fit(TinyModule(n=8, val_n=None))
    assert ckpt_files(run_dir) == []
    assert latest(run_dir) == "last.ckpt"
    ckpt = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"), weights_only=True)
    assert ckpt["loop"]["global_step"] == 4


def test_filename_with_metric(make_trainer: MakeTrainer, run_dir: str) -> None:
    cb = ModelCheckpoint(save_last=True, monitor="val/score", filename="{epoch}-{val_score:.1f}",
                         save_top_k=1)
    make_trainer(max_epochs=2, callbacks=[cb]).fit(ScoredModule([2.0, 1.0]))
    assert ckpt_files(run_dir) == ["epoch=1-val_score=1.0.ckpt"]  # Lightning's automatic `name=`


def test_checkpoint_monitor_not_logged(make_trainer: MakeTrainer) -> None:
    cb = ModelCheckpoint(save_last=True, monitor="val/acc")
    with pytest.raises(KeyError) as info:
        make_trainer(max_epochs=1, callbacks=[cb]).fit(TinyModule(n=8, val_n=4))
    assert "val/acc" in str(info.value) and "val/loss" in str(info.value)


@pytest.mark.parametrize("kwargs", [{"mode": "best"}, {"save_top_k": -2}])
def test_checkpoint_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ModelCheckpoint(save_last=True, **kwargs)


def test_checkpointing_disabled_writes_nothing(make_trainer: MakeTrainer, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=1)
    trainer.fit(TinyModule(n=8, val_n=None))
    assert trainer.checkpoint_callback is None
    assert not os.path.exists(os.path.join(run_dir, "version_0", "checkpoints"))


@pytest.mark.parametrize("logger", [False, True])
def test_unwritable_run_dir_raises_checkpoint_error(make_trainer: MakeTrainer, tmp_path: Any,
                                                    logger: bool) -> None:
    # A path under a regular file can never be created, even by root.
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    bad = str(blocker / "sub")
    module = TinyModule(n=8, val_n=None)
    with pytest.raises(CheckpointError) as info:
        make_trainer(max_epochs=1, run_dir=bad, enable_checkpointing=True, logger=logger).fit(module)
    assert bad in str(info.value) and "writable" in str(info.value)


def test_read_only_run_dir_raises_checkpoint_error(make_trainer: MakeTrainer, tmp_path: Any) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)  # 0o500
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: chmod does not stop writes (the file-path variant covers this)")
        with pytest.raises(CheckpointError) as info:
            make_trainer(max_epochs=1, run_dir=str(ro), enable_checkpointing=True).fit(
                TinyModule(n=8, val_n=None))
        assert str(ro) in str(info.value)
    finally:
        ro.chmod(0o700)


# --------------------------------------------------------------------------- EarlyStopping


def test_early_stopping_after_patience(make_trainer: MakeTrainer) -> None:
    module = ScoredModule([3.0, 2.0, 2.5, 2.1, 2.2, 0.1, 0.0, 0.0])
    es = EarlyStopping(monitor="val/score", patience=3, verbose=False)
    trainer = make_trainer(max_epochs=8, callbacks=[es])
    trainer.fit(module)
    # Best 2.0 at epoch 1; epochs 2, 3, 4 do not improve -> stop after epoch 4.
    assert trainer.current_epoch == 5 and es.stopped_epoch == 4
    assert es.best_score == 2.0 and es.wait_count == 3
    assert trainer.global_step == 10


def test_early_stopping_mode_max_and_min_delta(make_trainer: MakeTrainer) -> None:
    # Improvements smaller than min_delta do not reset the patience counter.
    es = EarlyStopping(monitor="val/score", mode="max", patience=2, min_delta=0.5, verbose=False)
    trainer = make_trainer(max_epochs=6, callbacks=[es])
    trainer.fit(ScoredModule([1.0, 1.2, 1.4, 3.0, 3.1, 3.2]))
    assert es.stopped_epoch == 2 and trainer.current_epoch == 3


def test_early_stopping_keeps_training_while_improving(make_trainer: MakeTrainer) -> None:
    es = EarlyStopping(monitor="val/score", patience=1, verbose=False)
    trainer = make_trainer(max_epochs=4, callbacks=[es])
    trainer.fit(ScoredModule([4.0, 3.0, 2.0, 1.0]))
    assert es.stopped_epoch == 0 and trainer.current_epoch == 4


def test_early_stopping_stopping_threshold(make_trainer: MakeTrainer) -> None:
    es = EarlyStopping(monitor="val/score", patience=10, stopping_threshold=1.5, verbose=False)
    trainer = make_trainer(max_epochs=5, callbacks=[es])
    trainer.fit(ScoredModule([3.0, 2.0, 1.0, 0.5, 0.2]))
    assert es.stopped_epoch == 2 and "threshold" in es.reason


def test_early_stopping_unknown_monitor_lists_logged(make_trainer: MakeTrainer) -> None:
    es = EarlyStopping(monitor="val/acc")
    with pytest.raises(KeyError) as info:
        make_trainer(max_epochs=2, callbacks=[es]).fit(ScoredModule([1.0, 1.0]))
    msg = str(info.value)
    assert "val/acc" in msg and "val/score" in msg and "val/loss" in msg


# --------------------------------------------------------------------------- loggers


def read_csv(path: str) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_csv_logger_rows(make_trainer: MakeTrainer, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=2, logger="csv")
    trainer.fit(TinyModule(n=8, batch_size=4, val_n=4, lr=0.05))
    assert any(isinstance(cb, CSVLogger) for cb in trainer.callbacks)
    rows = read_csv(os.path.join(run_dir, "version_0", "metrics.csv"))
    # logger="csv" writes a row per step: each validation's values on the row of the training step it
    # followed (the same step and epoch); a CSVLogger built by hand writes Lightning's row per call.
    assert [(int(r["step"]), r["epoch"]) for r in rows if r["train/loss"]] == [(1, "0"), (2, "0"), (3, "1"),
                                                                               (4, "1")]
    validation = [r for r in rows if r["val/loss"]]
    assert [(int(r["step"]), r["epoch"], bool(r["train/loss"])) for r in validation] == [(2, "0", True),
                                                                                      (4, "1", True)]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]  # the fit's goodput, at its end, on the last
    assert float(validation[-1]["val/loss"]) == pytest.approx(float(trainer.callback_metrics["val/loss"]))


def test_csv_logger_resume_keeps_earlier_rows(quiet_kwargs: dict[str, Any], run_dir: str) -> None:
    from polytrain import Trainer

    kwargs = {**quiet_kwargs, "logger": "csv", "enable_checkpointing": True}
    Trainer(**kwargs, max_epochs=1).fit(TinyModule(n=8, val_n=None, lr=0.05))
    first = read_csv(os.path.join(run_dir, "version_0", "metrics.csv"))
    assert [int(r["step"]) for r in first if r["train/loss"]] == [1, 2]

    resumed = Trainer(**kwargs, max_epochs=2)
    resumed.fit(TinyModule(n=8, val_n=None, lr=0.05), ckpt_path="last")
    rows = read_csv(os.path.join(run_dir, "version_0", "metrics.csv"))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == [1, 2, 3, 4]
    # The resumed run did not overwrite what came before the checkpoint.
    assert [{k: r[k] for k in first[0]} for r in rows[:len(first)]] == first


def test_tensorboard_logger_writes_scalars(make_trainer: MakeTrainer, run_dir: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(max_epochs=1, logger="tensorboard")
    trainer.fit(TinyModule(n=12, batch_size=4, val_n=4, lr=0.05))
    assert any(isinstance(cb, TensorBoardLogger) for cb in trainer.callbacks)
    log_dir = os.path.join(run_dir, "version_0")
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(log_dir))
    acc = EventAccumulator(log_dir)
    acc.Reload()
    assert {"train/loss", "val/loss"} <= set(acc.Tags()["scalars"])
    train = acc.Scalars("train/loss")
    assert [e.step for e in train] == [1, 2, 3]
    val = acc.Scalars("val/loss")
    assert [e.step for e in val] == [3]
    assert val[0].value == pytest.approx(float(trainer.callback_metrics["val/loss"]), rel=1e-6)


def test_default_logger_is_tensorboard_and_csv(quiet_kwargs: dict[str, Any]) -> None:
    from polytrain import Trainer

    trainer = Trainer(**{**quiet_kwargs, "logger": True})
    kinds = {type(cb) for cb in trainer.loggers}
    assert kinds == {TensorBoardLogger, CSVLogger}


def test_unknown_logger_name() -> None:
    from polytrain import Trainer
    from polytrain.trainer.configuration.config import ConfigError

    with pytest.raises(ConfigError, match="neptune"):
        Trainer(logger="neptune", enable_progress_bar=False)


# --------------------------------------------------------------------------- monitors and progress bar


class StepLRModule(TinyModule):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_learning_rate_monitor_logs_lr(make_trainer: MakeTrainer, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=1, logger="csv", callbacks=[LearningRateMonitor()])
    trainer.fit(StepLRModule(n=12, batch_size=4, val_n=None))
    rows = [r for r in read_csv(os.path.join(run_dir, "version_0", "metrics.csv")) if r.get("lr-SGD")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    # As Lightning: logged before the step, the rate that step uses (step n: after n - 1 scheduler steps).
    for r in rows:
        assert float(r["lr-SGD"]) == pytest.approx(0.1 * 0.5 ** (int(r["step"]) - 1))


def test_learning_rate_monitor_epoch_interval(make_trainer: MakeTrainer, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=2, logger="csv", log_every_n_steps=50,
                           callbacks=[LearningRateMonitor(logging_interval="epoch")])
    trainer.fit(StepLRModule(n=8, batch_size=4, val_n=None))
    rows = read_csv(os.path.join(run_dir, "version_0", "metrics.csv"))
    lrs = {int(r["step"]): float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")}
    assert lrs == {1: pytest.approx(0.1), 3: pytest.approx(0.1 * 0.5**2)}  # at the step that comes next


def test_learning_rate_monitor_follows_the_loops_cadence_under_two_manual_optimizers(
        make_trainer: MakeTrainer) -> None:
    """Two optimizers stepped by hand advance global_step twice a batch; the rates are logged at the loop's
    logging steps, every ``log_every_n_steps`` batches that stepped, as Lightning."""

    class TwoByHand(TinyModule):
        def __init__(self) -> None:
            super().__init__(n=28, batch_size=4, val_n=None)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            for opt in self.optimizers():
                loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters(), lr=0.01)]

    monitor = LearningRateMonitor(logging_interval="step")
    trainer = make_trainer(max_epochs=2, log_every_n_steps=2, callbacks=[monitor])
    trainer.fit(TwoByHand())
    assert trainer.global_step == 28  # 7 batches x 2 epochs x 2 optimizers
    assert {name: len(values) for name, values in monitor.lrs.items()} == {"lr-SGD": 7, "lr-Adam": 7}


def test_learning_rate_monitor_bad_interval() -> None:
    with pytest.raises(ValueError, match="step, epoch, None"):
        LearningRateMonitor(logging_interval="batch")


def test_progress_bar_disabled(make_trainer: MakeTrainer, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(max_epochs=1, enable_progress_bar=False)
    trainer.fit(TinyModule(n=8, val_n=4))
    assert not any(isinstance(cb, ProgressBar) for cb in trainer.callbacks)
    captured = capsys.readouterr()
    assert "Epoch 0" not in captured.out + captured.err


def test_progress_bar_enabled_draws(make_trainer: MakeTrainer, capsys: pytest.CaptureFixture[str]) -> None:
    # The counterpart of the test above: the same run with the bar on does print it.
    trainer = make_trainer(max_epochs=1, enable_progress_bar=True)
    trainer.fit(TinyModule(n=8, val_n=4))
    assert sum(isinstance(cb, ProgressBar) for cb in trainer.callbacks) == 1
    assert "Epoch 0" in capsys.readouterr().out


def test_monitored_checkpoint_before_any_validation_saves_last_only(make_trainer: MakeTrainer,
                                                                    run_dir: str) -> None:
    # max_steps ends the run before the first validation: nothing to rank by, but `last` must
    # still be written so the run can be resumed, and no KeyError may escape.
    cb = ModelCheckpoint(save_last=True, monitor="val/score", mode="max", save_top_k=1)
    trainer = make_trainer(max_epochs=3, max_steps=2, callbacks=[cb])
    trainer.fit(ScoredModule([0.1, 0.2, 0.3], n=32, batch_size=4))  # 8 steps per epoch
    assert ckpt_files(run_dir) == []
    assert latest(run_dir) == "last.ckpt"
    loop = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"),
                      weights_only=True)["loop"]
    assert loop["global_step"] == 2


def test_model_summary_prints_parameter_table(make_trainer: MakeTrainer, capsys: Any) -> None:
    from polytrain.callbacks import ModelSummary

    module = TinyModule(n=8, batch_size=4, val_n=None)
    make_trainer(max_epochs=1, enable_model_summary=True).fit(module)
    out = capsys.readouterr().out
    total = sum(p.numel() for p in module.parameters())
    assert f"{total} trainable / {total} total parameters" in out
    assert not any(isinstance(c, ModelSummary) for c in make_trainer(enable_model_summary=False).callbacks)


def test_deterministic_turns_on_deterministic_algorithms(make_trainer: MakeTrainer) -> None:
    try:
        make_trainer(max_epochs=1, deterministic=True).fit(TinyModule(n=8, batch_size=4, val_n=None))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_resumed_run_prunes_checkpoints_of_the_first_run(make_trainer: MakeTrainer, run_dir: str) -> None:
    # The checkpoint being written must be in its own saved bookkeeping, or a resumed run never
    # learns about it and never deletes it.
    kwargs = dict(enable_checkpointing=True)
    make_trainer(max_epochs=2, **kwargs).fit(TinyModule(n=16, batch_size=4, val_n=None))
    assert ckpt_files(run_dir) == ["epoch=1-step=8.ckpt"]
    make_trainer(max_epochs=3, resume="last", **kwargs).fit(TinyModule(n=16, batch_size=4, val_n=None))
    assert ckpt_files(run_dir) == ["epoch=2-step=12.ckpt"]


def test_csv_logger_writes_only_what_changed_and_drops_rows_past_a_resume(tmp_path: Any) -> None:
    from types import SimpleNamespace

    path = tmp_path / "version_0" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("step,train/loss\n" + "".join(f"{s},{s / 10}\n" for s in range(1, 7)), encoding="utf-8")
    logger = CSVLogger(str(tmp_path), name="", version=0)
    logger.on_fit_start(SimpleNamespace(is_logging_rank=True, global_step=3), None)  # resumed at step 3
    logger.flush()
    with open(path, newline="", encoding="utf-8") as fh:
        # the interrupted run's 4..6 are gone
        assert [int(r["step"]) for r in csv.DictReader(fh)] == [1, 2, 3]
    path.unlink()
    logger.flush()  # nothing logged since the last write: nothing to write
    assert not path.exists()
    logger.log_metrics({"train/loss": 0.5}, 4)
    logger.flush()
    with open(path, newline="", encoding="utf-8") as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh)] == [1, 2, 3, 4]


def test_a_model_checkpoint_given_with_checkpointing_disabled_is_said_and_kept(make_trainer: MakeTrainer,
                                                                            run_dir: str) -> None:
    """Both asked for: the callback (the more particular) saves, and the contradiction is said once
    (Lightning refuses the pair; polytrain was silent)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(max_epochs=1, enable_checkpointing=False,
                               callbacks=[ModelCheckpoint(save_last=True, monitor="val/loss")])
    said = [str(w.message) for w in caught if "enable_checkpointing" in str(w.message)]
    assert said == ["enable_checkpointing=False, but the callbacks hold 1 ModelCheckpoint: it saves "
                    "checkpoints as configured. Remove it from the callbacks to save none"]
    trainer.fit(TinyModule(n=8, batch_size=4, val_n=4))
    assert os.listdir(os.path.join(run_dir, "version_0", "checkpoints"))


def test_csv_logger_rows_names_its_layouts() -> None:
    with pytest.raises(ValueError, match=r"CSVLogger rows='per_step'; valid: call, step"):
        CSVLogger("runs", rows="per_step")
