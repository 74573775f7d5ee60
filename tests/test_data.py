"""Data plumbing under DDP: the injected sampler, evaluation splits, misuse errors, worker seeds.

Every distributed check lives in one spawn (``_data_worker``) because starting two processes costs
far more than the tiny runs themselves; the tests below only read what each rank reported.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_distributed
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from polytrain import Trainer, TrainModule
from polytrain.trainer.loops.guards import EmptyDataError

pytestmark = pytest.mark.torch_api

SEED = 7
NUM_TRAIN = 22  # 11 per rank: batch 3 with drop_last gives 3 batches (4 without), so drop_last shows
BATCH = 3
EPOCHS = 3
# Dyadic values: every partial sum is exact in float32, so "equal to one process" means ==.
VAL_VALUES = [0.5, 1.25, 2.0, 3.5, 7.75]  # mean 3.0; with DistributedSampler's padding (0.5 again) 15.5/6


class IndexDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> int:
        return idx


class ValueDataset(Dataset):
    def __init__(self, values: list[float]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, idx: int) -> torch.Tensor:
        return torch.tensor(self.values[idx])


def tagged_collate(items: list[int]) -> dict[str, Any]:
    """The user's collate: the trainer must hand batches in exactly this shape."""
    return {"idx": torch.tensor(items), "collated_by": "user"}


class ReverseSampler(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class Recorder(TrainModule):
    """Records which samples each epoch's training batches and the validation batches held."""

    def __init__(self, train_loader: DataLoader | None = None, val_loader: DataLoader | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self._train_loader = train_loader
        self._val_loader = val_loader
        self.seen: dict[int, list[list[int]]] = {}
        self.val_seen: list[float] = []
        self.collated_by: set[str] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.collated_by.add(batch["collated_by"])
        self.seen.setdefault(self.current_epoch, []).append(batch["idx"].tolist())
        return (self.w ** 2).sum()  # the data only has to be seen, not learned

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_seen += batch.tolist()
        # Per-batch mean, weighted by the batch size the trainer infers: the epoch value must
        # be the mean over samples of the whole (unpadded) set.
        self.log("val/x", batch.mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader | None:
        return self._train_loader

    def val_dataloader(self) -> DataLoader | None:
        return self._val_loader


def _trainer(run_dir: str, **kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = dict(accelerator="cpu", enable_progress_bar=False, logger=False,
                                    enable_checkpointing=False, run_dir=run_dir, seed=SEED)
    if os.environ.get("WORLD_SIZE", "1") != "1":
        defaults.update(strategy="ddp", devices=2)
    else:
        defaults.update(strategy="single", devices=1)
    defaults.update(kwargs)
    return Trainer(**defaults)


def _val_loader() -> DataLoader:
    return DataLoader(ValueDataset(VAL_VALUES), batch_size=2)


def _hand_built_batches(rank: int, world_size: int, shuffle: bool, epoch: int) -> list[list[int]]:
    sampler = DistributedSampler(IndexDataset(NUM_TRAIN), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=SEED)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i:i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]  # drop_last


def _expect_error(fn: Any, error: type[BaseException]) -> str:
    try:
        fn()
    except error as err:
        return str(err)
    raise AssertionError(f"expected {error.__name__}")


def _data_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    # 1. fit with shuffle + drop_last + the user's collate, and validation every epoch.
    user_loader = DataLoader(IndexDataset(NUM_TRAIN), batch_size=BATCH, shuffle=True, drop_last=True,
                             collate_fn=tagged_collate)
    module = Recorder(user_loader, _val_loader())
    trainer = _trainer(os.path.join(root, "fit"), max_epochs=EPOCHS)
    trainer.fit(module)
    out["seen"] = module.seen
    out["collated_by"] = module.collated_by
    out["fit_val"] = float(trainer.callback_metrics["val/x"])

    # 2. The processed loader itself: every user setting kept, the sampler the documented one.
    def init_fn(worker_id: int) -> None: ...

    for shuffle in (True, False):
        loader = DataLoader(IndexDataset(NUM_TRAIN), batch_size=BATCH, shuffle=shuffle, drop_last=True,
                            collate_fn=tagged_collate, num_workers=2, worker_init_fn=init_fn)
        processed = trainer.strategy.process_dataloader(loader, "train", SEED, True)
        sampler = processed.sampler
        orders = []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        out[f"processed_shuffle={shuffle}"] = {
            "batch_size": processed.batch_size, "drop_last": processed.drop_last,
            "num_workers": processed.num_workers, "user_collate": processed.collate_fn is tagged_collate,
            "is_distributed_sampler": isinstance(sampler, DistributedSampler),
            "sampler": (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed),
            "has_worker_init": processed.worker_init_fn is not None, "orders": orders, "len": len(processed),
        }

    # 3. validate(): 5 samples over 2 ranks, no sample counted twice.
    module = Recorder()
    out["validate"] = _trainer(os.path.join(root, "val")).validate(module, dataloaders=_val_loader())
    out["val_seen"] = module.val_seen

    # 4. A custom sampler is split over the ranks, draw by draw (tests/test_user_samplers.py for the rest).
    custom = DataLoader(IndexDataset(8), batch_size=2, sampler=ReverseSampler(8), collate_fn=tagged_collate)
    custom_module = Recorder(custom)
    _trainer(os.path.join(root, "custom"), max_epochs=1).fit(custom_module)
    out["custom_seen"] = custom_module.seen[0]

    # 5. Data that leaves ranks with no batch: every rank raises, none waits in a gradient all-reduce.
    tiny = DataLoader(IndexDataset(2), batch_size=2, drop_last=True, collate_fn=tagged_collate)
    out["empty_all"] = _expect_error(
        lambda: _trainer(os.path.join(root, "tiny"), max_epochs=1).fit(Recorder(tiny)), EmptyDataError)
    # Fewer samples than ranks: rank 1 would train on a padding copy of rank 0's sample.
    single = DataLoader(IndexDataset(1), batch_size=1, collate_fn=tagged_collate)
    out["fewer_than_ranks"] = _expect_error(
        lambda: _trainer(os.path.join(root, "single"), max_epochs=1).fit(Recorder(single)), EmptyDataError)
    # User-sharded data (no injected sampler) where only rank 1's shard is empty.
    shard = DataLoader(IndexDataset(4 if rank == 0 else 0), batch_size=2, collate_fn=tagged_collate)
    out["empty_one"] = _expect_error(
        lambda: _trainer(os.path.join(root, "shard"), max_epochs=1, use_distributed_sampler=False).fit(
            Recorder(shard)), EmptyDataError)

    # The process group survived all of the above: one more collective completes on every rank.
    total = trainer.strategy.all_reduce(torch.tensor([float(rank + 1)]))
    out["after_errors"] = float(total)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_data_worker, 2, str(tmp_path_factory.mktemp("data")), timeout=150.0)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_injected_sampler_equals_hand_built_distributed_sampler(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        assert sorted(out["seen"]) == list(range(EPOCHS))
        for epoch in range(EPOCHS):
            # What training actually consumed each epoch == the hand-built sampler with set_epoch(epoch).
            assert out["seen"][epoch] == _hand_built_batches(rank, 2, True, epoch), (rank, epoch)
        # set_epoch really reshuffles: no two epochs in the same order.
        orders = [sum(out["seen"][e], []) for e in range(EPOCHS)]
        assert len({tuple(o) for o in orders}) == EPOCHS
        for shuffle in (True, False):
            processed = out[f"processed_shuffle={shuffle}"]
            assert processed["is_distributed_sampler"]
            assert processed["sampler"] == (2, rank, shuffle, SEED)
            for epoch in range(EPOCHS):
                expected = sum(_hand_built_batches(rank, 2, shuffle, epoch), [])
                assert processed["orders"][epoch][: len(expected)] == expected
                assert len(processed["orders"][epoch]) == NUM_TRAIN // 2
    # Ranks hold disjoint halves of the same permutation.
    for epoch in range(EPOCHS):
        rank0, rank1 = (set(sum(r["seen"][epoch], [])) for r in ranks)
        assert not rank0 & rank1


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_user_loader_settings_are_kept(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["collated_by"] == {"user"}
        for epoch in range(EPOCHS):
            # drop_last kept: 11 samples per rank give 3 full batches of 3, never a batch of 2.
            assert [len(b) for b in out["seen"][epoch]] == [BATCH] * 3
        for shuffle in (True, False):
            processed = out[f"processed_shuffle={shuffle}"]
            assert processed["batch_size"] == BATCH
            assert processed["drop_last"] is True
            assert processed["num_workers"] == 2
            assert processed["user_collate"]
            assert processed["has_worker_init"]
            assert processed["len"] == 3


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_validation_metric_on_two_ranks_equals_one_process(ranks: list[dict[str, Any]],
                                                           tmp_path: Any) -> None:
    single = _trainer(str(tmp_path)).validate(Recorder(), dataloaders=_val_loader())
    assert single == [{"val/x": 3.0}]
    for out in ranks:
        assert out["validate"] == single
        assert out["fit_val"] == 3.0
    # Each sample evaluated exactly once over both ranks: no DistributedSampler padding.
    assert sorted(ranks[0]["val_seen"] + ranks[1]["val_seen"]) == VAL_VALUES
    assert len(ranks[0]["val_seen"]) == 3 and len(ranks[1]["val_seen"]) == 2


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_custom_sampler_under_ddp_is_split_between_ranks(ranks: list[dict[str, Any]]) -> None:
    # The sampler yields 7, 6, ..., 0; training puts the draws in DistributedSampler's order for the
    # epoch (the trainer's seed + epoch 0, as Lightning's wrapper) and rank r takes draws r, r + 2, ...
    g = torch.Generator()
    g.manual_seed(SEED)
    draws = [list(range(7, -1, -1))[i] for i in torch.randperm(8, generator=g).tolist()]
    assert ranks[0]["custom_seen"] == [draws[0:4:2], draws[4:8:2]]
    assert ranks[1]["custom_seen"] == [draws[1:4:2], draws[5:8:2]]
    assert sorted(draws) == list(range(8))


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_rank_without_batches_raises_empty_data_error_everywhere(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert "0 batches" in out["empty_all"] and "[0, 1]" in out["empty_all"]
        assert "1 sample(s) for 2 data-parallel ranks" in out["fewer_than_ranks"]
        # Only rank 1 was empty, yet both ranks raised (rank 0 did not wait in an all-reduce).
        assert "rank(s) [1]" in out["empty_one"] and "[2, 0]" in out["empty_one"]
        assert out["after_errors"] == 3.0


def test_custom_sampler_single_process_is_left_alone(tmp_path: Any) -> None:
    # One data-parallel rank: nothing to split, so the user's own order is respected.
    loader = DataLoader(IndexDataset(6), batch_size=2, sampler=ReverseSampler(6), collate_fn=tagged_collate)
    module = Recorder(loader)
    _trainer(str(tmp_path), max_epochs=1).fit(module)
    assert module.seen[0] == [[5, 4], [3, 2], [1, 0]]


# --------------------------------------------------------------------------- worker seeding


_USER_INIT_RAN = False


def _user_worker_init(worker_id: int) -> None:
    global _USER_INIT_RAN
    _USER_INIT_RAN = True


class DrawDataset(Dataset):
    """Each item reports the worker that made it and that worker's next numpy/random/torch draws."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        return torch.tensor([idx, info.id if info else -1, int(np.random.randint(2**31)),
                             random.getrandbits(31), int(torch.randint(2**31, ()))],
                            dtype=torch.int64).unsqueeze(0)


class DrawRecorder(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.rows: dict[int, list[list[int]]] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.rows.setdefault(self.current_epoch, []).extend(batch[:, 0].tolist())
        return (self.w ** 2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _draw_collate(items: list[torch.Tensor]) -> torch.Tensor:
    # Runs in the worker; column 5 says whether the user's worker_init_fn ran there (chained, not replaced).
    rows = torch.stack(items)
    flag = torch.full((rows.shape[0], 1, 1), int(_USER_INIT_RAN), dtype=torch.int64)
    return torch.cat([rows, flag], dim=2)


@pytest.mark.timeout(60)
def test_dataloader_workers_get_distinct_seeds(tmp_path: Any) -> None:
    module = DrawRecorder()
    loader = DataLoader(DrawDataset(), batch_size=2, shuffle=True, num_workers=2, collate_fn=_draw_collate,
                        worker_init_fn=_user_worker_init)
    _trainer(str(tmp_path), max_epochs=2).fit(module, train_dataloaders=loader)
    for epoch in (0, 1):
        rows = module.rows[epoch]
        assert sorted(r[0] for r in rows) == list(range(8))
        assert all(r[5] == 1 for r in rows), "the user's worker_init_fn did not run in the workers"
        by_worker = {w: [r[2:5] for r in rows if r[1] == w] for w in (0, 1)}
        assert by_worker[0] and by_worker[1], "num_workers=2 was not kept"
        # Same position in each worker's stream, different draws: numpy, random and torch are
        # each seeded per worker (identical seeds would make augmentations repeat across workers).
        for source in range(3):
            assert by_worker[0][0][source] != by_worker[1][0][source], ("numpy", "random", "torch")[source]
            draws = [d[source] for w in (0, 1) for d in by_worker[w]]
            assert len(set(draws)) == len(draws)
    # And a new epoch gives new worker seeds rather than replaying the first epoch's draws.
    first = {tuple(r[2:5]) for r in module.rows[0]}
    second = {tuple(r[2:5]) for r in module.rows[1]}
    assert not first & second
