"""Strategies: one small class per parallelism, plus launch and cluster-environment code.

The classes are importable from here as Lightning's are from ``lightning.pytorch.strategies``
(``from polytrain.strategies import DDPStrategy``), loaded on first use: the config checks import
modules of this package without torch.
"""

from __future__ import annotations

from polytrain.core.exports import lazy_exports

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

__getattr__ = lazy_exports(__name__, _CLASSES)
