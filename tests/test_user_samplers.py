"""A user's own sampler or batch sampler under data parallelism: split over the ranks (``SplitSampler``).

The ranks together consume exactly what the sampler yields in one process, each draw once (beyond the
documented padding), even when the sampler draws from the global RNG while training steps run on
per-rank streams; the global batch k equals one process's batch k of size B x N (parity of weights);
validation counts nothing twice; a mid-epoch resume continues with the same draws (weights bitwise, only
the remaining samples loaded); a resume at another data-parallel size is refused.

The distributed checks share one spawn (``_ddp_worker``); the tests read what each rank reported.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from test_data import ReverseSampler as Reverse  # yields n-1, ..., 0
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    Sampler,
    WeightedRandomSampler,
)

from polytrain import Trainer, TrainModule
from polytrain.callbacks import Callback
from polytrain.core.errors import SamplerError
from polytrain.data.loaders import distribute_dataloader, set_epoch
from polytrain.data.user_samplers import SplitSampler

pytestmark = pytest.mark.own_logic

N = 24  # 12 draws per rank: batch 3 gives 4 batches a rank, one process 4 batches of 6
BATCH = 3
SEED = 11
EPOCHS = 2
SAVE_AT = 6  # epoch 1, batch 2: a resume mid-way through a reseeded epoch
VAL_VALUES = [0.5, 1.25, 2.0, 3.5, 7.75]  # dyadic: the mean (3.0) is exact; a padded copy would change it


class Indexed(Dataset):
    """Sample i: (i, x_i, y_i) of a fixed regression problem; counts what is loaded."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.randn(4, 1, generator=g)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        self.loaded += 1
        return i, self.x[i], self.y[i]


def weighted(n: int = N) -> WeightedRandomSampler:
    """No generator: it draws from the global torch RNG, which differs between ranks during training."""
    return WeightedRandomSampler(torch.linspace(0.1, 1.0, n).tolist(), num_samples=n, replacement=True)


def seeded(n: int = N) -> WeightedRandomSampler:
    """Its own generator: the draws go on from epoch to epoch, as in one process."""
    return WeightedRandomSampler(torch.linspace(0.1, 1.0, n).tolist(), num_samples=n, replacement=True,
                                 generator=torch.Generator().manual_seed(5))


class PyShuffle(Sampler[int]):
    """A custom sampler drawing from Python's global ``random``; records the epochs it was told."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


class Buckets(Sampler[list[int]]):
    """A bucketing batch sampler: indices grouped into fixed buckets, batches shuffled by the global RNG."""

    def __init__(self, n: int, size: int, drop_last: bool = False) -> None:
        self.batches = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        return iter([self.batches[i] for i in torch.randperm(len(self.batches)).tolist()])

    def __len__(self) -> int:
        return len(self.batches)


class Values(Dataset):
    def __len__(self) -> int:
        return len(VAL_VALUES)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(VAL_VALUES[i])


class Learner(TrainModule):
    def __init__(self, train: DataLoader, val: DataLoader | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.net.weight.copy_(torch.tensor([[0.1, -0.2, 0.3, -0.4]]))
            self.net.bias.fill_(0.05)
        self.train_loader, self.val_loader = train, val
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.seen.append((self.current_epoch, idx.tolist()))
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/x", batch.mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return self.train_loader

    def val_dataloader(self) -> DataLoader | None:
        return self.val_loader


class SaveAt(Callback):
    """Every rank saves at the same step (the step count is the same everywhere)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _trainer(run_dir: str, world: int, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = dict(accelerator="cpu", enable_progress_bar=False, logger=False, seed=SEED,
                                   enable_checkpointing=False, run_dir=run_dir, num_sanity_val_steps=0,
                                   max_epochs=EPOCHS, strategy="ddp" if world > 1 else "single",
                                   devices=world)
    options.update(kwargs)
    return Trainer(**options)


def _weights(module: TrainModule) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _fit(root: str, world: int, loader: DataLoader, ckpt_path: str | None = None,
         **kwargs: Any) -> dict[str, Any]:
    module = Learner(loader)
    _trainer(root, world, **kwargs).fit(module, ckpt_path=ckpt_path)
    return {"seen": module.seen, "weights": _weights(module), "loaded": loader.dataset.loaded}


def _ddp_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ckpt = os.path.join(root, "mid.ckpt")
    # Global-RNG samplers: the ranks' draws agree although the training streams differ per rank.
    out["weighted"] = _fit(os.path.join(root, "w"), world, DataLoader(Indexed(), BATCH, sampler=weighted()),
                           callbacks=[SaveAt(SAVE_AT, ckpt)])
    resumed_loader = DataLoader(Indexed(), BATCH, sampler=weighted())
    out["resumed"] = _fit(os.path.join(root, "r"), world, resumed_loader, ckpt_path=ckpt)
    # A sampler with its own generator: a resume in epoch 1 must continue from that epoch's generator state.
    ckpt_gen = os.path.join(root, "gen.ckpt")
    out["generator"] = _fit(os.path.join(root, "g"), world, DataLoader(Indexed(), BATCH, sampler=seeded()),
                            callbacks=[SaveAt(SAVE_AT, ckpt_gen)])
    out["generator_resumed"] = _fit(os.path.join(root, "gr"), world,
                                    DataLoader(Indexed(), BATCH, sampler=seeded()), ckpt_path=ckpt_gen)
    py = PyShuffle(N)
    out["python"] = _fit(os.path.join(root, "p"), world, DataLoader(Indexed(), BATCH, sampler=py))
    out["python_epochs"] = py.epochs
    for name, sampler in (("buckets", Buckets(N - 3, 3)),
                          ("buckets_drop", Buckets(N - 3, 3, drop_last=True))):
        out[name] = _fit(os.path.join(root, name), world, DataLoader(Indexed(), batch_sampler=sampler))
    val = DataLoader(Values(), batch_size=2, sampler=Reverse(len(VAL_VALUES)))
    metrics = _trainer(os.path.join(root, "v"), world).validate(Learner(val, val), dataloaders=val)
    out["val"] = metrics[0]["val/x"] if isinstance(metrics, list) else metrics["val/x"]
    out["ckpt"] = ckpt
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_ddp_worker, 2, str(tmp_path_factory.mktemp("user_samplers")), timeout=240.0)


def _draws(sampler: Any, epoch: int, shuffle: bool = False) -> list[Any]:
    """What the sampler yields in one process in ``epoch`` under polytrain's seeding (trainer seed + epoch),
    with ``shuffle`` in the order training splits them (DistributedSampler's, seeded by seed + epoch)."""
    split = SplitSampler(sampler, 1, 0, SEED, pad=True, shuffle=shuffle)
    split.set_epoch(epoch)
    return list(split)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_global_rng_samplers_are_split_draw_by_draw(ranks: list[dict[str, Any]]) -> None:
    for name, make in (("weighted", weighted), ("python", lambda: PyShuffle(N))):
        for epoch in range(EPOCHS):
            draws = _draws(make(), epoch, shuffle=True)
            for rank, out in enumerate(ranks):
                taken = [i for e, batch in out[name]["seen"] if e == epoch for i in batch]
                assert taken == draws[rank::2], (name, epoch, rank)  # interleaved, as DistributedSampler
        assert ranks[0][name]["seen"] != ranks[1][name]["seen"]
    assert ranks[0]["python_epochs"] == list(range(EPOCHS))  # set_epoch reaches the user's sampler


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_global_batch_equals_one_process_batch_of_size_b_times_n(ranks: list[dict[str, Any]],
                                                                 tmp_path: Any) -> None:
    # One process reading the order two ranks read together ("always"), batch 2 x 3.
    single = _fit(str(tmp_path), 1, DataLoader(Indexed(), 2 * BATCH, sampler=weighted()),
                  use_distributed_sampler="always")
    for step, (epoch, batch) in enumerate(single["seen"]):
        together = ranks[0]["weighted"]["seen"][step][1] + ranks[1]["weighted"]["seen"][step][1]
        assert sorted(together) == sorted(batch) and ranks[0]["weighted"]["seen"][step][0] == epoch, step
    for out in ranks:
        for mine, one in zip(out["weighted"]["weights"], single["weights"]):
            torch.testing.assert_close(mine, one, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_batch_sampler_is_split_batch_by_batch(ranks: list[dict[str, Any]]) -> None:
    for epoch in range(EPOCHS):
        batches = _draws(Buckets(N - 3, 3), epoch)  # 7 whole batches
        assert len(batches) == 7
        shares = [[b for e, b in out["buckets"]["seen"] if e == epoch] for out in ranks]
        padded = batches + batches[:1]  # pad to equal counts from the epoch's start
        assert shares == [padded[0::2], padded[1::2]]
        # drop_last=True on the user's batch sampler: the tail batch is dropped instead
        shares = [[b for e, b in out["buckets_drop"]["seen"] if e == epoch] for out in ranks]
        assert shares == [batches[0:6:2], batches[1:6:2]]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_evaluation_split_counts_every_sample_once(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["val"] == pytest.approx(sum(VAL_VALUES) / len(VAL_VALUES), abs=0)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_mid_epoch_resume_continues_the_same_draws(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        full, resumed = out["generator"], out["generator_resumed"]
        assert resumed["seen"] == full["seen"][SAVE_AT:]
        assert all(torch.equal(a, b) for a, b in zip(resumed["weights"], full["weights"]))
        epochs = [sorted(i for e, b in full["seen"] if e == epoch for i in b) for epoch in range(EPOCHS)]
        assert epochs[0] != epochs[1]  # the generator went on: epoch 1 drew anew
        full, resumed = out["weighted"], out["resumed"]
        assert resumed["seen"] == full["seen"][SAVE_AT:]
        for a, b in zip(resumed["weights"], full["weights"]):
            assert torch.equal(a, b)
        # The consumed batches were skipped by position, not loaded again.
        assert resumed["loaded"] == (len(full["seen"]) - SAVE_AT) * BATCH


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_resume_at_another_data_parallel_size_is_refused(ranks: list[dict[str, Any]], tmp_path: Any) -> None:
    loader = DataLoader(Indexed(), BATCH, sampler=weighted())
    with pytest.raises(SamplerError, match="cannot be re-split") as err:
        _fit(str(tmp_path), 1, loader, ckpt_path=ranks[0]["ckpt"])
    assert "WeightedRandomSampler" in str(err.value) and "2 data-parallel" in str(err.value)


# ---------------------------------------------------------------- one process: the split itself


def test_ranks_draw_alike_whatever_their_global_rng_and_leave_it_untouched() -> None:
    expected = _draws(weighted(), 3)
    shares = []
    for rank in range(3):
        torch.manual_seed(100 + rank)  # training streams differ per rank when the sampler is iterated
        random.seed(100 + rank)
        before = torch.get_rng_state()
        split = SplitSampler(weighted(), 3, rank, SEED, pad=True)
        split.set_epoch(3)
        shares.append(list(split))
        assert torch.equal(torch.get_rng_state(), before)  # the draws leave no trace in the stream
    assert [i for k in range(len(expected) // 3)
            for i in (shares[0][k], shares[1][k], shares[2][k])] == expected


def test_padding_and_evaluation_rules() -> None:
    user = list(range(7))  # any iterable with a length serves as a sampler
    assert ([list(SplitSampler(user, 3, r, 0, pad=True)) for r in range(3)]
            == [[0, 3, 6], [1, 4, 0], [2, 5, 1]])
    assert [list(SplitSampler(user, 3, r, 0, pad=False)) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert ([list(SplitSampler(user, 3, r, 0, pad=True, drop_tail=True)) for r in range(3)]
            == [[0, 3], [1, 4], [2, 5]])
    assert ([len(SplitSampler(user, 3, r, 0, pad=p)) for p in (True, False) for r in range(3)]
            == [3, 3, 3, 3, 2, 2])


def test_which_loaders_are_split() -> None:
    ds = Indexed()
    by_index = distribute_dataloader(DataLoader(ds, BATCH, sampler=weighted()), 2, 1, SEED, "train")
    assert isinstance(by_index.sampler, SplitSampler) and by_index.batch_size == BATCH
    wrapped = distribute_dataloader(DataLoader(ds, batch_sampler=BatchSampler(weighted(), 4, True)), 2, 1,
                                    SEED, "train")
    assert isinstance(wrapped.sampler, SplitSampler) and (wrapped.batch_size, wrapped.drop_last) == (4, True)
    by_batch = distribute_dataloader(DataLoader(ds, batch_sampler=Buckets(N, 3)), 2, 0, SEED, "val")
    assert isinstance(by_batch.batch_sampler, SplitSampler) and not by_batch.batch_sampler.pad
    own = DataLoader(ds, BATCH, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    assert distribute_dataloader(own, 2, 0, SEED, "train") is own  # already split by the user
    mine = DataLoader(ds, BATCH, sampler=weighted())
    assert distribute_dataloader(mine, 2, 0, SEED, "train", use_sampler=False) is mine
    assert distribute_dataloader(mine, 1, 0, SEED, "train") is mine  # one rank: the user's loader as built


def test_set_epoch_reaches_the_users_sampler_on_one_process() -> None:
    sampler = PyShuffle(4)
    set_epoch(DataLoader(Indexed(4), 2, sampler=sampler), 5)
    assert sampler.epochs == [5]  # once, although both loader.sampler and batch_sampler.sampler name it
