"""tqdm progress bar, drawn by the logging rank only."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

from polytrain.callbacks.base import Callback


class ProgressBar(Callback):
    def __init__(self, leave_validation: bool = False) -> None:
        self.leave_validation = leave_validation
        self._train: Any = None
        self._eval: Any = None

    def _tqdm(self, **kwargs: Any) -> Any:
        return tqdm(file=sys.stdout, dynamic_ncols=True, smoothing=0, **kwargs)

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if not trainer.is_logging_rank:
            return
        self._close()
        self._train = self._tqdm(total=trainer.num_training_batches, initial=trainer.batch_in_epoch,
                                 desc=f"Epoch {trainer.current_epoch}", unit="batch")
        if trainer.progress_bar_metrics:
            self._train.set_postfix(self._postfix(trainer), refresh=False)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._train is not None:
            self._train.update(1)

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if self._train is not None and trainer.progress_bar_metrics:
            self._train.set_postfix(self._postfix(trainer), refresh=False)

    @staticmethod
    def _postfix(trainer: Any) -> dict[str, str]:
        return {k.split("/")[-1] if k.count("/") == 1 and k.startswith("train") else k: f"{v:.4g}"
                for k, v in trainer.progress_bar_metrics.items()}

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        if trainer.is_logging_rank and trainer.num_val_batches:
            self._eval = self._tqdm(total=trainer.num_val_batches, desc="Validation", leave=self.leave_validation,
                                    position=1 if self._train is not None else 0, unit="batch")

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._eval is not None:
            self._eval.update(1)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if self._eval is not None:
            self._eval.close()
            self._eval = None
        if self._train is not None and trainer.progress_bar_metrics:
            self._train.set_postfix(self._postfix(trainer))

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self._close()

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        for bar in (self._eval, self._train):
            if bar is not None:
                bar.close()
        self._train = self._eval = None
