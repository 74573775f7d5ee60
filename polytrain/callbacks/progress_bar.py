"""tqdm progress bar, drawn by the logging rank only."""

from __future__ import annotations

import math
import sys
from typing import Any

from tqdm.auto import tqdm

from polytrain.callbacks.base import Callback


class ProgressBar(Callback):
    """A training bar per epoch and a validation bar, redrawn every ``refresh_rate`` batches (0: no bars)."""

    def __init__(self, leave_validation: bool = False, refresh_rate: int = 1) -> None:
        if refresh_rate < 0:
            raise ValueError(f"refresh_rate={refresh_rate}: give 0 (no bars) or a positive number of batches")
        self.leave_validation = leave_validation
        self.refresh_rate = refresh_rate
        self._train: Any = None
        self._eval: Any = None
        self._last_train: Any = None  # the newest training bar, kept when closed (train_progress_bar)
        self._pending = 0  # training batches done since the bar was last moved
        self._trainer: Any = None  # the running stage's (the batch totals read it)

    def _tqdm(self, **kwargs: Any) -> Any:
        return tqdm(file=sys.stdout, dynamic_ncols=True, smoothing=0, **kwargs)

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if trainer.batch_in_epoch:  # resumed mid-epoch: that epoch does not start again (no epoch-start hook)
            self.on_train_epoch_start(trainer, module)

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if not trainer.is_logging_rank or not self.refresh_rate:
            return
        self._close()
        self._train = self._tqdm(total=_known(self.total_train_batches), initial=trainer.batch_in_epoch,
                                 desc=f"Epoch {trainer.current_epoch}", unit="batch")
        self._last_train = self._train
        if trainer.metrics.progress_bar:
            self._train.set_postfix(self._postfix(trainer), refresh=False)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._train is not None:
            self._pending += 1
            if self._pending >= self.refresh_rate or batch_idx + 1 == trainer.num_training_batches:
                self._train.update(self._pending)
                self._pending = 0

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if self._train is not None and trainer.metrics.progress_bar:
            self._train.set_postfix(self._postfix(trainer), refresh=False)

    @property
    def trainer(self) -> Any:
        """The Trainer of the running stage (set when it starts), as Lightning's progress bars have it."""
        if self._trainer is None:
            raise TypeError(f"The `{type(self).__name__}.trainer` reference has not been set yet: a stage "
                            f"sets it when it starts")
        return self._trainer

    @property
    def train_progress_bar(self) -> Any:
        """The epoch's tqdm bar (the last one, closed, once training ended); Lightning's name."""
        if self._last_train is None:
            raise TypeError(f"The `{type(self).__name__}.train_progress_bar` has not been drawn: training "
                            f"has not started, or this rank draws no bars")
        return self._last_train

    # Lightning's names for the batches each loop runs (inf: a loader without length)
    @property
    def total_train_batches(self) -> int | float | None:
        """The epoch's batches; with ``max_epochs=-1`` and ``max_steps``, no more than the steps left (a
        loader without length: the steps left), as Lightning counts them."""
        trainer = self._trainer
        if trainer is None:
            return None
        batches = trainer.num_training_batches
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            left = trainer.max_steps - trainer.global_step
            return min(batches, left)
        return batches

    @property
    def total_val_batches(self) -> int | float:
        """The batches of the fit's next validation: 0 in an epoch that does not validate."""
        trainer = self._trainer
        if trainer is None or (trainer.state.fn == "fit" and not trainer.fit_loop.validates_this_epoch()):
            return 0
        return _total(trainer.num_val_batches)

    @property
    def total_test_batches(self) -> int | float:
        return _total(self._trainer.num_test_batches) if self._trainer is not None else 0

    @property
    def total_predict_batches(self) -> int | float:
        return _total(self._trainer.num_predict_batches) if self._trainer is not None else 0

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self._trainer = trainer

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, int | str | float | dict[str, float]]:
        """What the bar shows beside its counts, by name (Lightning's hook: override it to show more or
        less): the values logged with ``prog_bar=True``."""
        return dict(trainer.metrics.progress_bar)

    def _postfix(self, trainer: Any) -> dict[str, str]:
        shown = self.get_metrics(trainer, trainer.lightning_module)
        return {k.split("/")[-1] if k.count("/") == 1 and k.startswith("train") else k:
                f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in shown.items()}

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        total = _known(sum(trainer.num_val_batches))
        if trainer.is_logging_rank and total != 0 and self.refresh_rate:
            self._eval = self._tqdm(total=total, desc="Validation",
                                    leave=self.leave_validation,
                                    position=1 if self._train is not None else 0, unit="batch")

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._eval is not None:
            self._eval.update(1)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if self._eval is not None:
            self._eval.close()
            self._eval = None
        if self._train is not None and trainer.metrics.progress_bar:
            self._train.set_postfix(self._postfix(trainer))

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self._close()

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._train is not None and self._pending:
            self._train.update(self._pending)  # an epoch that stopped between two redraws
        self._pending = 0
        for bar in (self._eval, self._train):
            if bar is not None:
                bar.close()
        self._train = self._eval = None


def _total(counts: list[int | float]) -> int | float:
    """A stage's batches over all its loaders (infinite where one has no length), as Lightning sums them."""
    return sum(counts)


def _known(count: int | float) -> int | None:
    """A count for tqdm, which takes None (not ``inf``) for a bar of unknown length."""
    return None if math.isinf(count) else int(count)


class TQDMProgressBar(ProgressBar):
    """Lightning's name and arguments: ``TQDMProgressBar(refresh_rate=1, process_position=0, leave=False)``
    (``leave`` keeps each finished validation bar on screen; ``process_position`` is accepted, one bar stack
    is drawn by the logging rank only)."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(leave_validation=leave, refresh_rate=refresh_rate)
        self.process_position = process_position
