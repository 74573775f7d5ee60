"""``EarlyStopping``: stop when a monitored metric stops improving."""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from polytrain.callbacks.base import Callback
from polytrain.core.errors import ConfigError
from polytrain.core.rank_zero import rank_zero_warn
from polytrain.core.states import TrainerFn


class EarlyStoppingReason(Enum):
    """Why ``EarlyStopping`` stopped the fit (``early_stopping.stopping_reason``), Lightning's values."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class MonitorNotLogged(RuntimeError, KeyError):
    """A callback monitors a metric nobody logged (Lightning raises ``RuntimeError``; polytrain raised
    ``KeyError``: both catch it)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class EarlyStopping(Callback):
    """Checked after each validation (or each training epoch with ``check_on_train_epoch_end``).

    The metric is already reduced across ranks, and the stop decision is reduced again before it
    is acted on, so every rank leaves the loop at the same step.
    """

    watches_metrics = True

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = True,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping `mode` can be min, max, got {mode}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.strict = strict
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_finite = check_finite
        # None: as Lightning, at a training epoch's end when validation runs once at every epoch's end (or
        # never), else after each validation (settled in setup)
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        self.verbose = verbose
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def state_key(self) -> str:
        # Two EarlyStoppings with other monitors keep their own state in a checkpoint (Lightning's key).
        return f"{type(self).__qualname__}{ {'monitor': self.monitor, 'mode': self.mode}!r}"

    @property
    def reason(self) -> str:
        return self.stopping_reason_message or ""

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if self.__dict__.get("_on_train_epoch_end") is None or self.check_on_train_epoch_end is not None:
            every_epoch = trainer.config.val_check_interval in (None, 1.0)
            every_epoch = every_epoch and trainer.config.check_val_every_n_epoch == 1
            chosen = self.check_on_train_epoch_end
            self.__dict__["_on_train_epoch_end"] = every_epoch if chosen is None else chosen

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best_score - self.min_delta
        return value > self.best_score + self.min_delta

    def _evaluate(self, value: float) -> tuple[bool, str]:
        sign = 1 if self.mode == "min" else -1
        if self.check_finite and not math.isfinite(value):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (f"Monitored metric {self.monitor} = {value} is not finite. Previous best value was "
                          f"{self.best_score:.3f}. Signaling Trainer to stop.")
        if self.stopping_threshold is not None and sign * (value - self.stopping_threshold) < 0:
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (f"Stopping threshold reached: {self.monitor} = {value:.6g} "
                          f"{'<' if sign > 0 else '>'} {self.stopping_threshold}. Signaling Trainer to stop.")
        if self.divergence_threshold is not None and sign * (value - self.divergence_threshold) > 0:
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return True, (f"Divergence threshold reached: {self.monitor} = {value:.6g} "
                          f"{'<' if sign > 0 else '>'} {self.divergence_threshold}. "
                          "Signaling Trainer to stop.")
        if self._improved(value):
            self.best_score = value
            self.wait_count = 0
            return False, ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return True, (f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} "
                          f"records. Best score: {self.best_score:.3f}. Signaling Trainer to stop.")
        return False, ""

    def _check(self, trainer: Any) -> None:
        if getattr(trainer, "fast_dev_run", False):
            return  # as Lightning: fast_dev_run checks the loops, it never stops early
        if self.monitor not in trainer.callback_metrics:
            message = (f"EarlyStopping monitors '{self.monitor}' but it was not logged; logged: "
                       f"{', '.join(sorted(trainer.callback_metrics)) or '(nothing)'}")
            if self.strict:
                raise MonitorNotLogged(message)
            if self.verbose:
                rank_zero_warn(message + " (strict=False: not checked)", category=RuntimeWarning)
            return
        stop, reason = self._evaluate(float(trainer.callback_metrics[self.monitor]))
        stop = trainer.strategy.reduce_boolean_decision(stop)
        if stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            if not reason:
                reason = "another rank decided to stop"
                self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            self.stopping_reason_message = reason
            if self.verbose and (trainer.is_logging_rank or not self.log_rank_zero_only):
                print(f"EarlyStopping at epoch {trainer.current_epoch}: {reason}", flush=True)

    def _skipped(self, trainer: Any) -> bool:
        # Not in the sanity check (its metrics are dropped), nor in a standalone validate(): as Lightning.
        return trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if not self.__dict__.get("_on_train_epoch_end") and not self._skipped(trainer):
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self.__dict__.get("_on_train_epoch_end") and not self._skipped(trainer):
            self._check(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score,
                "stopped_epoch": self.stopped_epoch, "patience": self.patience,
                "stopping_reason": self.stopping_reason.value,
                "stopping_reason_message": self.stopping_reason_message}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = state["wait_count"]
        self.best_score = float(state["best_score"])
        self.stopped_epoch = state["stopped_epoch"]
        self.patience = state.get("patience", self.patience)
        self.stopping_reason = EarlyStoppingReason(state.get("stopping_reason", 0))
        self.stopping_reason_message = state.get("stopping_reason_message")
