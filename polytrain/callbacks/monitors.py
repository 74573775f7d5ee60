"""Monitors that log extra series: learning rates and throughput."""

from __future__ import annotations

import time
from typing import Any

import torch

from polytrain.callbacks.base import Callback


def _log(trainer: Any, metrics: dict[str, float]) -> None:
    # In callback_metrics on every rank (as Lightning's LearningRateMonitor puts its rates there), to the
    # loggers from the logging rank.
    trainer.callback_metrics.update({name: torch.tensor(value) for name, value in metrics.items()})
    if trainer.is_logging_rank:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, trainer.global_step)


class LearningRateMonitor(Callback):
    """Logs ``lr-<Optimizer>[/pg<i>]`` on logging steps or once per epoch."""

    def __init__(self, logging_interval: str = "step") -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"LearningRateMonitor logging_interval={logging_interval!r}; valid: step, epoch")
        self.logging_interval = logging_interval

    @staticmethod
    def learning_rates(trainer: Any) -> dict[str, float]:
        out = {}
        for i, opt in enumerate(trainer.strategy.optimizers):
            name = f"lr-{type(opt).__name__}" + (f"-{i}" if len(trainer.strategy.optimizers) > 1 else "")
            groups = opt.param_groups
            for j, group in enumerate(groups):
                out[name + (f"/pg{j}" if len(groups) > 1 else "")] = float(group["lr"])
        return out

    _last_step = -1

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        # Once per optimizer step: micro-batches of an accumulation window share the step number.
        if self.logging_interval == "step" and step and step % trainer.config.log_every_n_steps == 0 \
                and step != self._last_step:
            self._last_step = step
            _log(trainer, self.learning_rates(trainer))

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if self.logging_interval == "epoch":
            _log(trainer, self.learning_rates(trainer))


class ThroughputMonitor(Callback):
    """Logs ``throughput/samples_per_sec`` (this rank x data-parallel size) on logging steps.

    Host wall time between logging steps: on GPUs the number includes queued work only once
    the host waits for it, which the logging step's ``.item()`` does anyway.
    """

    def __init__(self) -> None:
        self._t0: float | None = None
        self._samples = 0

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self._t0, self._samples = time.perf_counter(), 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._samples += trainer.metrics.batch_size
        if trainer.global_step % trainer.config.log_every_n_steps == 0 and self._t0 is not None:
            elapsed = time.perf_counter() - self._t0
            if elapsed > 0:
                rate = self._samples * trainer.strategy.dp_size / elapsed
                _log(trainer, {"throughput/samples_per_sec": rate})
            self._t0, self._samples = time.perf_counter(), 0
