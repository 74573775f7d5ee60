"""``CompileTime``: one log line saying how long ``torch.compile`` took, after the second training
batch (or at fit end when there was only one). The Trainer adds it when ``trainer.compile`` is on.

torch compiles lazily, in the first forward and backward, so the first training batch carries the
compilation; the second runs the compiled code. The estimate is their difference; dynamo's own
count of compile seconds is added where this torch records it (2.15 does, 2.11 does not).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from polytrain.callbacks.base import Callback

log = logging.getLogger("polytrain")


def dynamo_compile_seconds() -> float | None:
    """Seconds dynamo/inductor spent compiling in this process so far, or None where not recorded."""
    utils = sys.modules.get("torch._dynamo.utils")  # loaded by torch.compile; never imported here
    try:
        seconds = (float(utils.calculate_time_spent().get("total_wall_time", 0.0)) if utils is not None
                   else 0.0)
    except Exception:  # noqa: BLE001 - a private torch API: a figure is nice to have, never worth a crash
        return None
    return seconds or None


class CompileTime(Callback):
    def __init__(self) -> None:
        self.batch_seconds: list[float] = []
        self._t0 = 0.0
        self._dynamo_base: float | None = None
        self._done = False
        self.message: str | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._dynamo_base = dynamo_compile_seconds() or 0.0  # what the sanity check compiled is not counted

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if not self._done:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._done:
            return
        self.batch_seconds.append(time.perf_counter() - self._t0)
        if len(self.batch_seconds) == 2:
            self._report(trainer)

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        if not self._done and self.batch_seconds:
            self._report(trainer)

    def _report(self, trainer: Any) -> None:
        self._done = True
        first = self.batch_seconds[0]
        parts = [f"first training batch {first:.2f} s"]
        if len(self.batch_seconds) > 1:
            parts.append(f"the next {self.batch_seconds[1]:.3f} s")
            estimate = f"about {max(first - self.batch_seconds[1], 0.0):.1f} s compiling"
        else:
            estimate = "compiling included"
        total = dynamo_compile_seconds()
        if total is not None and self._dynamo_base is not None:
            parts.append(f"dynamo counts {total - self._dynamo_base:.1f} s")
        self.message = f"torch.compile: {estimate} ({', '.join(parts)})"
        if trainer.is_global_zero:
            log.info(self.message)
