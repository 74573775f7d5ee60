"""Lightning's ``profilers`` names (``from polytrain.profilers import SimpleProfiler``, and the module
paths ``profilers.simple`` and ``profilers.profiler``, which ``lightning_paths`` answers): the profilers
``trainer.profiler`` builds, from ``trainer/observability/profiler.py``."""

from __future__ import annotations

from polytrain.core.exports import lazy_exports

_EXPORTS = {
    "PassThroughProfiler": "polytrain.trainer.observability.profiler",
    "SimpleProfiler": "polytrain.trainer.observability.profiler",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
