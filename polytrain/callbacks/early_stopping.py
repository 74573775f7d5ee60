"""``EarlyStopping``: stop when a monitored metric stops improving."""

from __future__ import annotations

import math
from typing import Any

from polytrain.callbacks.base import Callback


class EarlyStopping(Callback):
    """Checked after each validation (or each training epoch with ``check_on_train_epoch_end``).

    The metric is already reduced across ranks, and the stop decision is reduced again before it
    is acted on, so every rank leaves the loop at the same step.
    """

    watches_metrics = True

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_finite: bool = True, check_on_train_epoch_end: bool = False,
                 verbose: bool = True) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode={mode!r}; valid: min, max")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_finite = check_finite
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose = verbose
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = -1
        self.reason = ""

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best_score - self.min_delta
        return value > self.best_score + self.min_delta

    def _evaluate(self, value: float) -> tuple[bool, str]:
        sign = 1 if self.mode == "min" else -1
        if self.check_finite and not math.isfinite(value):
            return True, f"{self.monitor}={value} is not finite"
        if self.stopping_threshold is not None and sign * (value - self.stopping_threshold) <= 0:
            return True, (f"{self.monitor}={value:.6g} reached the stopping threshold "
                          f"{self.stopping_threshold}")
        if self.divergence_threshold is not None and sign * (value - self.divergence_threshold) >= 0:
            return True, (f"{self.monitor}={value:.6g} crossed the divergence threshold "
                          f"{self.divergence_threshold}")
        if self._improved(value):
            self.best_score = value
            self.wait_count = 0
            return False, ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (f"{self.monitor} did not improve for {self.wait_count} checks "
                          f"(best {self.best_score:.6g})")
        return False, ""

    def _check(self, trainer: Any) -> None:
        if getattr(trainer, "fast_dev_run", False):
            return  # as Lightning: fast_dev_run checks the loops, it never stops early
        if self.monitor not in trainer.callback_metrics:
            raise KeyError(f"EarlyStopping monitors '{self.monitor}' but it was not logged; logged: "
                           f"{', '.join(sorted(trainer.callback_metrics)) or '(nothing)'}")
        stop, reason = self._evaluate(float(trainer.callback_metrics[self.monitor]))
        stop = trainer.strategy.reduce_boolean_decision(stop)
        if stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.reason = reason or "another rank decided to stop"
            if self.verbose and trainer.is_logging_rank:
                print(f"EarlyStopping at epoch {trainer.current_epoch}: {self.reason}", flush=True)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        # Not in the sanity check (its metrics are dropped), nor in a standalone validate(): as Lightning.
        if not self.check_on_train_epoch_end and trainer.stage == "fit" and not trainer.sanity_checking:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self.check_on_train_epoch_end:
            self._check(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score,
                "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = state["wait_count"]
        self.best_score = state["best_score"]
        self.stopped_epoch = state["stopped_epoch"]
