"""Names a package hands out without importing their modules until first use (PEP 562's module
``__getattr__``): ``import polytrain.callbacks`` stays cheap, and the config checks, which import modules
of ``polytrain.strategies`` before torch loads, never pull in torch through a package's ``__init__``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: each name in ``exports`` (name -> module holding it) is read
    from its module when first asked for."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
