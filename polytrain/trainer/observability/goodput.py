"""Goodput: how much of a run's wall time trained the model, from the loop's own clock marks.

The fit's wall time splits into training, checkpoint blocking, validation, waiting for data, restart and
lost work (the gap between a failed attempt's last mark and the next attempt's start, and the steps
after the checkpoint it resumed from, which were trained twice), and the rest (set-up, sanity check,
hooks at the edges). ``productive`` = training time of steps that count; the productive fraction is
that over the wall time from the first attempt's start to the end.

The clock is ``time.perf_counter`` around whole phases (an epoch, a validation, a save) and around
each batch fetch: no host-device sync is added, so on a GPU a phase's time is host time (kernels still
queued when it ends count in the phase that waits for them). Across restarts: the logging rank appends
a line to ``<log_dir>/goodput.jsonl`` when a fit starts, after every checkpoint save and at every
logging step (step, wall time, the phase totals so far); a resumed fit reads the run's earlier lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("polytrain")

RECORD_FILE = "goodput.jsonl"
PHASES = ("epoch", "data", "validation", "checkpoint", "checkpoint_in_epoch")


class Goodput:
    """A fit's phase clock and the run's record across attempts; ``report()`` is the split."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.path: str | None = None  # the record file (logging rank, when the run has a directory)
        self.earlier: list[dict[str, Any]] = []  # the run's lines from attempts before this one
        self.started = self.started_wall = 0.0
        self.start_step = 0
        self._running: dict[str, float] = {}  # phase -> perf_counter at its start, while it runs
        self._last: dict[str, Any] = {}
        self._staging_seen = 0.0  # the checkpoint I/O's staging-wait total already counted
        self.last: dict[str, float] | None = None  # the last fit's split (report)
        self._phases = {name: _Phase(name, self.totals, self._running)
                        for name in ("epoch", "data", "validation")}

    # ------------------------------------------------------------------ the clock
    def begin(self, step: int, staging_waited: float, record_dir: str | None) -> None:
        """The fit starts (after any resume) at step ``step``; ``staging_waited``: the checkpoint I/O's
        staging-wait total so far; ``record_dir``: where the record is kept (the logging rank's run
        directory; None: no record). Lines of the run's record after its last finished fit are earlier
        attempts of this one (each ended by a failure and restarted)."""
        self.totals.update(dict.fromkeys(PHASES, 0.0))  # in place: the phases add to this mapping
        self.started, self.started_wall, self.start_step = time.perf_counter(), time.time(), step
        self._running.clear()
        self._staging_seen = staging_waited
        self.path, self.earlier = None, []
        if record_dir is not None:
            self.path = os.path.join(record_dir, RECORD_FILE)
            lines = read_record(self.path)
            ends = [i for i, line in enumerate(lines) if line["event"] == "end"]
            self.earlier = lines[ends[-1] + 1:] if ends else lines
        self._write("start", step)

    def phase(self, name: str) -> _Phase:
        """``with goodput.phase(name):``: the block's duration added to ``name`` (an epoch, a validation,
        the wait for a batch). One object per phase: the loop enters ``data`` on every batch."""
        return self._phases[name]

    def count_staging_waits(self, total: float) -> None:
        """Optimizer updates that waited for an async save's background copy (``total``: the checkpoint
        I/O's running sum) blocked training for the checkpoint, inside an epoch."""
        if total > self._staging_seen:
            self.totals["checkpoint"] += total - self._staging_seen
            self.totals["checkpoint_in_epoch"] += total - self._staging_seen
            self._staging_seen = total

    @contextlib.contextmanager
    def saving(self, step: int, staging_waited: float = 0.0) -> Iterator[None]:
        """A checkpoint save blocking training; the record notes the step it holds once it is written.
        ``staging_waited``: the checkpoint I/O's staging-wait total (the previous async save's copy)."""
        self.count_staging_waits(staging_waited)
        begun = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - begun
            self.totals["checkpoint"] += spent
            if "epoch" in self._running:
                self.totals["checkpoint_in_epoch"] += spent
            if "validation" in self._running:
                # The epoch's save runs inside its validation (a callback's on_validation_end): that time is
                # the checkpoint's, and counting it in both would take it from training twice.
                self.totals["validation"] -= spent
        self._write("checkpoint", step)

    def mark(self, step: int) -> None:
        """After a logging step: a line in the record saying how far this attempt got (the work lost if
        it dies before the next checkpoint)."""
        self._write("mark", step)

    def _write(self, event: str, step: int) -> None:
        totals, now = dict(self.totals), time.perf_counter()
        for phase, begun in self._running.items():  # the phases running now (an epoch, a validation), so far
            totals[phase] += now - begun
        self._last = {"event": event, "step": step, "time": time.time(), **totals}
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(self._last) + "\n")

    # ------------------------------------------------------------------ the split
    def report(self, step: int) -> dict[str, float]:
        """At the end of the fit: the run's wall time split into phases (seconds), the steps trained twice
        after restarts, and the productive fraction."""
        self._write("end", step)
        self.path = None  # saves after the fit (trainer.save_checkpoint by hand) are not this fit's
        attempts = split_attempts(self.earlier) + [[self._last]]
        first_start = attempts[0][0]["time"] if len(attempts) > 1 else self.started_wall
        split = dict.fromkeys(("training", "checkpoint", "validation", "data", "restart_and_lost",
                               "lost_steps"), 0.0)
        starts = [a[0] for a in attempts[1:-1]] + [{"time": self.started_wall, "step": self.start_step}]
        for lines, restart in zip(attempts[:-1], starts):
            _add_failed_attempt(split, lines, restart)
        _add_phases(split, self.totals)
        split["wall"] = max(self._last["time"] - first_start, 1e-9)
        accounted = sum(split[k] for k in ("training", "checkpoint", "validation", "data",
                                           "restart_and_lost"))
        split["other"] = max(0.0, split["wall"] - accounted)
        split["productive_fraction"] = split["training"] / split["wall"]
        self.last = split
        return split


class _Phase:
    """One phase's clock: entering notes the start (``_write`` counts a running phase so far), leaving adds
    the duration to the phase's total."""

    __slots__ = ("name", "totals", "running")

    def __init__(self, name: str, totals: dict[str, float], running: dict[str, float]) -> None:
        self.name = name
        self.totals = totals
        self.running = running

    def __enter__(self) -> None:
        self.running[self.name] = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.totals[self.name] += time.perf_counter() - self.running.pop(self.name)


def report_goodput(goodput: Goodput, step: int, staging_waited: float, say: bool, loggers: list[Any]) -> None:
    """The fit's end: one line where ``say`` (global rank 0) and ``goodput/*`` scalars to ``loggers`` (the
    logging rank's). ``staging_waited``: the checkpoint I/O's staging-wait total."""
    goodput.count_staging_waits(staging_waited)
    split = goodput.report(step)
    if say:
        log.info(summary_line(split))
    scalars = {f"goodput/{k}": float(v) for k, v in split.items()}
    for logger in loggers:
        logger.log_metrics(scalars, step)


def _add_phases(split: dict[str, float], totals: dict[str, Any]) -> None:
    """One attempt's phase totals into the split: training is the epochs' time less what ran inside them."""
    inside = totals["data"] + totals["validation"] + totals["checkpoint_in_epoch"]
    split["training"] += max(0.0, totals["epoch"] - inside)
    for phase in ("checkpoint", "validation", "data"):
        split[phase] += totals[phase]


def _add_failed_attempt(split: dict[str, float], lines: list[dict[str, Any]],
                        restart: dict[str, Any]) -> None:
    """An attempt a failure ended: up to the checkpoint the next attempt resumed from (``restart``: its
    start) counts as done; from there to the next start is restart and lost work."""
    # The last line at the resumed step: a step save deferred to its validation and the epoch's save
    # may both hold that step, and what ran between them was not redone.
    kept = next((ln for ln in reversed(lines)
                 if ln["event"] == "checkpoint" and ln["step"] == restart["step"]), None)
    if kept is None:  # it saved nothing the next attempt used: all of it is lost
        split["restart_and_lost"] += restart["time"] - lines[0]["time"]
        split["lost_steps"] += lines[-1]["step"] - lines[0]["step"]
        return
    _add_phases(split, kept)
    split["restart_and_lost"] += restart["time"] - kept["time"]
    split["lost_steps"] += max(0, lines[-1]["step"] - kept["step"])


def split_attempts(lines: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The record's lines grouped by attempt (each begins with a ``start`` line)."""
    attempts: list[list[dict[str, Any]]] = []
    for line in lines:
        if line["event"] == "start" or not attempts:
            attempts.append([])
        attempts[-1].append(line)
    return attempts


def read_record(path: str) -> list[dict[str, Any]]:
    """The record's complete lines (a line torn by a kill is dropped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for raw in fh:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(raw))
    return out


def summary_line(split: dict[str, float]) -> str:
    parts = ", ".join(f"{name.replace('_', ' ')} {split[name]:.1f}s" for name in
                      ("training", "checkpoint", "validation", "data", "restart_and_lost", "other"))
    lost = f", {int(split['lost_steps'])} steps trained twice" if split["lost_steps"] else ""
    return (f"goodput: {split['productive_fraction']:.1%} of {split['wall']:.1f}s wall time trained the "
            f"model ({parts}{lost})")
