"""A mid-epoch resume with DataLoader workers continues bitwise like the uninterrupted run.

Each sample gets a random augmentation drawn in the DataLoader worker that loads it. A worker's
stream starts from the iterator's base seed (drawn from the main process's RNG when the epoch's
iterator is created) plus its worker id, and advances with every sample it loads; batches go to
workers round-robin. So the loader's base seed and every worker's position are part of the state
a resume must restore, not only the main process's RNG.

Reference: a plain PyTorch loop (``DistributedSampler`` by hand, ``set_epoch`` each epoch, the same
``num_workers``; under 2 ranks, ``DistributedDataParallel`` on the same gloo group), uninterrupted.
Polytrain trains into the second epoch, saves after its batch 3, and a fresh Trainer resumes from
that file (batch 3 was loaded by worker 1; a fresh iterator would hand the next batch to worker 0,
from a new base seed). Both the uninterrupted and the resumed polytrain run must equal the reference bitwise
(same arithmetic). With ``num_workers=0`` the augmentation is drawn in the main process, whose
RNG the checkpoint restores: that case passes today and guards the reference.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.torch_api

SEED = 0
N = 64
BATCH = 4
EPOCHS = 2
STOP_IN_EPOCH = 3  # the interruption: batch 3 of the second epoch


class Augmented(Dataset):
    """A fixed regression problem; each access adds fresh noise from the loading process's RNG."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, 4, generator=g)
        self.y = self.x @ torch.randn(4, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.5 * torch.randn(4), self.y[i]


def _build() -> nn.Module:
    return nn.Linear(4, 1)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


class Regressor(TrainModule):
    def __init__(self, num_workers: int) -> None:
        super().__init__()
        self.num_workers = num_workers

    def configure_model(self) -> None:
        self.net = _build()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return _optimizer(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=self.num_workers)


def _reference(num_workers: int, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: built under the seed, per-rank stream for training, DDP when world_size > 1."""
    torch.manual_seed(SEED)
    net = _build()
    model = net
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(net)
    opt = _optimizer(model.parameters())
    torch.manual_seed(SEED + rank)
    ds = Augmented()
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=num_workers)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def _trainer(root: str, strategy: str, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices="auto" if strategy == "ddp" else 1, strategy=strategy,
                   logger=False, enable_progress_bar=False, enable_checkpointing=False, run_dir=root,
                   seed=SEED, use_distributed_sampler="always",
                   **kwargs)


def _runs(root: str, strategy: str, num_workers: int) -> dict[str, dict[str, torch.Tensor]]:
    whole = Regressor(num_workers)
    _trainer(os.path.join(root, "whole"), strategy, max_epochs=EPOCHS).fit(whole)
    first = Regressor(num_workers)
    per_epoch = N // BATCH // int(os.environ.get("WORLD_SIZE", "1"))
    trainer = _trainer(os.path.join(root, "first"), strategy, max_epochs=EPOCHS,
                       max_steps=per_epoch + STOP_IN_EPOCH)
    trainer.fit(first)
    path = os.path.join(root, "mid-epoch.ckpt")
    assert (trainer.current_epoch, trainer.batch_in_epoch) == (1, STOP_IN_EPOCH)
    trainer.save_checkpoint(path)
    resumed = Regressor(num_workers)
    trainer = _trainer(os.path.join(root, "resumed"), strategy, max_epochs=EPOCHS)
    trainer.fit(resumed, ckpt_path=path)
    assert trainer.global_step == EPOCHS * N // BATCH // trainer.strategy.dp_size
    return {name: {k: v.detach().clone() for k, v in m.state_dict().items()}
            for name, m in (("whole", whole), ("resumed", resumed))}


def _check(runs: dict[str, dict[str, torch.Tensor]], ref: dict[str, torch.Tensor], what: str) -> None:
    for name in ("whole", "resumed"):
        diffs = {k: float((v - ref[k]).abs().max()) for k, v in runs[name].items()}
        assert all(torch.equal(v, ref[k]) for k, v in runs[name].items()), (
            f"{what}: the {name} run differs from the uninterrupted plain loop: {diffs}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_with_workers_is_bitwise_one_process(tmp_path: Any, num_workers: int) -> None:
    ref = _reference(num_workers, 0, 1)
    _check(_runs(str(tmp_path), "single", num_workers), ref, f"1 process, num_workers={num_workers}")


def _worker(rank: int, world_size: int, root: str, num_workers: int) -> Any:
    import multiprocessing

    # The harness starts ranks as daemons (so none outlives a failed test), and a daemon may not
    # start DataLoader workers; those workers watch their parent and exit with it anyway. A rank
    # inherits the harness's forkserver start method, which would start each DataLoader worker from
    # a fresh forkserver (seconds each); torchrun's workers fork them, as here.
    multiprocessing.current_process()._config["daemon"] = False
    multiprocessing.set_start_method("fork", force=True)
    runs = _runs(root, "ddp", num_workers)
    return runs, _reference(num_workers, rank, world_size)  # on the group polytrain's ddp started


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_mid_epoch_resume_with_workers_is_bitwise_two_ranks(tmp_path: Any) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), 2, timeout=80.0)
    for rank, (runs, ref) in enumerate(results):
        _check(runs, ref, f"ddp rank {rank}, num_workers=2")
