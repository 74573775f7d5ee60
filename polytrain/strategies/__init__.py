"""Strategies: one small class per parallelism, plus launch and cluster-environment code.

The classes are importable from here as Lightning's are from ``lightning.pytorch.strategies``
(``from polytrain.strategies import DDPStrategy``), loaded on first use: the config checks import
modules of this package without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_CLASSES = {
    "Strategy": "polytrain.strategies.base",
    "ParallelStrategy": "polytrain.strategies.composed",
    "SingleDeviceStrategy": "polytrain.strategies.single",
    "DDPStrategy": "polytrain.strategies.ddp",
    "FSDPStrategy": "polytrain.strategies.fsdp",
    "DataParallelStrategy": "polytrain.strategies.dp",
    "ModelParallelStrategy": "polytrain.strategies.model_parallel",
    "PipelineStrategy": "polytrain.strategies.pipeline",
}

__all__ = sorted(_CLASSES)


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        value = getattr(importlib.import_module(_CLASSES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'polytrain.strategies' has no attribute '{name}'")
