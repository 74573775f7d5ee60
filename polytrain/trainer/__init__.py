"""Layer 3: the loop. ``from polytrain.trainer import Trainer`` works as Lightning's
``from lightning.pytorch.trainer import Trainer`` (loaded on first use: importing a submodule of this
package stays cheap)."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        return importlib.import_module("polytrain.trainer.trainer").Trainer
    raise AttributeError(f"module 'polytrain.trainer' has no attribute '{name}'")
