"""An ``IterableDataset`` whose ranks yield different numbers of batches ends the epoch together.

polytrain cannot split an iterable over data-parallel ranks (it has no indices), so each rank
iterates its own stream, and streams may end at different batches. The loop used to call
``next()`` for every batch it had counted (``limit_train_batches``, or the dataset's ``__len__``),
so the rank that ran out first died with a bare ``StopIteration`` while its peer waited in the
gradient all-reduce. Now every rank learns, before each batch, whether every rank still has one,
and all of them end the epoch at the shortest rank's end (the last batch closes its accumulation
window). And polytrain warns, once, that an iterable is not split across ranks, with the way to
shard it.

Reference: plain PyTorch ``DistributedDataParallel`` on the same gloo group, over the batches every
rank has (the shortest rank's count), ``no_sync`` inside accumulation windows. Bitwise.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.own_logic

SEED = 0
BATCH = 2
PER_RANK_BATCHES = (6, 4)  # rank 0's stream is longer


class RankStream(IterableDataset):
    """Rank r's own stream of PER_RANK_BATCHES[r] batches (sharded by hand, as the warning advises)."""

    def __init__(self, claimed_len: int | None = None) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.claimed_len = claimed_len

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(100 + self.rank)
        for _ in range(PER_RANK_BATCHES[self.rank] * BATCH):
            x = torch.randn(4, generator=g)
            yield x, x.sum(0, keepdim=True)


class WithLen(RankStream):
    def __len__(self) -> int:
        return self.claimed_len


def _build() -> nn.Module:
    return nn.Linear(4, 1)


class Regressor(TrainModule):
    def __init__(self, dataset: IterableDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def configure_model(self) -> None:
        self.net = _build()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH)


def _reference(dataset: IterableDataset, epochs: int, accumulate: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    net = _build()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(SEED + int(os.environ["RANK"]))
    shortest = min(PER_RANK_BATCHES)
    for _ in range(epochs):
        batches = list(DataLoader(dataset, batch_size=BATCH))[:shortest]
        for i, (x, y) in enumerate(batches):
            sync = (i + 1) % accumulate == 0 or i + 1 == len(batches)
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = F.mse_loss(ddp(x), y)
                (loss * (1.0 / accumulate) if accumulate != 1 else loss).backward()
            if sync:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def _worker(rank: int, world_size: int, root: str, variant: str) -> dict[str, Any]:
    if variant == "limit":
        dataset, kwargs, epochs, accumulate = RankStream(), {"limit_train_batches": 10}, 2, 1
    elif variant == "nolimit":  # no length and no limit: the epoch ends when the streams end
        dataset, kwargs, epochs, accumulate = RankStream(), {}, 2, 2
    else:  # a __len__ that promises more than rank 1 yields
        dataset, kwargs, epochs, accumulate = WithLen(6 * BATCH), {}, 1, 3
    module = Regressor(dataset)
    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False,
                      run_dir=os.path.join(root, variant), seed=SEED, accumulate_grad_batches=accumulate,
                      timeout=30, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module)
            error = None
        except Exception as err:  # noqa: BLE001 - the parent reports what each rank saw
            error = f"{type(err).__name__}: {err}"
    iterable_warnings = [str(w.message) for w in caught if "wraps an IterableDataset" in str(w.message)]
    out = {"error": error, "warnings": iterable_warnings, "steps": trainer.global_step,
           "epoch": trainer.current_epoch,
           "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    if error is None:
        out["ref"] = _reference(dataset, epochs, accumulate)
    return out


def _check(runs: list[dict[str, Any]], steps: int, epochs: int) -> None:
    errors = [r["error"] for r in runs]
    assert errors == [None, None], f"ranks failed instead of ending together: {errors}"
    assert [(r["steps"], r["epoch"]) for r in runs] == [(steps, epochs)] * 2
    for rank, run in enumerate(runs):
        diffs = {k: float((v - run["ref"][k]).abs().max()) for k, v in run["state"].items()}
        assert all(torch.equal(v, run["ref"][k]) for k, v in run["state"].items()), (rank, diffs)
        assert len(run["warnings"]) == 1, run["warnings"]  # once, not per epoch or per batch
        message = run["warnings"][0]
        assert "not split" in message and "2 data-parallel ranks" in message and "dp_rank" in message, message


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_uneven_iterable_with_limit_train_batches_ends_together(tmp_path: Any) -> None:
    runs = run_distributed(_worker, 2, str(tmp_path), "limit", timeout=50.0)
    _check(runs, steps=2 * min(PER_RANK_BATCHES), epochs=2)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_uneven_iterable_with_len_ends_together_and_closes_the_window(tmp_path: Any) -> None:
    runs = run_distributed(_worker, 2, str(tmp_path), "len", timeout=50.0)
    _check(runs, steps=2, epochs=1)  # 4 batches, windows of 3: [0, 1, 2] and the short [3]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_uneven_iterable_without_length_or_limit_ends_together(tmp_path: Any) -> None:
    runs = run_distributed(_worker, 2, str(tmp_path), "nolimit", timeout=50.0)
    _check(runs, steps=2 * min(PER_RANK_BATCHES) // 2, epochs=2)  # windows [0, 1], [2, 3] per epoch


class Stream(IterableDataset):
    """One process: 5 batches, no length."""

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(5)
        for _ in range(5 * BATCH):
            x = torch.randn(4, generator=g)
            yield x, x.sum(0, keepdim=True)


class Validated(Regressor):
    def __init__(self) -> None:
        super().__init__(Stream())
        self.validations = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def on_validation_epoch_end(self) -> None:
        self.validations += 1

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Stream(), batch_size=BATCH)


@pytest.mark.timeout(60)
def test_one_process_iterable_without_length_closes_its_last_window_and_validates_per_epoch(
        tmp_path: Any) -> None:
    """Plain loop reference: windows of 2 over 5 batches step after batches 2, 4 and the short last one."""
    epochs, accumulate = 2, 2
    torch.manual_seed(SEED)
    net = _build()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(epochs):
        batches = list(DataLoader(Stream(), batch_size=BATCH))
        for i, (x, y) in enumerate(batches):
            (F.mse_loss(net(x), y) * (1.0 / accumulate)).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                opt.step()
                opt.zero_grad(set_to_none=True)
    module = Validated()
    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, run_dir=str(tmp_path), seed=SEED,
                      accumulate_grad_batches=accumulate, num_sanity_val_steps=0)
    trainer.fit(module)
    assert (trainer.global_step, trainer.current_epoch, module.validations) == (3 * epochs, epochs, epochs)
    ref = {f"net.{k}": v for k, v in net.state_dict().items()}
    assert all(torch.equal(v, ref[k]) for k, v in module.state_dict().items())
