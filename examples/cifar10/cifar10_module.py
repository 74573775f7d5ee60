"""ResNet-18 on CIFAR-10: DDP + mixed precision + synchronised BatchNorm, all chosen in config.yaml.

The module owns its data. With ``fake: false`` it reads torchvision's CIFAR-10, downloading it
once per node in ``prepare_data`` (Lightning's hook: the Trainer calls it on local rank 0 while the
other ranks wait at a barrier, DESIGN rule 5; if the download fails, every rank stops with one sentence
naming data_root, and the directories the attempt created are removed). With ``fake: true`` it trains on
``torchvision.datasets.FakeData`` pictures of the same shape, which needs no network (smoke tests, offline
machines).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from polytrain import TrainModule

# Per-channel statistics of the CIFAR-10 training set.
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with a stem for 32x32 inputs.

    The ImageNet stem (7x7 stride-2 convolution, then max-pooling) shrinks a 32x32 picture to 8x8
    before the first residual block; a 3x3 stride-1 convolution and no pooling keep 32x32.
    """
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def train_transform() -> transforms.Compose:
    return transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])


def eval_transform() -> transforms.Compose:
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])


def _missing_directories(path: str) -> list[str]:
    """The directories of ``path`` that do not exist yet, deepest first (what a download would create)."""
    missing, current = [], os.path.abspath(path)
    while not os.path.exists(current):
        missing.append(current)
        current = os.path.dirname(current)
    return missing


def _import(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


class CIFAR10ResNet(TrainModule):
    """ResNet-18 classifier for CIFAR-10.

    Args:
        lr, momentum, weight_decay: SGD (Nesterov) settings; the learning rate follows a cosine
            schedule over ``trainer.max_epochs``.
        batch_size: per process; the global batch is ``batch_size x world size``.
        data_root: where CIFAR-10 lives (or is downloaded to).
        fake: train on ``FakeData`` instead (no download): ``fake_size`` random pictures for training
            and a quarter of that (at least one batch) for validation, each drawn from its index,
            so the same on every run and rank.
        num_workers: DataLoader worker processes per rank.
        dataset_class: the dataset to read when ``fake`` is false; anything with torchvision's
            ``CIFAR10(root, train, transform, download)`` signature (CIFAR-10 unless you change it).
    """

    def __init__(self, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 5e-4,
                 batch_size: int = 128, data_root: str = "data/cifar10", fake: bool = False,
                 fake_size: int = 1024, num_workers: int = 4,
                 dataset_class: str = "torchvision.datasets.CIFAR10") -> None:
        super().__init__()
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.data_root = data_root
        self.fake = fake
        self.fake_size = fake_size
        self.num_workers = num_workers
        self.dataset_class = dataset_class
        self.net = resnet18_cifar(num_classes=10)
        self._data: tuple[Dataset, Dataset] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val/acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    test_step = validation_step

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                                    weight_decay=self.weight_decay, nesterov=True)
        epochs = self.trainer.config.max_epochs or 1
        return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)

    # ------------------------------------------------------------------ data
    def prepare_data(self) -> None:
        """Download CIFAR-10 (nothing to do with ``fake``). The Trainer runs this on local rank 0 of each
        node while the other ranks wait at a barrier, so no rank reads half-written files. If the data is
        not at ``data_root`` and the download fails (no network, or a mistyped path), the directories the
        attempt created are removed again and every rank stops with one sentence saying so."""
        if self.fake:
            return
        dataset_cls = _import(self.dataset_class)
        created = _missing_directories(self.data_root)
        try:
            for train in (True, False):
                dataset_cls(self.data_root, train=train, download=True)
        except Exception as err:  # noqa: BLE001 - said in one sentence below, with what to do
            for directory in created:  # deepest first: only what this attempt made, and only if empty
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            raise RuntimeError(f"module.data_root={self.data_root}: CIFAR-10 is not there, and downloading "
                               f"it failed ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''}). "
                               f"Point module.data_root at your copy, run where the download can reach the "
                               f"internet, or train on stand-in pictures with module.fake=true") from None

    def _datasets(self) -> tuple[Dataset, Dataset]:
        if self._data is None:
            if self.fake:
                from torchvision.datasets import FakeData

                val_size = max(self.fake_size // 4, self.batch_size)
                train = FakeData(size=self.fake_size, image_size=(3, 32, 32), num_classes=10,
                                 transform=train_transform())
                # A different offset: validation pictures are not the training pictures.
                val = FakeData(size=val_size, image_size=(3, 32, 32), num_classes=10,
                               transform=eval_transform(), random_offset=self.fake_size)
            else:
                dataset_cls = _import(self.dataset_class)
                train = dataset_cls(self.data_root, train=True, transform=train_transform(), download=False)
                val = dataset_cls(self.data_root, train=False, transform=eval_transform(), download=False)
            self._data = (train, val)
        return self._data

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, drop_last=shuffle,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                          pin_memory=torch.cuda.is_available())

    def train_dataloader(self):
        return self._loader(self._datasets()[0], shuffle=True)

    def val_dataloader(self):
        return self._loader(self._datasets()[1], shuffle=False)

    def test_dataloader(self):
        return self.val_dataloader()
