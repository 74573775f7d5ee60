"""``DataModule``: the data side of a job in one class, as Lightning's ``LightningDataModule``.

The Trainer calls ``prepare_data`` (downloads: once per node, or once in all with
``prepare_data_per_node = False``, while the other ranks wait at a barrier), then ``setup(stage)``
on every rank, then the ``*_dataloader`` methods; ``teardown(stage)`` at the end. Its ``state_dict``
is saved in checkpoints under its class name and given back to ``load_state_dict`` on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from polytrain.core.batch import move_to_device
from polytrain.trainer.hparams import HyperparametersMixin, load_datamodule_from_checkpoint


class DataModule(HyperparametersMixin):
    prepare_data_per_node: bool = True
    name: str | None = None

    def __init__(self) -> None:
        self.trainer: Any = None

    # ------------------------------------------------------------------ lifecycle
    def prepare_data(self) -> None:
        """Download or write data to disk. Runs on one process per node; never assign state here."""

    def setup(self, stage: str) -> None:
        """Build datasets (every rank); ``stage`` is ``fit``, ``validate``, ``test`` or ``predict``."""

    def teardown(self, stage: str) -> None: ...

    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    # ------------------------------------------------------------------ batches
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def on_exception(self, exception: BaseException) -> None: ...

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, **kwargs: Any) -> DataModule:
        return load_datamodule_from_checkpoint(cls, checkpoint_path, **kwargs)

    @classmethod
    def from_datasets(cls, train_dataset: Dataset | None = None, val_dataset: Dataset | None = None,
                      test_dataset: Dataset | None = None, predict_dataset: Dataset | None = None,
                      batch_size: int = 1, num_workers: int = 0, **loader_kwargs: Any) -> DataModule:
        """A DataModule serving the given datasets (training shuffled)."""
        datamodule = cls()

        def loader(dataset: Dataset | None, shuffle: bool) -> Callable[[], Any]:
            return lambda: None if dataset is None else DataLoader(
                dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, **loader_kwargs)

        datamodule.train_dataloader = loader(train_dataset, True)  # type: ignore[method-assign]
        datamodule.val_dataloader = loader(val_dataset, False)  # type: ignore[method-assign]
        datamodule.test_dataloader = loader(test_dataset, False)  # type: ignore[method-assign]
        datamodule.predict_dataloader = loader(predict_dataset, False)  # type: ignore[method-assign]
        return datamodule


LightningDataModule = DataModule  # Lightning's name for it
