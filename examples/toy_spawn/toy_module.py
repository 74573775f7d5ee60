"""The toy model of the seed notes (Linear 10->10, ReLU, Linear 10->5, MSE) as a TrainModule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule


def random_regression_data(num_samples: int, seed: int = 0) -> TensorDataset:
    """Random inputs and random targets, the same on every rank (a fixed generator, not the global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(num_samples, 10, generator=gen),
                         torch.randn(num_samples, 5, generator=gen))


class ToyModel(TrainModule):
    def __init__(self, lr: float = 0.01, num_samples: int = 320, batch_size: int = 20,
                 data_seed: int = 0) -> None:
        super().__init__()
        self.lr = lr
        self.batch_size = batch_size
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        self.dataset = random_regression_data(num_samples, data_seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        # Per process: with 2 processes a step sees 2 x batch_size samples, split by the injected sampler.
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    @torch.no_grad()
    def full_loss(self) -> float:
        """MSE over the whole data set, computed in this process (no trainer needed)."""
        x, y = self.dataset.tensors
        return F.mse_loss(self(x), y).item()
