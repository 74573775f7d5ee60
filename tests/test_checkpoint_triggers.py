"""``ModelCheckpoint(train_time_interval=...)`` (rank 0's clock decides, at a few agreed check steps) and
"keep the last k" (``save_top_k=k`` without ``monitor``)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from async_ckpt_module import Lin
from distributed import run_distributed

from polytrain import Trainer
from polytrain.callbacks.model_checkpoint import ModelCheckpoint

pytestmark = pytest.mark.own_logic

STEP_SECONDS = 0.02


class Slow(Lin):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(STEP_SECONDS)
        return super().training_step(batch, batch_idx)


class Saved(ModelCheckpoint):
    """Records the step of every save, and when it was decided (the clock just before the save)."""

    def _save(self, trainer: Any) -> None:
        self.__dict__.setdefault("times", []).append(time.monotonic())
        super()._save(trainer)
        self.__dict__.setdefault("steps", []).append(trainer.global_step)


def _fit(root: str, saver: ModelCheckpoint, max_steps: int, strategy: str = "single", devices: int = 1,
         module: Any = None) -> Trainer:
    t = Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, max_epochs=100,
                run_dir=root, seed=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[saver])
    t.fit(module if module is not None else Lin())
    return t


@pytest.mark.timeout(120)
def test_time_interval_saves_by_the_clock_with_few_checks(tmp_path: Path) -> None:
    saver = Saved(train_time_interval=timedelta(seconds=0.25), every_n_epochs=None, save_top_k=-1,
                  save_on_fit_end=False)
    _fit(str(tmp_path), saver, max_steps=60, module=Slow())  # >= 1.2 s of steps: about 4 intervals
    steps = saver.__dict__.get("steps", [])
    times = saver.__dict__.get("times", [])
    assert 2 <= len(steps) <= 8, steps
    # never early by the clock: the interval counts from the decision before the previous save (a loaded
    # machine makes the steps slower, so the clock is what is checked, not a number of steps)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.25 * 0.9, gaps
    assert saver._timer.checks <= 40, saver._timer.checks  # fewer broadcasts than steps even here


class _OneRank:
    is_global_zero = True

    @staticmethod
    def broadcast(obj: Any) -> Any:
        return obj


def test_time_trigger_checks_a_few_times_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from polytrain.callbacks import time_trigger

    clock = [0.0]
    monkeypatch.setattr(time_trigger.time, "monotonic", lambda: clock[0])
    trigger = time_trigger.TimeTrigger(timedelta(minutes=1))
    trigger.start(0)
    saves = []
    for step in range(1, 100 * 600 + 1):  # 10 minutes at 100 steps/s
        clock[0] = step / 100
        if trigger.due(step, _OneRank):
            saves.append(step)
    assert len(saves) >= 9 and all(6000 <= b - a <= 6000 * 1.03 for a, b in zip([0, *saves], saves)), saves
    assert trigger.checks <= 10 * 8, trigger.checks  # about log2(25) + 2 per interval, not 6000


def test_time_interval_excludes_step_interval() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        ModelCheckpoint(every_n_train_steps=5, train_time_interval=timedelta(minutes=1))
    with pytest.raises(ValueError, match="must be positive"):
        ModelCheckpoint(train_time_interval=timedelta(0))


def _time_worker(rank: int, world: int, root: str) -> list[int]:
    saver = Saved(train_time_interval=timedelta(seconds=0.2), every_n_epochs=None, save_top_k=-1,
                  save_on_fit_end=False)
    # Rank 1's steps are slower: its clock would disagree with rank 0's; rank 0 decides for both.
    module = Slow() if rank == 0 else type("Slower", (Slow,), {"training_step": _slower})()
    _fit(root, saver, max_steps=40, strategy="ddp", devices=world, module=module)
    return saver.__dict__.get("steps", [])


def _slower(self: Any, batch: Any, batch_idx: int) -> Any:
    time.sleep(STEP_SECONDS)
    return Slow.training_step(self, batch, batch_idx)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_time_interval_decision_is_the_same_on_every_rank(tmp_path: Path) -> None:
    steps = run_distributed(_time_worker, 2, str(tmp_path), timeout=240)
    assert steps[0] == steps[1] and len(steps[0]) >= 2, steps


@pytest.mark.timeout(120)
def test_save_top_k_without_monitor_keeps_the_last_k(tmp_path: Path) -> None:
    saver = ModelCheckpoint(every_n_train_steps=1, every_n_epochs=None, save_top_k=2, save_last=False)
    t = _fit(str(tmp_path), saver, max_steps=5)
    names = sorted(n for n in os.listdir(saver.dirpath) if n.endswith(".ckpt"))
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt"], names
    assert t.checkpoint_callback.best_model_path.endswith("step=5.ckpt")  # "best" without monitor: the newest
