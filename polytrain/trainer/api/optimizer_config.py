"""Turning ``configure_optimizers``' many return shapes into optimizers and scheduler configs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.core.errors import ConfigError

_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "name", "strict")


@dataclass
class SchedulerConfig:
    """One learning-rate scheduler and when it steps (Lightning's ``LRSchedulerConfig`` keys;
    ``config.scheduler`` and ``config["scheduler"]`` both work)."""

    scheduler: Any
    interval: str = "epoch"  # "epoch" | "step"
    frequency: int = 1
    monitor: str | None = None  # the metric a ReduceLROnPlateau reads
    name: str | None = None
    strict: bool = True  # a monitored metric that was not logged is an error (False: skip the step)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    @property
    def reduce_on_plateau(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _scheduler_entry(item: Any, automatic: bool) -> SchedulerConfig:
    if isinstance(item, dict):
        unknown = [k for k in item if k not in _SCHEDULER_KEYS]
        if unknown or "scheduler" not in item:
            raise ValueError(f"lr_scheduler dict needs 'scheduler' and may have "
                             f"{', '.join(_SCHEDULER_KEYS)}; got {sorted(item)}")
        entry = SchedulerConfig(**item)
    else:
        entry = SchedulerConfig(item)
    if entry.interval not in ("epoch", "step"):
        raise ValueError(f"lr_scheduler interval={entry.interval!r}; valid: epoch, step")
    if not automatic:
        # manual optimisation steps its schedulers itself: what tells the loop when to step one is unused
        ignored = [k for k in ("monitor", "strict") if isinstance(item, dict) and k in item]
        if ignored:
            warnings.warn(f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be "
                          f"ignored. You need to call `lr_scheduler.step()` manually in manual optimization.",
                          RuntimeWarning, stacklevel=4)
        return entry
    if entry.reduce_on_plateau and not entry.monitor:
        raise ValueError("ReduceLROnPlateau needs a metric: return {'scheduler': ..., 'monitor': 'val/loss'}")
    return entry


def parse_optimizers(result: Any, automatic: bool = True
                     ) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Accepts an optimizer, (opt, sched), ([opts], [scheds]), a dict, or a list of dicts. ``automatic``:
    the loop steps the schedulers (a ReduceLROnPlateau then needs its ``monitor``); under manual
    optimisation the module does, and the keys that say when are ignored, with a warning."""
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, dict):
        if "optimizer" not in result:
            raise ValueError("configure_optimizers returned a dict without 'optimizer'")
        scheds = ([_scheduler_entry(result["lr_scheduler"], automatic)]
                  if result.get("lr_scheduler") is not None else [])
        return [result["optimizer"]], scheds
    if isinstance(result, (list, tuple)):
        if result and all(isinstance(x, dict) for x in result):
            pairs = [parse_optimizers(x, automatic) for x in result]
            return [o for p in pairs for o in p[0]], [s for p in pairs for s in p[1]]
        if len(result) == 2 and isinstance(result[0], (list, tuple)):
            return list(result[0]), [_scheduler_entry(s, automatic) for s in result[1]]
        if len(result) == 2 and isinstance(result[0], torch.optim.Optimizer) and not isinstance(
                result[1], torch.optim.Optimizer):
            return [result[0]], [_scheduler_entry(result[1], automatic)]
        if all(isinstance(x, torch.optim.Optimizer) for x in result):
            return list(result), []
    raise TypeError(
        f"configure_optimizers returned {type(result).__name__}; return an optimizer, "
        f"(optimizer, scheduler), ([optimizers], [schedulers]) or {{'optimizer': ..., 'lr_scheduler': ...}}"
    )


def check_scheduler_api(configs: list[SchedulerConfig], module: Any, steps_itself: bool) -> None:
    """Under automatic optimisation the loop calls each scheduler's ``step()``: one without it (a custom
    scheduler) needs the module's ``lr_scheduler_step`` to say how it steps, as in Lightning."""
    if not module.automatic_optimization or steps_itself:
        return
    for entry in configs:
        if not callable(getattr(entry.scheduler, "step", None)):
            raise ConfigError(f"The provided lr scheduler `{type(entry.scheduler).__name__}` doesn't follow "
                              f"PyTorch's LRScheduler API (it has no step()). You should override the "
                              f"`{type(module).__name__}.lr_scheduler_step` hook with your own logic if you "
                              f"are using a custom LR scheduler")


def step_schedulers(configs: list[SchedulerConfig], interval: str, count: int, metrics: dict[str, Any],
                    step_fn: Callable[[Any, Any], None], plateau: bool | None = None) -> None:
    """Step the ``interval`` schedulers due at ``count`` through ``step_fn(scheduler, metric)`` (the
    module's ``lr_scheduler_step``). ``plateau``: only monitored ones (True) or only the others (False)."""
    for entry in configs:
        if entry.interval != interval or count % entry.frequency:
            continue
        if plateau is not None and bool(entry.monitor) != plateau:
            continue
        metric = None
        if entry.monitor:
            if entry.monitor not in metrics:
                if not entry.strict:
                    continue
                raise KeyError(f"lr_scheduler monitors '{entry.monitor}' but it was not logged; "
                               f"logged: {', '.join(sorted(metrics)) or '(nothing)'}")
            metric = metrics[entry.monitor]
        step_fn(entry.scheduler, metric)
