"""A tiny regression TrainModule for the launch tests: fast to import, fast to train, deterministic."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule


def make_dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.25 + 0.01 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


class TinyRegressor(TrainModule):
    """``fail_rank``/``fail_step``: raise on that global rank once that optimizer step is reached
    (the other ranks are then waiting in DDP's all-reduce). Also read from ``POLYTRAIN_TEST_FAIL_RANK``."""

    def __init__(self, n: int = 64, batch_size: int = 8, lr: float = 0.05, shuffle: bool = False,
                 fail_rank: int = -1, fail_step: int = 1) -> None:
        super().__init__()
        self.n = n
        self.batch_size = batch_size
        self.lr = lr
        self.shuffle = shuffle
        self.fail_rank = int(os.environ.get("POLYTRAIN_TEST_FAIL_RANK", fail_rank))
        self.fail_step = fail_step
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == self.fail_rank and self.trainer.global_step >= self.fail_step:
            raise RuntimeError(f"tiny-module deliberate failure on rank {self.fail_rank}")
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(make_dataset(self.n), batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self):
        return DataLoader(make_dataset(16, seed=1), batch_size=8)


def weights(module: nn.Module) -> list[float]:
    """The module's parameters flattened, in state-dict order (exact values for comparisons)."""
    return [float(v) for t in module.state_dict().values() for v in t.detach().flatten().tolist()]
