"""Lightning's module paths, answered by polytrain's modules.

A Lightning project imports from deep paths as well as from the top (``from lightning.pytorch.core.module
import LightningModule``, ``from lightning.pytorch.callbacks.callback import Callback``). With the import
renamed, those paths name the polytrain module that holds the same thing: importing one gives that very
module object, so a class has one identity whichever path found it. polytrain's own package layout
stays as it is; this table is the only place the two meet.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

LIGHTNING_PATHS = {
    "polytrain.core.module": "polytrain.trainer.api.module",
    "polytrain.core.datamodule": "polytrain.trainer.api.datamodule",
    "polytrain.core.mixins": "polytrain.trainer.api.hparams",
    "polytrain.core.saving": "polytrain.trainer.api.saving",
    "polytrain.callbacks.callback": "polytrain.callbacks.base",
    "polytrain.profilers.simple": "polytrain.trainer.observability.profiler",
    "polytrain.profilers.profiler": "polytrain.trainer.observability.profiler",
}


class _ModuleUnderAnotherName(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its own name."""


class LightningPathFinder(importlib.abc.MetaPathFinder):
    """Finds the names in ``LIGHTNING_PATHS`` only; every other import goes to the finders before it."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in LIGHTNING_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, _ModuleUnderAnotherName(LIGHTNING_PATHS[fullname]))


def install() -> None:
    if not any(isinstance(finder, LightningPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(LightningPathFinder())
