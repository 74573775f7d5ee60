"""Modules for the details real Lightning projects hit, each run under Lightning and under polytrain with
only the framework line changed (as ``modules.py``; the line marked ``# <framework>`` is swapped):

- ``onecycle``: ``LearningRateMonitor(logging_interval="step")`` over a ``OneCycleLR`` stepped every
  optimizer step, with a ``CSVLogger``: the rate logged at a step is the rate that step used.
- ``fit_then_test``: train, validation and test metrics with a ``CSVLogger``: after ``test()`` the
  trainer's metrics dicts hold the test's values only, and the CSV keeps each row's epoch.
- ``second_fit``: a second ``fit`` on the finished Trainer with one more epoch and a new callback (a
  SWA-style phase): ``configure_optimizers`` runs again.
- ``augmented``: a random augmentation drawn from the global RNG in ``training_step`` and a shuffled
  loader, after ``seed_everything(7)``: under ddp every rank re-seeded from 7 at each stage and the
  training sampler seeded with it.
- ``batchnorm``: BatchNorm with validation under ddp: the running statistics every rank holds.
- ``unused``: a parameter no loss uses, under ddp: the error names the fix (``allowed=True``: trained under
  ``ddp_find_unused_parameters_true``).
"""

from __future__ import annotations  # noqa: I001 - the framework import stays apart, last, on its own line

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl  # <framework>


def _data(n: int, features: int = 6, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    """A small classifier logging what Lightning projects log: a step loss on the progress bar,
    validation loss and accuracy per epoch, test loss and accuracy."""

    def __init__(self, n_train: int = 32, n_val: int = 12, n_test: int = 10, batch_size: int = 4,
                 lr: float = 0.1, shuffle: bool = True, batchnorm: bool = False,
                 unused: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(6, 16)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(16))
        self.net = nn.Sequential(*layers, nn.Tanh(), nn.Linear(16, 2))
        if unused:
            self.spare = nn.Linear(6, 2)  # never used by a loss
        self.optimizer_builds = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("test_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        self.optimizer_builds += 1
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(self.hparams.n_train), batch_size=self.hparams.batch_size,
                          shuffle=self.hparams.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(self.hparams.n_val, seed=4), batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(_data(self.hparams.n_test, seed=5), batch_size=self.hparams.batch_size)


class OneCycle(Classifier):
    def configure_optimizers(self) -> Any:
        self.optimizer_builds += 1
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=40)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Augmented(Classifier):
    """Noise added to every batch from the global RNG, as a random augmentation would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return super().training_step((x + 0.3 * torch.randn_like(x), y), batch_idx)


class NewPhase(pl.Callback):
    """The callback a second phase adds (as a SWA phase adds StochasticWeightAveraging)."""

    def __init__(self) -> None:
        self.epochs_seen: list[int] = []

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.epochs_seen.append(trainer.current_epoch)


def _csv(save_dir: str) -> list[Any]:
    return [pl.loggers.CSVLogger(save_dir=save_dir, name="details")]


def onecycle_case(save_dir: str, **kwargs: Any) -> dict[str, Any]:
    return {"model": OneCycle(**kwargs),
            "callbacks": [pl.callbacks.LearningRateMonitor(logging_interval="step")],
            "trainer": {"logger": _csv(save_dir), "log_every_n_steps": 2}}


def fit_then_test_case(save_dir: str, **kwargs: Any) -> dict[str, Any]:
    return {"model": Classifier(**kwargs), "trainer": {"logger": _csv(save_dir), "log_every_n_steps": 3}}


def second_fit_case(save_dir: str, **kwargs: Any) -> dict[str, Any]:
    def next_phase(trainer: Any, model: Any) -> None:
        trainer.fit_loop.max_epochs += 1
        phase = NewPhase()
        model.seen_in_hooks = phase.epochs_seen  # what the harness reports: the epochs the new callback saw
        trainer.callbacks.append(phase)

    return {"model": Classifier(**kwargs), "calls": {"next_phase": next_phase},
            "trainer": {"logger": _csv(save_dir), "log_every_n_steps": 3}}


def augmented_case(save_dir: str, **kwargs: Any) -> dict[str, Any]:
    return {"model": Augmented(**kwargs), "trainer": {"logger": _csv(save_dir)}}


def batchnorm_case(save_dir: str, **kwargs: Any) -> dict[str, Any]:
    return {"model": Classifier(**{"batchnorm": True, **kwargs}), "trainer": {"logger": _csv(save_dir)}}


def unused_case(save_dir: str, allowed: bool = False, **kwargs: Any) -> dict[str, Any]:
    return {"model": Classifier(**{"unused": True, **kwargs}),
            "ddp_strategy": "ddp_find_unused_parameters_true" if allowed else "ddp"}


CASES = {"onecycle": onecycle_case, "fit_then_test": fit_then_test_case, "second_fit": second_fit_case,
         "augmented": augmented_case, "batchnorm": batchnorm_case, "unused": unused_case}
