"""Lightning's ``loggers`` names (``from polytrain.loggers import TensorBoardLogger``, or
``pl.loggers.CSVLogger``): the same classes as ``polytrain.callbacks``' loggers, with Lightning's
constructor arguments, ``experiment``, ``log_dir``, ``version``, ``name`` and ``save_dir``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Logger": "polytrain.callbacks.loggers",
    "DummyExperiment": "polytrain.callbacks.loggers",
    "rank_zero_experiment": "polytrain.callbacks.loggers",
    "TensorBoardLogger": "polytrain.callbacks.tensorboard_logger",
    "CSVLogger": "polytrain.callbacks.csv_logger",
    "MLFlowLogger": "polytrain.callbacks.experiment_loggers",
    "WandbLogger": "polytrain.callbacks.experiment_loggers",
}
_SUBMODULES = ("logger", "tensorboard", "csv_logs", "mlflow", "wandb")  # Lightning's module paths
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"polytrain.loggers.{name}")
    raise AttributeError(f"module 'polytrain.loggers' has no attribute '{name}'")
