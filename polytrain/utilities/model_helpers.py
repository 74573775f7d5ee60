"""``polytrain.utilities.model_helpers``: where Lightning keeps ``is_overridden``."""

from __future__ import annotations

from typing import Any

from polytrain.callbacks.base import Callback
from polytrain.trainer.api.datamodule import DataModule
from polytrain.trainer.api.hooks import is_overridden as _is_overridden
from polytrain.trainer.api.module import TrainModule


def is_overridden(method_name: str, instance: object | None = None, parent: type | None = None) -> bool:
    """Whether ``instance``'s class defines ``method_name`` itself rather than inheriting it from ``parent``
    (default: the TrainModule base class; a DataModule or Callback is compared with its own base)."""
    if instance is None:
        return False
    if parent is None:
        parent = _base_of(instance)
        if parent is None:
            raise ValueError("is_overridden: pass parent= (the class whose method counts as not overridden)")
    return _is_overridden(instance, method_name, parent)


def _base_of(instance: Any) -> type | None:
    for base in (TrainModule, DataModule, Callback):
        if isinstance(instance, base):
            return base
    return None
