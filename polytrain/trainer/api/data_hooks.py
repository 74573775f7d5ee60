"""The data hooks a ``TrainModule`` and a ``DataModule`` share (Lightning's ``DataHooks``): where data
comes from and how a batch reaches the device. The defaults do nothing beyond the plain move; the
Trainer calls an override wherever it is defined (the DataModule's first, as Lightning)."""

from __future__ import annotations

from typing import Any

import torch

from polytrain.core.batch import move_to_device


class DataHooks:
    prepare_data_per_node: bool = True  # prepare_data on local rank 0 of every node (False: global rank 0)

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

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch
