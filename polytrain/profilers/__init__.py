"""Lightning's ``profilers`` names (``from polytrain.profilers import SimpleProfiler``, and the module
paths ``profilers.simple`` and ``profilers.profiler``, which ``lightning_paths`` answers): the profilers
``trainer.profiler`` builds, from ``trainer/observability/profiler.py``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PassThroughProfiler": "polytrain.trainer.observability.profiler",
    "SimpleProfiler": "polytrain.trainer.observability.profiler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'polytrain.profilers' has no attribute '{name}'")
