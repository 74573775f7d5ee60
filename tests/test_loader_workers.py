"""DataLoader worker processes end with the pass that used them.

An epoch that ends at its batch count, a fit stopped mid-epoch (``max_steps``) or an evaluation cut at
``limit_*_batches`` never exhausts its iterator, so torch does not stop its workers. Left to the
garbage collector they lived as long as the Trainer, and when the cyclic collector took them, torch
waited 5 s on each worker (whatever triggered the collection stalled: the next fit, a training step).
The loops now stop them when they are done: non-persistent workers at the end of each pass, persistent
ones (kept between epochs, as asked) when the fit or the evaluation ends. Checked on the processes
themselves: which worker processes are alive after each call.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest
import torch
from conftest import TinyModule
from torch.utils.data import DataLoader, Dataset

from polytrain.callbacks import BasePredictionWriter, Callback

pytestmark = pytest.mark.torch_api


class PidDataset(Dataset):
    """Each sample carries the pid of the process that loaded it."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.x[i, :1], os.getpid()


class WorkerModule(TinyModule):
    """TinyModule reading through two loader workers; records which worker pid served each training batch."""

    def __init__(self, persistent: bool = False, fail_at: int | None = None) -> None:
        super().__init__(n=64, val_n=None)
        self.persistent = persistent
        self.fail_at = fail_at
        self.pids_by_epoch: dict[int, set[int]] = {}

    def _loader(self, n: int) -> DataLoader:
        return DataLoader(PidDataset(n), batch_size=4, num_workers=2, persistent_workers=self.persistent)

    def train_dataloader(self) -> DataLoader:
        return self._loader(64)

    def val_dataloader(self) -> DataLoader:
        return self._loader(32)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, pid = batch
        self.pids_by_epoch.setdefault(self.trainer.current_epoch, set()).update(pid.tolist())
        if self.fail_at is not None and self.trainer.global_step == self.fail_at:
            raise RuntimeError("a step failed")
        return super().training_step((x, y), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, _ = batch
        return super().validation_step((x, y), batch_idx)


_EARLIER: set[int] = set()  # children alive before the test (another test's, not this one's concern)


@pytest.fixture(autouse=True)
def _children_before() -> None:
    _EARLIER.clear()
    _EARLIER.update(p.pid for p in multiprocessing.active_children())


def _live_workers() -> list[multiprocessing.Process]:
    """The child processes started during this test that are still alive (``active_children`` also reaps
    those that have ended)."""
    return [p for p in multiprocessing.active_children() if p.pid not in _EARLIER]


@pytest.mark.timeout(120)
def test_a_fit_stopped_mid_epoch_leaves_no_worker_running(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=3, limit_val_batches=2, val_check_interval=2)
    trainer.fit(WorkerModule())
    # The Trainer (and its loop) are still referenced: before, their last iterators kept 4 workers alive.
    assert not _live_workers(), [p.pid for p in _live_workers()]


@pytest.mark.timeout(120)
def test_persistent_workers_serve_every_epoch_then_end_with_the_fit(make_trainer: Any) -> None:
    module = WorkerModule(persistent=True)
    trainer = make_trainer(max_epochs=3, limit_val_batches=2)
    trainer.fit(module)
    assert module.pids_by_epoch[0] == module.pids_by_epoch[1] == module.pids_by_epoch[2]  # kept, as asked
    assert len(module.pids_by_epoch[0]) == 2
    assert not _live_workers(), [p.pid for p in _live_workers()]


@pytest.mark.timeout(120)
def test_reloaded_loaders_stop_the_persistent_workers_of_the_ones_they_replace(make_trainer: Any) -> None:
    module = WorkerModule(persistent=True)
    loaders: list[DataLoader] = []
    build = module._loader

    def recorded(n: int) -> DataLoader:
        loaders.append(build(n))
        return loaders[-1]

    module._loader = recorded  # type: ignore[method-assign]
    make_trainer(max_epochs=3, limit_val_batches=2, reload_dataloaders_every_n_epochs=1,
                 callbacks=[AliveAtEpochStart(loaders)]).fit(module)
    assert len(loaders) == 6  # a train and a val loader for each epoch
    assert len(set().union(*module.pids_by_epoch.values())) == 6  # two workers each epoch, new ones each
    assert not _live_workers(), [p.pid for p in _live_workers()]


class AliveAtEpochStart(Callback):
    """How many worker processes are alive as each epoch's batches start: never more than the current
    train and val loaders' (an old loader's persistent workers are stopped when it is replaced)."""

    def __init__(self, loaders: list[DataLoader]) -> None:
        self.loaders = loaders

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            assert len(_live_workers()) <= 4, len(_live_workers())


@pytest.mark.timeout(120)
def test_non_persistent_workers_are_new_each_epoch_and_gone_after(make_trainer: Any) -> None:
    module = WorkerModule()
    make_trainer(max_epochs=2).fit(module)
    assert not module.pids_by_epoch[0] & module.pids_by_epoch[1]
    assert not _live_workers(), [p.pid for p in _live_workers()]


@pytest.mark.timeout(120)
def test_a_fit_that_raises_leaves_no_worker_running(make_trainer: Any) -> None:
    with pytest.raises(RuntimeError, match="a step failed"):
        make_trainer(max_epochs=2).fit(WorkerModule(persistent=True, fail_at=5))
    assert not _live_workers(), [p.pid for p in _live_workers()]


class Writer(BasePredictionWriter):
    def write_on_batch_end(self, *args: Any) -> None:
        pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent"])
@pytest.mark.parametrize("call", ["validate", "test", "predict"])
def test_an_evaluation_cut_at_its_limit_leaves_no_worker_running(make_trainer: Any, persistent: bool,
                                                                 call: str) -> None:
    module = WorkerModule(persistent=persistent)
    module.test_dataloader = module.predict_dataloader = module.val_dataloader  # type: ignore[method-assign]
    module.test_step = module.validation_step  # type: ignore[method-assign]
    module.predict_step = lambda batch, batch_idx: module(batch[0])  # type: ignore[method-assign]
    # predict with a writer iterates a loader rebuilt to record its batches' indices
    trainer = make_trainer(limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
                           callbacks=[Writer()] if call == "predict" else [])
    getattr(trainer, call)(module)
    assert not _live_workers(), [p.pid for p in _live_workers()]
