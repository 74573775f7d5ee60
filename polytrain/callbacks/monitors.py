"""Monitors that log extra series: learning rates and throughput."""

from __future__ import annotations

import time
from typing import Any

import torch

from polytrain.callbacks.base import Callback
from polytrain.core.errors import ConfigError
from polytrain.core.rank_zero import rank_zero_warn


def _log(trainer: Any, metrics: dict[str, float], step: int) -> None:
    # In callback_metrics on every rank (as Lightning's LearningRateMonitor puts its rates there), to the
    # loggers from the logging rank.
    trainer.callback_metrics.update({name: torch.tensor(value) for name, value in metrics.items()})
    if trainer.is_logging_rank:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step)


class LearningRateMonitor(Callback):
    """Lightning's ``LearningRateMonitor(logging_interval=None, log_momentum=False, log_weight_decay=False)``.

    Logs each optimizer's rate as ``lr-<Optimizer>`` (``-1``, ``-2`` for more optimizers of one class, a
    scheduler config's ``name`` instead when it has one, ``/pg1``, ``/pg2`` or the group's ``name`` for
    several parameter groups), with ``-momentum`` and ``-weight_decay`` beside it when asked, to the
    loggers and into ``callback_metrics``:

    - ``logging_interval="step"``: before the batch whose optimizer step is a logged one (step n with n a
      multiple of ``log_every_n_steps``), so the value is the rate step n uses, logged at step n, beside
      that step's loss;
    - ``"epoch"``: when each training epoch starts, at the step that comes next;
    - ``None``: rates of step-interval schedulers per logged step, of epoch-interval ones per epoch, of
      optimizers without a scheduler both.

    Without a logger the rates still reach ``callback_metrics`` (Lightning refuses such a Trainer; a config
    run with ``trainer.logger=false`` keeps its callbacks here).
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"LearningRateMonitor logging_interval={logging_interval!r}; "
                             f"valid: step, epoch, None")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        # What was logged, as Lightning keeps it: every rate per name, the newest momentum and weight decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        named = _named_optimizers(trainer)  # raises for parameter groups that share a name
        names = [name for _, _, group_names in named for name in group_names]
        without = [type(opt).__name__ for opt, _, _ in named
                   if "betas" not in opt.defaults and "momentum" not in opt.defaults]
        if self.log_momentum and without:
            rank_zero_warn(f"You have set log_momentum=True, but some optimizers do not have momentum "
                           f"({', '.join(without)}): a value of 0 is logged for them",
                           category=RuntimeWarning)
        self.lrs = {name: [] for name in names}
        if self.log_momentum:
            self.last_momentum_values = {f"{name}-momentum": None for name in names}
        if self.log_weight_decay:
            self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        every = trainer.config.log_every_n_steps
        upcoming = trainer.global_step + 1  # the step this batch belongs to (its rate is set by now)
        # the loop's logging cadence counts batches that stepped (under manual optimization with two
        # optimizers, global_step counts both of each batch's steps)
        logged = (trainer.batches_stepped + 1) % every == 0 if every else False
        if self.logging_interval != "epoch" and every and (logged or trainer.should_stop):
            interval = "step" if self.logging_interval is None else "any"
            self._log(trainer, self.rates(trainer, interval), upcoming)

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if self.logging_interval != "step":
            self._log(trainer, self.rates(trainer, "epoch" if self.logging_interval is None else "any"),
                      trainer.global_step + 1)

    def _log(self, trainer: Any, values: dict[str, float], step: int) -> None:
        self._rename_grown_optimizers(values)
        for name, value in values.items():
            if name.endswith("-momentum"):
                self.last_momentum_values[name] = value
            elif name.endswith("-weight_decay"):
                self.last_weight_decay_values[name] = value
            else:
                self.lrs.setdefault(name, []).append(value)
        _log(trainer, values, step)

    def _rename_grown_optimizers(self, values: dict[str, float]) -> None:
        """An optimizer that had one parameter group and gained more (``BaseFinetuning`` adds them) is named
        per group from then on: its history moves from ``lr-X`` to ``lr-X/pg1``, as Lightning moves it, so
        one name keeps one group's whole record."""
        for name in values:
            old = name.removesuffix("/pg1")
            if old == name or old not in self.lrs or name in self.lrs:
                continue
            self.lrs[name] = self.lrs.pop(old)
            for suffix, kept in (("-momentum", self.last_momentum_values),
                                 ("-weight_decay", self.last_weight_decay_values)):
                if old + suffix in kept:
                    kept[name + suffix] = kept.pop(old + suffix)

    def rates(self, trainer: Any, interval: str) -> dict[str, float]:
        """The values to log: optimizers whose scheduler steps per ``interval`` (``any``: all), and every
        optimizer without a scheduler."""
        out: dict[str, float] = {}
        for optimizer, scheduled_per, names in _named_optimizers(trainer):
            if scheduled_per is not None and interval not in (scheduled_per, "any"):
                continue
            uses_betas = "betas" in optimizer.defaults
            for group, name in zip(optimizer.param_groups, names):
                out[name] = group["lr"]
                if self.log_momentum:
                    out[f"{name}-momentum"] = group["betas"][0] if uses_betas else group.get("momentum", 0)
                if self.log_weight_decay:
                    out[f"{name}-weight_decay"] = group["weight_decay"]
        return out


def _named_optimizers(trainer: Any) -> list[tuple[Any, str | None, list[str]]]:
    """``(optimizer, its scheduler's interval or None, one name per parameter group)``, named as Lightning
    names them: scheduled optimizers first, in the schedulers' order, then the others."""
    out: list[tuple[Any, str | None, list[str]]] = []
    count: dict[type, int] = {}
    seen: list[Any] = []

    def named(optimizer: Any, name: str, counted: bool) -> list[str]:
        seen.append(optimizer)
        kind = type(optimizer)
        if counted:
            count[kind] = count.get(kind, 0) + 1
        if count.get(kind, 0) > 1:
            name = f"{name}-{count[kind] - 1}"
        groups = optimizer.param_groups
        given = [group["name"] for group in groups if group.get("name")]
        if len(set(given)) != len(given):
            raise ConfigError(f"LearningRateMonitor: A single `Optimizer` cannot have multiple parameter "
                              f"groups with identical `name` values ({type(optimizer).__name__}: {given}); "
                              f"name them apart, or leave the names out (pg1, pg2, ...)")
        if len(groups) > 1:
            return [f"{name}/{group.get('name', f'pg{i + 1}')}" for i, group in enumerate(groups)]
        return [f"{name}/{groups[0]['name']}" if groups[0].get("name") else name]

    for config in trainer.lr_scheduler_configs:
        optimizer = config.scheduler.optimizer
        name = config.name if config.name is not None else f"lr-{type(optimizer).__name__}"
        out.append((optimizer, config.interval, named(optimizer, name, config.name is None)))
    for optimizer in trainer.strategy.optimizers:
        if not any(optimizer is s for s in seen):
            out.append((optimizer, None, named(optimizer, f"lr-{type(optimizer).__name__}", True)))
    return out


class ThroughputMonitor(Callback):
    """Logs ``throughput/samples_per_sec`` (this rank x data-parallel size) on logging steps.

    Host wall time between logging steps: on GPUs the number includes queued work only once
    the host waits for it, which the logging step's ``.item()`` does anyway.
    """

    def __init__(self) -> None:
        self._t0: float | None = None
        self._samples = 0

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._t0, self._samples = time.perf_counter(), 0  # also where a resume continues mid-epoch

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self._t0, self._samples = time.perf_counter(), 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._samples += trainer.metrics.batch_size
        if trainer.global_step % trainer.config.log_every_n_steps == 0 and self._t0 is not None:
            elapsed = time.perf_counter() - self._t0
            if elapsed > 0:
                rate = self._samples * trainer.strategy.dp_size / elapsed
                _log(trainer, {"throughput/samples_per_sec": rate}, trainer.global_step)
            self._t0, self._samples = time.perf_counter(), 0
