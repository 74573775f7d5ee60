"""polytrain: one Trainer, many parallelisms.

Heavy imports (torch, the strategies, the callbacks) happen on first attribute access so that
``import polytrain`` stays cheap for the CLI and for worker start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polytrain.core.version import __version__
from polytrain.lightning_paths import install as _install_lightning_paths

_EXPORTS = {
    "Trainer": "polytrain.trainer.trainer",
    "TrainModule": "polytrain.trainer.api.module",
    "DataModule": "polytrain.trainer.api.datamodule",
    "Callback": "polytrain.callbacks.base",
    "seed_everything": "polytrain.core.rng",
    "load_config": "polytrain.trainer.configuration.config",
    "connect": "polytrain.strategies.connect",
    # Lightning's names, so a Lightning module runs with only its import changed.
    "LightningModule": "polytrain.trainer.api.module",
    "LightningDataModule": "polytrain.trainer.api.datamodule",
}

__all__ = ["Callback", "DataModule", "LightningDataModule", "LightningModule", "TrainModule", "Trainer",
           "__version__", "connect", "load_config", "seed_everything"]

if TYPE_CHECKING:
    from polytrain.callbacks.base import Callback
    from polytrain.core.rng import seed_everything
    from polytrain.strategies.connect import connect
    from polytrain.trainer.api.datamodule import DataModule, LightningDataModule
    from polytrain.trainer.api.module import LightningModule, TrainModule
    from polytrain.trainer.configuration.config import load_config
    from polytrain.trainer.trainer import Trainer


_install_lightning_paths()  # `from polytrain.core.module import LightningModule`, Lightning's deep paths

# `pl.callbacks.ModelCheckpoint`, as Lightning code writes it
_SUBPACKAGES = ("callbacks", "loggers", "utilities")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"polytrain.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'polytrain' has no attribute '{name}'")
