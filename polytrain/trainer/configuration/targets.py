"""``_target_`` entries checked without being called: the class a config names is imported and the
keyword arguments it is given are matched against its signature, so a typo in ``module:``,
``data:`` or a callback fails in the launching process, in one line, before any worker starts.

Importing runs the module's top-level code (configs are code); nothing is constructed here, since
building a module or a data set may be expensive or touch the data.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
import sys
from typing import Any

from polytrain.core.errors import ConfigError

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _sibling_modules(missing: str) -> list[str]:
    """The modules next to ``missing`` (a dotted module name that did not import), for a suggestion."""
    parent_name, _, _ = missing.rpartition(".")
    if not parent_name:
        return [info.name for info in pkgutil.iter_modules()]  # the top-level modules on sys.path
    try:
        parent = importlib.import_module(parent_name)
    except ImportError:
        return []
    return [info.name for info in pkgutil.iter_modules(getattr(parent, "__path__", []))]


def search_from(config_dir: str | None) -> None:
    """Where ``_target_`` modules are imported from: the config's own directory first (a module next to the
    config), then the working directory (as ``python -m`` would; the ``polytrain`` command alone would
    not), then ``sys.path`` (installed packages, ``PYTHONPATH``). The same in the launcher and the workers."""
    for directory in (os.getcwd(), config_dir):  # inserted in front: the config's directory ends up first
        if directory and directory not in sys.path:
            sys.path.insert(0, directory)


def import_target(target: str, where: str = "_target_") -> Any:
    """The object ``target`` (``package.module.Attr``) names; a ``ConfigError`` naming the module or the
    attribute that failed otherwise."""
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"{where}: _target_ '{target}' must be a dotted path like package.module.Class")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or module_name
        hint = _did_you_mean(missing.rpartition(".")[2], _sibling_modules(missing))
        raise ConfigError(f"{where}: _target_ '{target}': cannot import module '{module_name}' (no module "
                          f"named '{missing}'{hint}); it is looked for next to the config, in the working "
                          f"directory ({os.getcwd()}) and on sys.path (PYTHONPATH)") from None
    except ImportError as err:
        raise ConfigError(f"{where}: _target_ '{target}': cannot import module '{module_name}': "
                          f"{err}") from None
    if not hasattr(module, attr):
        raise missing_attribute(where, target, {*dir(module), *getattr(module, "__all__", ())})
    return getattr(module, attr)


def missing_attribute(where: str, target: str, names: set[str]) -> ConfigError:
    """The error for a ``_target_`` whose module has no such attribute; ``names``: what the module has."""
    module_name, _, attr = target.rpartition(".")
    public = sorted(n for n in names if not n.startswith("_"))
    return ConfigError(f"{where}: _target_ '{target}': module '{module_name}' has no attribute '{attr}'"
                       f"{_did_you_mean(attr, public)}")


def check_arguments(factory: Any, kwargs: dict[str, Any], where: str, target: str) -> None:
    """Raise a ``ConfigError`` if ``factory(**kwargs)`` would fail on its signature: an unexpected keyword
    (with the closest valid one), or a required argument not given. A ``**kwargs`` accepts any name."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no introspectable signature (some builtins): the call itself decides
    check_signature(signature, kwargs, where, target)


def check_signature(signature: inspect.Signature, kwargs: dict[str, Any], where: str, target: str) -> None:
    """``check_arguments`` on a signature already at hand (``target_source`` reads it from the source)."""
    params = list(signature.parameters.values())
    valid = [p.name for p in params if p.kind in _NAMED]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    unknown = [] if takes_any else [k for k in kwargs if k not in valid]
    listing = f"Valid: {', '.join(valid)}" if valid else "It takes no keyword arguments"
    if unknown:
        key = unknown[0]
        more = f" (and {', '.join(repr(k) for k in unknown[1:])})" if unknown[1:] else ""
        hint = _did_you_mean(key, valid)
        raise ConfigError(f"{where}: {target}() got an unexpected keyword '{key}'{more}{hint or '.'} "
                          f"{listing}")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in kwargs
               and p.kind in (*_NAMED, inspect.Parameter.POSITIONAL_ONLY)]
    if missing:
        names = ", ".join(f"'{m}'" for m in missing)
        raise ConfigError(f"{where}: {target}() is missing required argument(s) {names}: give them under "
                          f"{where}:. {listing}")


def check_spec(spec: Any, where: str, config_dir: str | None = None) -> None:
    """Import ``spec['_target_']`` and check ``spec``'s other keys against its signature (nested
    ``_target_`` mappings too), without calling anything."""
    if not isinstance(spec, dict) or not isinstance(spec.get("_target_"), str):
        raise ConfigError(f"{where} must be a mapping with _target_: package.Class (and its keyword "
                          f"arguments)")
    search_from(config_dir)  # what instantiate does in the workers: targets resolve the same way
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    for key, value in kwargs.items():
        if isinstance(value, dict) and "_target_" in value:
            check_spec(value, f"{where}.{key}", config_dir)
    check_arguments(import_target(spec["_target_"], where), kwargs, where, spec["_target_"])


def check_run_targets(config: dict[str, Any]) -> dict[str, Any]:
    """Check every ``_target_`` of a whole config (``module``, ``data`` or ``datamodule``,
    ``trainer.callbacks``); returns the config."""
    config_dir = config.get("config_dir")
    check_spec(config["module"], "module", config_dir)
    for section in ("data", "datamodule"):
        if config.get(section) is not None:
            check_spec(config[section], section, config_dir)
    for i, spec in enumerate((config.get("trainer") or {}).get("callbacks") or []):
        if isinstance(spec, dict):  # callback objects (Trainer.from_config with objects) are already built
            check_spec(spec, f"trainer.callbacks[{i}]", config_dir)
    return config
