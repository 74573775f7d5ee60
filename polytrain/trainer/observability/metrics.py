"""What ``self.log`` records, and how it is reduced and published, with Lightning's semantics.

- Defaults depend on where ``self.log`` is called: training steps and batch-level hooks log per step,
  evaluation steps per epoch, epoch-level hooks per epoch only (the loops set ``defaults``).
- Each stage keeps its own values (``train``, ``val``, ``test``; the sanity check's are dropped), so a
  value logged during validation never reaches a training logging step.
- Logged both per step and per epoch, a value is "forked": loggers get ``name_step`` at logging steps
  and ``name_epoch`` at epoch end; ``callback_metrics`` holds both and ``name`` (the latest).
- Epoch values reduce with ``reduce_fx`` (``mean`` weighted by batch size, ``sum``, ``max``, ``min``)
  over the epoch and across the data-parallel ranks, in one all-reduce per operation. A torchmetrics
  ``Metric`` passed as the value is computed (and synced by itself) at epoch end, then reset.
- Per-step values stay on the device until a logging step asks for them; ``sync_dist`` reduces them
  across ranks only then. Nothing here forces a host-device sync on other steps.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import collectives as C
from polytrain.core.batch import batch_size_of
from polytrain.core.errors import ConfigError

if TYPE_CHECKING:
    from polytrain.trainer.api.hooks import Hooks

REDUCE_FX = ("mean", "sum", "max", "min")
# Lightning's other ways of naming them
_REDUCE_SPELLINGS: dict[Any, str] = {"avg": "mean", "mean": "mean", "sum": "sum", "max": "max", "min": "min",
                                     torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min",
                                     sum: "sum", max: "max", min: "min"}
# The trainer's own files (every room of polytrain/trainer): frames there are not the user's hook.
_TRAINER = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _options_text(options: tuple) -> str:
    names = ("on_step", "on_epoch", "prog_bar", "logger", "reduce_fx", "sync_dist")
    return ", ".join(f"{n}={v!r}" for n, v in zip(names, options))


def _calling_hook() -> str:
    """The user function that called ``self.log`` (only looked up to word an error)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TRAINER):
        frame = frame.f_back
    return f"{frame.f_code.co_name}()" if frame is not None else "this hook"


class Refusing:
    """``with metrics.refusing("lr_scheduler_step"):`` logging is an error inside (as Lightning)."""

    __slots__ = ("metrics", "where", "saved")

    def __init__(self, metrics: MetricCollector, where: str) -> None:
        self.metrics, self.where, self.saved = metrics, where, None

    def __enter__(self) -> None:
        self.saved, self.metrics.refused_in = self.metrics.refused_in, self.where

    def __exit__(self, *exc: Any) -> None:
        self.metrics.refused_in = self.saved
_FLOAT32 = torch.float32
_ALL_REDUCE_OP = {"mean": "sum", "sum": "sum", "max": "max", "min": "min"}


def is_metric_object(value: Any) -> bool:
    """A torchmetrics ``Metric`` (duck-typed: polytrain does not import torchmetrics)."""
    return isinstance(value, torch.nn.Module) and callable(getattr(value, "compute", None)) and callable(
        getattr(value, "reset", None))


def _as_tensor(value: Any, device: torch.device, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.float32 and value.dim() == 0:
            return value  # what reshape(()).float() gives, without two dispatches per logged value
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}, ...): the logged tensor must have a single element, got "
                             f"one of shape {tuple(value.shape)}; log a scalar (e.g. its mean)")
        return value.reshape(()).float()
    if isinstance(value, (int, float, bool)):
        return torch.tensor(float(value), device=device)
    # Lightning's words (and its ValueError), so code that matches them keeps working
    raise ValueError(f"`self.log({name}, {value})` was called, but `{type(value).__name__}` values cannot be "
                     f"logged: give a number, a scalar tensor or a torchmetrics Metric")


def _agreed_names(local: list[tuple[str, str]], device: torch.device, group: Any) -> list[tuple[str, str]]:
    """Every rank's ``(name, reduce_fx)`` pairs, united, in the same order everywhere (collective).

    Ranks nearly always logged the same names: a gather of (count, 64-bit digest) shows it in one small
    collective; only when they differ are the names themselves gathered (two collectives and pickling). A
    name given two reductions keeps the first in order."""
    digest = int.from_bytes(hashlib.blake2b(repr(local).encode(), digest_size=8).digest(), "little",
                            signed=True)
    rows = C.all_gather(torch.tensor([len(local), digest], dtype=torch.long, device=device), group).tolist()
    if all(row == rows[0] for row in rows):
        return local
    united: dict[str, str] = {}
    for name, fx in sorted(set().union(*map(set, C.all_gather_object(local, group)))):
        united.setdefault(name, fx)
    return list(united.items())


class Logged:
    """One name's record within a stage."""

    __slots__ = ("name", "options", "on_step", "on_epoch", "prog_bar", "logger", "reduce_fx", "sync_dist",
                 "metric", "total", "count", "step_value", "loader", "hook")

    def __init__(self, name: str, options: tuple, loader: int | None = None, hook: str = "") -> None:
        self.name = name
        self.options = options
        self.loader = loader  # the evaluation loader it was logged under (None: none, or one loader only)
        self.hook = hook  # the function that logged it first
        self.on_step, self.on_epoch, self.prog_bar, self.logger, self.reduce_fx, self.sync_dist = options
        self.metric: Any = None
        self.total: torch.Tensor | None = None  # epoch accumulation (weighted sum for mean)
        self.count: float = 0.0
        self.step_value: torch.Tensor | None = None

    @property
    def forked(self) -> bool:
        return self.on_step and self.on_epoch

    def step_name(self) -> str:
        return self._tagged("step") if self.forked else self.name

    def epoch_name(self) -> str:
        return self._tagged("epoch") if self.forked else self.name

    def _tagged(self, tag: str) -> str:
        """``loss_step``; under several evaluation loaders the tag goes before the loader's suffix, as
        Lightning names it: ``loss_epoch/dataloader_idx_0``."""
        base, separator, index = self.name.rpartition("/dataloader_idx_")
        return f"{base}_{tag}{separator}{index}" if separator else f"{self.name}_{tag}"


class MetricCollector:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.batch: Any = None  # the batch being stepped or evaluated: the weight of a per-epoch mean
        self.stage: str | None = None  # "train" | "val" | "test" | "sanity" | None (logging refused)
        self.defaults = (True, False)  # (on_step, on_epoch) where self.log is being called
        self.refused_in: str | None = None  # a hook where logging is an error
        self.eval_epoch_level = False  # in an evaluation's start/epoch hooks: on_step=True is an error
        # the loader an evaluation of several reads now: what self.log names get as a suffix
        self.dataloader_idx: int | None = None
        self.results: dict[str, dict[str, Logged]] = {}
        self._current: dict[str, Logged] = {}
        self._fresh: dict[str, Logged] = {}  # this stage's values logged per step since its last logging step
        self._fresh_by_stage: dict[str, dict[str, Logged]] = {}
        # What callbacks see: tensors, the latest of every name (per step values are local until
        # a logging step syncs them). The sanity check's values are dropped when it ends.
        self.callback: dict[str, torch.Tensor] = {}
        # The training epoch's last per-step values (reduce_epoch keeps them): what Lightning's
        # logged_metrics and progress_bar_metrics show after the epoch, logged or not on a logging step.
        self.last_step_values: dict[str, tuple[Logged, torch.Tensor]] = {}
        # What has been sent to the loggers and the progress bar (Lightning's logged_metrics and
        # progress_bar_metrics), as floats.
        self.logged: dict[str, float] = {}
        self.progress_bar: dict[str, float] = {}
        self._eval_step_entries: list[Logged] = []  # this evaluation's per-step names: dropped at its end

    @property
    def batch_size(self) -> int:
        """The current batch's size (its first tensor's leading dimension), read from the batch only when
        a per-epoch mean needs it, not on every step."""
        return batch_size_of(self.batch) if self.batch is not None else 1

    # ------------------------------------------------------------------ recording
    def start_stage(self, stage: str | None, defaults: tuple[bool, bool] = (True, False)) -> None:
        self.stage = stage
        self.defaults = defaults
        self.refused_in = None
        self.eval_epoch_level = False
        if stage is not None:
            self._current = self.results.setdefault(stage, {})
            self._fresh = self._fresh_by_stage.setdefault(stage, {})

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: str = "mean",
            sync_dist: bool = False, batch_size: int | None = None) -> None:
        if self.refused_in is not None or self.stage is None:
            where = self.refused_in or "outside the training and evaluation loops"
            raise RuntimeError(f"self.log({name!r}) in {_calling_hook()}: nothing can be logged there "
                               f"({where}), as in Lightning. Log from training_step, validation_step, "
                               f"test_step or the batch/epoch hooks around them")
        if on_step and self.epoch_level():
            raise ValueError(f"self.log({name!r}, on_step=True) in {_calling_hook()}: an epoch-level hook "
                             f"logs once per epoch; drop on_step=True (as in Lightning, where it is an "
                             f"error too)")
        defaults = self.defaults
        on_step = defaults[0] if on_step is None else on_step
        on_epoch = defaults[1] if on_epoch is None else on_epoch
        if reduce_fx != "mean":  # Lightning's other spellings: "avg", "MAX", torch.max, max, ...
            reduce_fx = _REDUCE_SPELLINGS.get(reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx,
                                              reduce_fx)
        options = (on_step, on_epoch, prog_bar, logger, reduce_fx, sync_dist)
        entry = self._current.get(name)
        if entry is None or entry.options != options:
            if reduce_fx not in REDUCE_FX:
                raise ConfigError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): only "
                                  f"`self.log(..., reduce_fx={{min,max,mean,sum}})` are supported (also as "
                                  f"torch.min, ...); for a custom reduction log a torchmetrics Metric")
            if not (on_step or on_epoch):
                raise ConfigError(f"self.log({name!r}, on_step=False, on_epoch=False) is not useful: it "
                                  f"records nothing; log per step, per epoch or both")
            hook = _calling_hook()
            if entry is not None and entry.hook == hook:
                # as Lightning: the record would start again, and what it accumulated would be lost
                raise ConfigError(f"You called `self.log({name}, ...)` twice in `{hook.removesuffix('()')}` "
                                  f"with different arguments (first {_options_text(entry.options)}, now "
                                  f"{_options_text(options)}). This is not allowed: log it with the same "
                                  f"arguments each time, or under another name")
            entry = self._current[name] = Logged(name, options, self.dataloader_idx, hook)
        elif entry.loader != self.dataloader_idx:
            entry.loader = None  # one name (add_dataloader_idx=False) under several loaders: the whole pass's
        if type(value) is torch.Tensor and value.dtype is _FLOAT32 and not value.dim():
            tensor = value.detach()  # the common case (a loss), without the calls below
        else:
            if is_metric_object(value):
                entry.metric = value
                if not on_step:
                    return
                value = getattr(value, "_forward_cache", None)
                if value is None:
                    raise ValueError(f"self.log({name!r}, <Metric>, on_step=True): call the metric on the "
                                     f"batch (metric(preds, target)) before logging it, so it has a "
                                     f"per-step value")
            tensor = _as_tensor(value, self.device, name)
        if on_step:
            entry.step_value = tensor
            self._fresh[name] = entry
            self.callback[name] = tensor
            if on_epoch:
                self.callback[entry.step_name()] = tensor
        if on_epoch and entry.metric is None:
            self._accumulate(entry, tensor, batch_size)
            if not on_step and self.epoch_level():
                # Logged in an epoch-level hook: readable there at once (Lightning reduces on each read);
                # the epoch's reduction after the hook replaces it with the value reduced across ranks.
                self.callback[name] = tensor

    def epoch_level(self) -> bool:
        """In a hook that runs once per epoch or stage (on_train_start, on_*_epoch_start/end, ...)."""
        return self.eval_epoch_level or (self.stage == "train" and self.defaults == (False, True))

    def refusing(self, where: str) -> Refusing:
        return Refusing(self, where)

    def _accumulate(self, entry: Logged, tensor: torch.Tensor, batch_size: int | None) -> None:
        fx = entry.reduce_fx
        if fx == "mean":
            weight = float(batch_size if batch_size is not None else self.batch_size)
            weighted = tensor * weight
            entry.total = weighted if entry.total is None else entry.total + weighted
            entry.count += weight
        elif entry.total is None:
            entry.total = tensor
            entry.count = 1.0
        else:
            entry.total = (entry.total + tensor if fx == "sum" else
                           torch.maximum(entry.total, tensor) if fx == "max" else
                           torch.minimum(entry.total, tensor))
            entry.count += 1.0

    # ------------------------------------------------------------------ publishing
    def has_fresh_step_values(self) -> bool:
        return bool(self._fresh)

    def pop_step_values(self, group: Any = None, sync: bool = True) -> dict[str, tuple[Logged, torch.Tensor]]:
        """The per-step values logged since the last call, by published name; ``sync_dist`` ones
        reduced across ``group`` (``sync=True``: every rank calls this at the same logging steps)."""
        fresh = dict(self._fresh)
        self._fresh.clear()
        synced = [e for e in fresh.values() if e.sync_dist] if sync else []
        values = {e.step_name(): (e, e.step_value) for e in fresh.values()}
        if synced and C.active(group):
            for op in {e.reduce_fx for e in synced}:
                entries = [e for e in synced if e.reduce_fx == op]
                packed = C.all_reduce(torch.stack([e.step_value.float() for e in entries]), op, group)
                for e, v in zip(entries, packed.unbind(0)):
                    values[e.step_name()] = (e, v)
        for e, v in values.values():
            self.callback[e.name] = v
            if e.forked:
                self.callback[e.step_name()] = v
        return values

    def sync_fresh_step_values(self, stage: str, group: Any = None) -> None:
        """``callback_metrics`` of ``stage``'s ``sync_dist`` per-step values logged since its last logging
        step, reduced across ``group``, as Lightning shows them; they stay fresh for the next logging step.
        Every rank calls this at the same point (an epoch's end): one all-reduce per reduce op, only where
        there is such a value."""
        synced = [e for e in self._fresh_by_stage.get(stage, {}).values() if e.sync_dist]
        if not synced or not C.active(group):
            return
        for op in sorted({e.reduce_fx for e in synced}):
            entries = [e for e in synced if e.reduce_fx == op]
            packed = C.all_reduce(torch.stack([e.step_value.float() for e in entries]), op, group)
            for e, v in zip(entries, packed.unbind(0)):
                self.callback[e.name] = v
                if e.forked:
                    self.callback[e.step_name()] = v

    def reduce_epoch(self, stage: str, group: Any = None,
                     more: bool = False) -> dict[str, tuple[Logged, torch.Tensor]]:
        """Epoch values of ``stage`` reduced over the epoch and the data-parallel ranks, by published
        name, and into ``callback``; the stage's records are cleared. Called by every rank at the same
        point: before the epoch-end hooks (they read the epoch's values), then with ``more=True`` after
        them (what they logged)."""
        results = self.results.pop(stage, {})
        if stage == self.stage:
            self._current = self.results.setdefault(stage, {})
        local = sorted((n, e.reduce_fx) for n, e in results.items()
                       if e.on_epoch and e.metric is None and e.total is not None)
        # Ranks can differ in which names they logged (a rank with no batches logged none), so agree
        # on the union first, with each name's reduction; a missing name contributes nothing (count 0).
        named = _agreed_names(local, self.device, group) if C.active(group) else local
        out: dict[str, tuple[Logged, torch.Tensor]] = {}
        by_op: dict[str, list[str]] = {}
        reductions = dict(named)
        for n, fx in named:
            by_op.setdefault(_ALL_REDUCE_OP[fx], []).append(n)
        for op, op_names in by_op.items():
            totals, counts = [], []
            for n in op_names:
                e = results.get(n)
                empty = torch.tensor(0.0 if op == "sum" else float("-inf") if op == "max" else float("inf"),
                                     device=self.device)
                totals.append(e.total.to(self.device) if e is not None and e.total is not None else empty)
                counts.append(e.count if e is not None else 0.0)
            packed = torch.stack(totals + [torch.tensor(c, device=self.device) for c in counts])
            if C.active(group):
                packed = torch.cat([C.all_reduce(packed[: len(op_names)], op, group),
                                    C.all_reduce(packed[len(op_names):], "sum", group)])
            for i, n in enumerate(op_names):
                count = packed[len(op_names) + i]
                if float(count) <= 0:
                    continue
                e = results.get(n) or Logged(n, (False, True, False, True, reductions[n], False))
                value = packed[i] / count if e.reduce_fx == "mean" else packed[i]
                out[e.epoch_name()] = (e, value)
        for e in results.values():
            if e.metric is not None and e.on_epoch:
                out[e.epoch_name()] = (e, _as_tensor(e.metric.compute(), self.device, e.epoch_name()))
                e.metric.reset()
        for e, v in out.values():
            self.callback[e.name] = v
            if e.forked:
                self.callback[e.epoch_name()] = v
        if stage == "train":
            last = {e.step_name(): (e, e.step_value) for e in results.values()
                    if e.on_step and e.step_value is not None}
            self.last_step_values = {**self.last_step_values, **last} if more else last
        elif stage in ("val", "test"):
            stepped = [e for e in results.values() if e.on_step]
            self._eval_step_entries = self._eval_step_entries + stepped if more else stepped
        return out

    def end_eval_epoch(self) -> None:
        """As Lightning: an evaluation's per-step values leave callback_metrics when it ends."""
        for e in self._eval_step_entries:
            self.callback.pop(e.step_name(), None)
            if not e.on_epoch:
                self.callback.pop(e.name, None)
        self._eval_step_entries = []

    def publish(self, values: dict[str, tuple[Logged, torch.Tensor]]) -> dict[str, float]:
        """``values`` as floats into ``logged`` and ``progress_bar`` (a host read: only at logging steps and
        epoch ends); returns what goes to the loggers. The training epoch's last per-step values come
        along once (Lightning's logged_metrics show them after the epoch)."""
        latest, self.last_step_values = self.last_step_values, {}
        for name, (entry, value) in latest.items():
            if entry.prog_bar:
                self.progress_bar[name] = float(value)
            if entry.logger:
                self.logged[name] = float(value)
        if not values:
            return {}
        scalars = {name: float(v) for name, (_, v) in values.items()}
        self.progress_bar.update({n: scalars[n] for n, (e, _) in values.items() if e.prog_bar})
        logged = {n: scalars[n] for n, (e, _) in values.items() if e.logger}
        self.logged.update(logged)
        return logged

    def discard(self, stage: str) -> None:
        """Forget ``stage``'s records (the sanity check's)."""
        self.results.pop(stage, None)
        self._fresh_by_stage.pop(stage, None)

    def reset(self) -> None:
        """As Lightning: every stage (``fit``, ``validate``, ``test``, ``predict``) starts with empty
        ``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` (after ``test()`` they hold
        the test's values only), and so does the fit after its sanity check (what the check logged was
        readable in its hooks only)."""
        self.callback.clear()
        self.logged.clear()
        self.progress_bar.clear()

    def start_run(self) -> None:
        """A stage starts: ``reset``, and no record is left from an earlier stage of this Trainer (one
        that raised keeps what it had logged in its unfinished epoch)."""
        self.reset()
        self.results.clear()
        self._fresh_by_stage.clear()
        self._current, self._fresh = {}, {}
        self._eval_step_entries.clear()


def publish(metrics: MetricCollector, hooks: Hooks, values: dict[str, tuple[Logged, torch.Tensor]],
            step: int) -> None:
    """Hand values to the loggers (``on_log``) and the progress bar: the only place metrics leave the
    device."""
    logged = metrics.publish(values)
    if values:
        hooks.callbacks("on_log", logged, step)
