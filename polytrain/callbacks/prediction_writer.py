"""``BasePredictionWriter``: write predictions as they are made (per batch) or once at the end of the
pass (per epoch), on every rank, with the dataset indices of each batch, so predictions too large to
gather on one process go straight to disk and can be put back in dataset order afterwards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polytrain.callbacks.base import Callback

WRITE_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Lightning's ``BasePredictionWriter(write_interval="batch")``: override ``write_on_batch_end``
    and/or ``write_on_epoch_end``. Every rank writes its own share (name files by
    ``trainer.global_rank``); ``batch_indices`` are dataset indices (empty when the loader has none:
    an iterable dataset)."""

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in WRITE_INTERVALS:
            raise ValueError(f"BasePredictionWriter write_interval={write_interval!r}; valid: "
                             f"{', '.join(WRITE_INTERVALS)}")
        self.write_interval = write_interval

    @property
    def on_batch(self) -> bool:
        return self.write_interval in ("batch", "batch_and_epoch")

    @property
    def on_epoch(self) -> bool:
        return self.write_interval in ("epoch", "batch_and_epoch")

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any,
                           batch_indices: Sequence[int] | None,
                           batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} writes per batch: override write_on_batch_end")

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Sequence[Any],
                           batch_indices: Sequence[Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} writes per epoch: override write_on_epoch_end")

    def on_predict_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        if self.on_batch:
            indices = trainer.predict_loop.current_batch_indices
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Any, module: Any) -> None:
        if self.on_epoch:
            record = trainer.predict_loop
            self.write_on_epoch_end(trainer, module, record.predictions, record.epoch_batch_indices)
