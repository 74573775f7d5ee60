"""A module written the way Lightning projects use the names around a ``LightningModule``: loggers built
with Lightning's arguments and reached through ``self.logger.experiment``, a ``@rank_zero_only`` helper,
a ``BasePredictionWriter`` writing every rank's share to files, ``LearningRateMonitor`` and a
``WeightedRandomSampler`` for an imbalanced class.

As ``modules.py``: the framework comes in through exactly one line (marked ``# <framework>``), swapped
by the harness, and nothing else names a framework. The sampler draws from a generator it owns, so
every rank draws the same sequence under both frameworks.
"""

from __future__ import annotations  # noqa: I001 - the framework import stays apart, last, on its own line

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import lightning.pytorch as pl  # <framework>


@pl.utilities.rank_zero_only
def note_on_rank_zero(module: Any, what: str) -> None:
    module.rank_zero_notes.append(what)


class ImbalancedClassifier(pl.LightningModule):
    """Two classes, one five times rarer; the sampler draws the rare one as often as the common one."""

    def __init__(self, n_train: int = 48, n_val: int = 10, batch_size: int = 4, lr: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(7)
        n = n_train + n_val
        self.x = torch.randn(n, 8, generator=g)
        self.y = (torch.arange(n) % 6 == 0).long()  # class 1: every sixth sample
        self.x[self.y == 1] += 1.0
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.rank_zero_notes: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.logger.experiment.add_histogram("logits", logits.detach(), self.global_step)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(dim=1)

    def on_train_epoch_end(self) -> None:
        note_on_rank_zero(self, f"epoch {self.current_epoch}")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def _split(self, train: bool) -> TensorDataset:
        n = self.hparams.n_train
        return TensorDataset(self.x[:n], self.y[:n]) if train else TensorDataset(self.x[n:], self.y[n:])

    def train_dataloader(self) -> DataLoader:
        data = self._split(True)
        counts = torch.bincount(data.tensors[1], minlength=2).double()
        weights = (1.0 / counts)[data.tensors[1]]
        sampler = WeightedRandomSampler(weights, num_samples=len(data), replacement=True,
                                        generator=torch.Generator().manual_seed(3))
        return DataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._split(False), batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self._split(False), batch_size=3)


class PredictionFiles(pl.callbacks.BasePredictionWriter):
    """Each rank writes its predictions with their dataset indices, per batch and for the whole epoch."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.out_dir = out_dir

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any,
                           batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({"prediction": prediction, "indices": list(batch_indices)},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}-batch{batch_idx}.pt"))

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({"predictions": predictions, "indices": batch_indices},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}-epoch.pt"))


def surface_case(save_dir: str, **kwargs: Any) -> dict[str, Any]:
    loggers = [pl.loggers.TensorBoardLogger(save_dir=save_dir, name="surface"),
               pl.loggers.CSVLogger(save_dir=save_dir, name="surface")]
    callbacks = [PredictionFiles(os.path.join(save_dir, "predictions")),
                 pl.callbacks.LearningRateMonitor(logging_interval="epoch")]
    return {"model": ImbalancedClassifier(**kwargs), "callbacks": callbacks, "trainer": {"logger": loggers}}


CASES = {"surface": surface_case}
