"""Goodput: the split of a run's wall time comes from the loop's own clock marks and survives a restart.
A run fails mid-epoch after a checkpoint and is resumed; the productive fraction polytrain reports
equals the one computed by hand from the run's own timestamps (the steps that count, over the wall time
from the first start to the end) within 2 percentage points, and the lost steps are the ones redone."""

from __future__ import annotations

import csv
import logging
import os
import time
from typing import Any

import pytest
import torch
from conftest import TinyModule
from torch.utils.data import DataLoader, Dataset

from polytrain import Trainer
from polytrain.callbacks import ModelCheckpoint

pytestmark = pytest.mark.own_logic

# A step's sleep stands for its work. The by-hand split times each batch from on_train_batch_start to the end
# of its update (training_step, backward and the optimizer inside); the loop also counts its logging and
# bookkeeping between batches, a millisecond or two on a slow machine: long steps keep that small. Saves
# take SAVE_SLEEP more (a loaded machine's slow write); the epoch's save runs inside its validation, and is
# counted once, as checkpoint time.
STEP_SLEEP, FETCH_SLEEP, VAL_SLEEP, SAVE_SLEEP = 0.15, 0.004, 0.01, 0.08


class SlowData(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(FETCH_SLEEP)  # the loop waits for data
        return self.x[i], self.x[i].sum(0, keepdim=True)


class Timed(TinyModule):
    """Notes when each batch's work ran (from its start to the end of its update); fails once, at step
    ``fail_at``, before its update."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.steps: list[tuple[int, float, float]] = []  # (global step before the update, start, end)
        self.fit_started = 0.0
        self._batch_began = (0, 0.0)

    def on_fit_start(self) -> None:
        self.fit_started = time.time()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_began = (self.global_step, time.time())

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("the node went away")
        time.sleep(STEP_SLEEP)
        return super().training_step(batch, batch_idx)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        step, began = self._batch_began
        self.steps.append((step, began, time.time()))

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(VAL_SLEEP)
        return super().validation_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        time.sleep(SAVE_SLEEP)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SlowData(16), batch_size=2)


def _trainer(run_dir: str, **over: Any) -> Trainer:
    return Trainer(**{**dict(strategy="single", accelerator="cpu", devices=1, run_dir=run_dir, max_epochs=2,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             log_every_n_steps=2, logger="csv",
                             callbacks=[ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)]), **over})


def test_goodput_after_one_forced_restart_matches_the_hand_computed_split(run_dir: str, caplog: Any) -> None:
    first = Timed(fail_at=10)
    with pytest.raises(RuntimeError, match="the node went away"):
        _trainer(run_dir).fit(first)
    second = Timed()
    trainer = _trainer(run_dir, resume="last")
    with caplog.at_level(logging.INFO, logger="polytrain"):
        trainer.fit(second)
    ended = time.time()
    split = trainer.fit_loop.goodput.last
    assert split is not None and trainer.ckpt_path.endswith("epoch=0-step=8.ckpt")

    # By hand, from the run's own timestamps: the steps that count are the first attempt's up to the
    # checkpoint it resumed from (step 8) and all of the second's; the wall time runs from the first start.
    kept = [end - begun for step, begun, end in first.steps if step < 8]
    kept += [end - begun for _, begun, end in second.steps]
    wall = ended - first.fit_started
    by_hand = sum(kept) / wall
    assert len(kept) == 16 and [s for s, _, _ in first.steps] == list(range(10))
    assert split["productive_fraction"] == pytest.approx(by_hand, abs=0.02), (split, by_hand)
    assert split["lost_steps"] == 2  # steps 8 and 9 were trained twice; step 10 failed before its update
    redone = sum(end - begun for step, begun, end in first.steps if step >= 8)
    assert split["restart_and_lost"] >= redone
    assert split["data"] >= 16 * 2 * FETCH_SLEEP * 0.9 and split["validation"] > 0 and split["checkpoint"] > 0
    parts = sum(split[k] for k in ("training", "checkpoint", "validation", "data", "restart_and_lost",
                                   "other"))
    assert parts == pytest.approx(split["wall"], rel=1e-6)

    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("goodput:"))
    assert f"{split['productive_fraction']:.1%}" in line and "2 steps trained twice" in line
    with open(os.path.join(trainer.log_dir, "metrics.csv"), newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert float(rows[-1]["goodput/productive_fraction"]) == pytest.approx(split["productive_fraction"])


def test_a_fit_without_a_restart_counts_only_itself(run_dir: str) -> None:
    trainer = _trainer(run_dir, max_epochs=1)
    module = Timed()
    began = time.time()
    trainer.fit(module)
    split = trainer.fit_loop.goodput.last
    by_hand = sum(end - begun for _, begun, end in module.steps) / (time.time() - began)
    assert split["lost_steps"] == 0 and split["restart_and_lost"] == 0
    assert split["productive_fraction"] == pytest.approx(by_hand, abs=0.03)
    # A second fit of the same Trainer is a fit of its own, not a restart of the first.
    trainer.fit_loop.progress.epoch = 0
    trainer.fit(module)
    assert trainer.fit_loop.goodput.last["lost_steps"] == 0
