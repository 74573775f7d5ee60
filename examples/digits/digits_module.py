"""The default example: a small CNN on scikit-learn's bundled 8x8 digits (no download needed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule


def load_digits_tensors(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    labels = torch.tensor(digits.target, dtype=torch.long)
    # A fixed permutation: every rank (and every run) sees the same train/validation split.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    val_idx, train_idx = order[:n_val], order[n_val:]
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[val_idx], labels[val_idx]))


class DigitsClassifier(TrainModule):
    def __init__(self, lr: float = 0.05, batch_size: int = 32, channels: int = 16,
                 val_fraction: float = 0.2) -> None:
        super().__init__()
        self.lr = lr
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * c * 16, 64), nn.ReLU(),
            nn.Linear(64, 10),
        )
        self._data: tuple[TensorDataset, TensorDataset] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _datasets(self) -> tuple[TensorDataset, TensorDataset]:
        if self._data is None:
            self._data = load_digits_tensors(self.val_fraction)
        return self._data

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val/acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    test_step = validation_step

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)
        epochs = self.trainer.config.max_epochs or 10
        return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)

    def train_dataloader(self):
        return DataLoader(self._datasets()[0], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self._datasets()[1], batch_size=256)

    def test_dataloader(self):
        return self.val_dataloader()
