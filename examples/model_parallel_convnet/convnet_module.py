"""The seed notes' model-parallel ConvNet, polytrain style: two ``nn.Sequential`` halves on two
devices of one process, with micro-batch pipelining between them.

The notes move ``seq1`` to ``cuda:0`` and ``seq2`` to ``cuda:1`` by hand and write the
``.to("cuda:1")`` calls and the split-and-interleave loop into ``forward``. Here the model only
says *what* the halves are (``self.net = Sequential(first_half, second_half)``); the
``model_parallel`` strategy in ``layers`` mode places one half per device, moves activations
between them, and with ``split_size`` cuts each batch into micro-batches so that while the second
device works on micro-batch k the first already computes k+1. The same module trains unchanged
under ``single`` or ``ddp``; on a CPU-only machine both "devices" are the CPU, so the placement
and pipelining code runs but nothing overlaps.

Data: scikit-learn's bundled 8x8 digits (no download).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule


def digits(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    return (TensorDataset(images[order[n_val:]], labels[order[n_val:]]),
            TensorDataset(images[order[:n_val]], labels[order[:n_val]]))


class TwoHalfConvNet(TrainModule):
    def __init__(self, lr: float = 0.05, batch_size: int = 64, channels: int = 16) -> None:
        super().__init__()
        self.lr, self.batch_size = lr, batch_size
        c = channels
        first_half = nn.Sequential(  # device 0: the convolutions
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        second_half = nn.Sequential(  # device 1: the classifier
            nn.Flatten(),
            nn.Linear(2 * c * 4 * 4, 64), nn.ReLU(),
            nn.Linear(64, 10),
        )
        self.net = nn.Sequential(first_half, second_half)
        self._data: tuple[TensorDataset, TensorDataset] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y))
        self.log("val/acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def _datasets(self) -> tuple[TensorDataset, TensorDataset]:
        if self._data is None:
            self._data = digits()
        return self._data

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._datasets()[0], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._datasets()[1], batch_size=256)
