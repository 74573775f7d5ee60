"""``ModelCheckpoint(train_time_interval=...)`` and ``val_check_interval`` as a duration: when a
time-based checkpoint or validation is due.

Clocks differ between ranks, so one clock decides: global rank 0's, broadcast to every rank (as
Lightning does). Lightning broadcasts at every batch; a broadcast is a host sync, and the loop adds none
per step (docs/performance.md). So the ranks meet only at *check steps*, agreed at the previous check: rank 0
sends the decision together with the next check step, which it picks from its measured step rate so
that the next check lands after half the remaining time (at least 1/50 of the interval). Each interval
then costs a handful of broadcasts (about log2(25) + 2), and a save comes at most ~1/50 of the
interval late while the step rate holds. Every rank reaches every check step (the same step numbers
everywhere), so the broadcast is always matched.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

RESOLUTION = 50  # checks are at most interval / RESOLUTION apart near the deadline


class TimeTrigger:
    """Answers "is it due at this step?" identically on every rank (an optimizer step for a checkpoint,
    a training batch for a validation)."""

    def __init__(self, interval: timedelta) -> None:
        if interval.total_seconds() <= 0:
            raise ValueError(f"ModelCheckpoint train_time_interval={interval}; it must be positive, e.g. "
                             f"timedelta(minutes=30)")
        self.interval = interval.total_seconds()
        self.next_check = 0
        self._since = self._checked_at = time.monotonic()
        self._checked_step = 0
        self.checks = 0  # how many broadcasts were spent (tests read it)

    def start(self, step: int) -> None:
        """At fit start (after a resume): the interval runs from now; the first check is the next step."""
        self._since = self._checked_at = time.monotonic()
        self._checked_step, self.next_check = step, step + 1

    def restart(self) -> None:
        """The interval counts from now (another trigger saved, as Lightning's restarts after any save; a
        validation ended, for ``val_check_interval`` as a duration)."""
        self._since = time.monotonic()

    def due(self, step: int, strategy: Any) -> bool:
        """Every rank calls it after each optimizer step; only at a check step does it communicate."""
        if step < self.next_check:
            return False
        decision = self._decide(step) if strategy.is_global_zero else None
        due, self.next_check = strategy.broadcast(decision)
        self.checks += 1
        if due:
            self._since = time.monotonic()
        return due

    def _decide(self, step: int) -> tuple[bool, int]:
        now = time.monotonic()
        rate = (step - self._checked_step) / max(now - self._checked_at, 1e-9)  # steps per second
        self._checked_at, self._checked_step = now, step
        elapsed = now - self._since
        due = elapsed >= self.interval
        remaining = self.interval if due else self.interval - elapsed
        wait = max(remaining / 2, self.interval / RESOLUTION)
        return due, step + max(1, int(rate * wait))
