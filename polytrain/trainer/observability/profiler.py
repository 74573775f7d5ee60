"""Profilers: ``trainer.profiler: simple | torch`` (or a mapping ``{name: simple|torch, ...options}``).

- ``simple`` times every hook (per callback and the module) and every phase of the fit loop
  (getting a batch, moving it, the training batch and its forward/backward/optimizer step, logging
  steps, validation, epoch ends) and prints a table at fit end on global rank 0 (every rank times its
  own; ``filename`` also writes each rank's table under the run directory).
- ``torch`` runs ``torch.profiler`` on global rank 0 for a window of training batches (``wait``,
  ``warmup``, ``active``, ``repeat``, ``skip_first``: ``torch.profiler.schedule``'s meaning) and
  writes the trace with ``tensorboard_trace_handler`` to ``dir`` (default ``<log_dir>/profiler``):
  open it with TensorBoard's profiler plugin, Perfetto or chrome://tracing. The loop's phases and
  hooks appear in it as ``polytrain/...`` ranges.

Without a profiler nothing is timed and nothing is checked per step: ``trainer.profiler`` is a
``PassThroughProfiler`` whose ``phase(row)`` is a context manager that does nothing and whose
``instrument(row, fn)`` returns ``fn`` itself. The loop's phases are ``with profiler.phase(row):``
blocks written where the phase runs (``FitLoop.train_step``, the optimisation, the strategy's
forward and backward), and the hook funnel (``Hooks``) builds each hook's callable once through
``instrument``: a profiled run takes exactly the path an unprofiled one does, and nothing is
patched or put back. Times are wall-clock and inclusive: a hook called inside the training batch
counts in both rows.

``trainer.profiler.profile(name)`` is Lightning's context manager for timing your own code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from polytrain.core.errors import ConfigError

log = logging.getLogger("polytrain")

SIMPLE_OPTIONS = ("name", "filename")
TORCH_OPTIONS = ("name", "dir", "wait", "warmup", "active", "repeat", "skip_first", "record_shapes",
                 "profile_memory", "with_stack", "with_flops")

# (row, indent): the loop's phases in the order of the table.
PHASES = (("fit", 0), ("train epoch", 1), ("get batch", 2), ("batch to device", 2), ("training batch", 2),
          ("forward+backward", 3), ("training_step", 4), ("backward", 4), ("optimizer update", 3),
          ("logging step", 2), ("validation", 2), ("epoch end", 2))


class PassThroughProfiler:
    """The default: no timing; ``profile(name)`` is a no-op context manager (Lightning's default too)."""

    @property
    def enabled(self) -> bool:
        """Whether this rank times anything."""
        return False

    def instrument(self, row: str, fn: Callable[..., Any],
                   excluding: str | None = None) -> Callable[..., Any]:
        """``fn`` timed under ``row`` (less the time spent in row ``excluding`` meanwhile); here ``fn``
        itself."""
        return fn

    def phase(self, row: str, excluding: str | None = None) -> contextlib.AbstractContextManager:
        """The block it guards timed under ``row`` (less the time spent in row ``excluding`` meanwhile);
        here a context manager that does nothing. One object per row: the loop enters it on every batch."""
        return _NO_PHASE

    def setup(self, global_rank: int, device_type: str) -> None:
        """Where this process runs, once the strategy knows (before the stage's hooks are planned)."""

    def start(self, log_dir: str) -> None:
        """The fit starts; ``log_dir``: the run's directory (a table or trace written at the end goes
        there)."""

    def stop(self) -> None:
        """The fit ended: report."""

    def profile(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class SimpleProfiler(PassThroughProfiler):
    @property
    def enabled(self) -> bool:
        return True

    def __init__(self, filename: str | None = None) -> None:
        self.filename = filename
        self.global_rank = 0
        self.device_type = "cpu"
        self.log_dir = "."
        self.records: dict[str, list[float]] = {}  # row -> [total seconds, calls]
        # row -> each call's seconds (Lightning's ``recorded_durations``; rows are named as Lightning's:
        # ``[Callback]<state key>.<hook>``, ``[LightningModule]<class>.<hook>``, ...)
        self.recorded_durations: dict[str, list[float]] = {}
        self._phases: dict[tuple[str, str | None], _TimedPhase] = {}
        self._t0 = 0.0
        self.summary: str | None = None

    # ------------------------------------------------------------------ timing
    def instrument(self, row: str, fn: Callable[..., Any],
                   excluding: str | None = None) -> Callable[..., Any]:
        if not self.enabled:
            return fn
        record, durations = self._row(row)
        inner = self.records.setdefault(excluding, [0.0, 0]) if excluding is not None else None
        clock = time.perf_counter

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            t0, inside = clock(), inner[0] if inner is not None else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0 - ((inner[0] - inside) if inner is not None else 0.0)
                record[0] += spent
                record[1] += 1
                durations.append(spent)

        return call

    def phase(self, row: str, excluding: str | None = None) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return _NO_PHASE
        timed = self._phases.get((row, excluding))
        if timed is None:
            record, durations = self._row(row)
            inner = self.records.setdefault(excluding, [0.0, 0]) if excluding is not None else None
            timed = self._phases[(row, excluding)] = _TimedPhase(record, durations, inner)
        return timed

    @contextlib.contextmanager
    def profile(self, name: str) -> Iterator[None]:
        record, durations = self._row(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            record[0] += spent
            record[1] += 1
            durations.append(spent)

    def _row(self, name: str) -> tuple[list[float], list[float]]:
        """A row's running [total, calls] and its list of durations."""
        return self.records.setdefault(name, [0.0, 0]), self.recorded_durations.setdefault(name, [])

    def setup(self, global_rank: int, device_type: str) -> None:
        self.global_rank, self.device_type = global_rank, device_type

    def start(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        spent = time.perf_counter() - self._t0
        self.records["fit"] = [spent, 1]
        self.recorded_durations["fit"] = [spent]
        self.report()

    # ------------------------------------------------------------------ report
    def table(self) -> str:
        fit = self.records.get("fit", [0.0, 1])[0] or 1e-12
        rows = [("phase / hook", "calls", "total s", "mean ms", "% of fit")]

        def row(label: str, record: list[float]) -> tuple[str, ...]:
            total, calls = record
            mean = total / calls * 1e3 if calls else 0.0
            return label, str(int(calls)), f"{total:.4f}", f"{mean:.3f}", f"{100 * total / fit:.1f}"

        for name, indent in PHASES:
            record = self.records.get(name)
            if record is not None and record[1]:
                rows.append(row("  " * indent + name, record))
        phases = {name for name, _ in PHASES}
        others = sorted(((n, r) for n, r in self.records.items() if n not in phases and r[1]),
                        key=lambda item: -item[1][0])
        if others:
            rows.append(("hooks (callbacks, module, DataModule) and profile() blocks", "", "", "", ""))
            rows.extend(row("  " + _short_label(name), record) for name, record in others)
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [r[0].ljust(widths[0]) + "  " + "  ".join(c.rjust(w) for c, w in zip(r[1:], widths[1:]))
                 for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def report(self) -> None:
        self.summary = f"simple profiler, rank {self.global_rank}: wall time, inclusive\n{self.table()}"
        if self.filename:
            path = os.path.join(self.log_dir, f"{self.filename}-rank{self.global_rank}.txt")
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(self.summary + "\n")
        if self.global_rank == 0:
            print(self.summary, flush=True)


def _short_label(row: str) -> str:
    """A row's label in the printed table: a callback's state key without its settings
    (``[Callback]ModelCheckpoint{'monitor': ...}.setup`` prints as ``[Callback]ModelCheckpoint.setup``);
    ``records`` and ``recorded_durations`` keep the whole key, as Lightning's profiler does."""
    return re.sub(r"\{.*\}(?=\.\w+$)", "", row)


class _NoPhase:
    """The pass-through profiler's phase: entering and leaving it does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_PHASE = _NoPhase()


class _TimedPhase:
    """A row's wall time: each pass through the block adds its duration (less the time the row
    ``inner`` grew meanwhile: the update's row leaves out the forward and backward a closure ran
    inside it) and one call."""

    __slots__ = ("record", "durations", "inner", "started", "inside")

    def __init__(self, record: list[float], durations: list[float], inner: list[float] | None) -> None:
        self.record = record
        self.durations = durations
        self.inner = inner
        self.started = 0.0
        self.inside = 0.0

    def __enter__(self) -> None:
        self.inside = self.inner[0] if self.inner is not None else 0.0
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        spent = time.perf_counter() - self.started
        if self.inner is not None:
            spent -= self.inner[0] - self.inside
        self.record[0] += spent
        self.record[1] += 1
        self.durations.append(spent)


class TorchProfiler(SimpleProfiler):
    """``torch.profiler`` over a window of training batches on global rank 0; the phases and hooks are
    labelled ranges in the trace. Other ranks run unprofiled."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__()
        self.options = options
        self.profiler: Any = None
        self.trace_dir: str | None = None

    @property
    def enabled(self) -> bool:
        return self.global_rank == 0

    def instrument(self, row: str, fn: Callable[..., Any],
                   excluding: str | None = None) -> Callable[..., Any]:
        if not self.enabled:
            return fn
        label, record_function = f"polytrain/{row}", torch.profiler.record_function

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        return call

    def phase(self, row: str, excluding: str | None = None) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return _NO_PHASE
        return _TracedPhase(f"polytrain/{row}", self if row == "training batch" else None)

    def start(self, log_dir: str) -> None:
        o = self.options
        self.log_dir = log_dir
        if not self.enabled:
            return
        self.trace_dir = o.get("dir") or os.path.join(log_dir, "profiler")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=o.get("wait", 1), warmup=o.get("warmup", 1),
                                           active=o.get("active", 3), repeat=o.get("repeat", 1),
                                           skip_first=o.get("skip_first", 0))
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir,
                                                                    worker_name=f"rank{self.global_rank}"),
            record_shapes=o.get("record_shapes", False), profile_memory=o.get("profile_memory", False),
            with_stack=o.get("with_stack", False), with_flops=o.get("with_flops", False))
        self.profiler.start()

    def stop(self) -> None:
        if self.profiler is None:
            return  # not rank 0
        self.profiler.stop()  # a window still recording is written now
        self.profiler = None
        self.report()

    def report(self) -> None:
        traces = (sorted(os.listdir(self.trace_dir)) if self.trace_dir and os.path.isdir(self.trace_dir)
                  else [])
        log.info("torch profiler: %d trace file(s) in %s (TensorBoard: tensorboard --logdir %s)", len(traces),
                 self.trace_dir, self.trace_dir)


class _TracedPhase:
    """A labelled range in torch.profiler's trace; the training batch's also ends a profiler step
    (the schedule's ``wait``/``warmup``/``active`` count training batches)."""

    __slots__ = ("label", "stepping", "range")

    def __init__(self, label: str, stepping: TorchProfiler | None) -> None:
        self.label = label
        self.stepping = stepping  # the profiler whose torch.profiler steps at the block's end
        self.range: Any = None

    def __enter__(self) -> None:
        self.range = torch.profiler.record_function(self.label)
        self.range.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.range.__exit__(*exc)
        if self.stepping is not None and self.stepping.profiler is not None:
            self.stepping.profiler.step()


def check_profiler_options(spec: Any) -> tuple[str, dict[str, Any]] | None:
    """``trainer.profiler`` as ``(name, options)``, or None; unknown options are errors."""
    if spec is None:
        return None
    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    name = options.get("name")
    valid = {"simple": SIMPLE_OPTIONS, "torch": TORCH_OPTIONS}.get(name)
    if valid is None:
        raise ConfigError(f"trainer.profiler={spec!r}; choose one of: simple, torch (or null), or a mapping "
                          f"{{name: torch, ...options}}")
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"trainer.profiler ({name}) has unknown option(s) {unknown}; "
                          f"valid: {', '.join(valid[1:])}")
    for key in ("wait", "warmup", "active", "repeat", "skip_first"):
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0
                                  or (key == "active" and value < 1)):
            raise ConfigError(f"trainer.profiler.{key}={value!r} must be a "
                              f"{'positive' if key == 'active' else 'non-negative'} integer")
    return name, options


def build_profiler(spec: Any) -> PassThroughProfiler:
    """The Trainer's profiler for ``trainer.profiler`` (checked at config validation)."""
    checked = check_profiler_options(spec)
    if checked is None:
        return PassThroughProfiler()
    name, options = checked
    if name == "simple":
        return SimpleProfiler(options.get("filename"))
    return TorchProfiler(options)
