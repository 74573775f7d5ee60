"""Strategies by name. Each strategy registers itself next to its class::

    @register
    class MyStrategy(Strategy):
        name = "mine"
        Options = MyOptions

so a new strategy is one new file in ``polytrain/strategies/``, and its options dataclass one entry
of ``strategies/options.py`` (read without torch, so a config is checked before torch loads).
Modules are imported only when a name is asked for: ``polytrain.strategies.<name>`` first (one
module for the usual names), then every module of the package (a strategy whose file is named
differently, or the full list for an error message). Lightning's aliases, such as
``ddp_find_unused_parameters_true``, are listed in ``strategies/options.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch

from polytrain.core.errors import ConfigError
from polytrain.core.option_checks import suggest, validate_dataclass
from polytrain.core.precision import Precision
from polytrain.strategies.base import Strategy
from polytrain.strategies.options import LIGHTNING_NAMES, check_strategy_spec, spec_mapping, wants_plan
from polytrain.strategies.plan_spec import split_plan, with_plan

S = TypeVar("S", bound=type)
PACKAGE = "polytrain.strategies"

_CLASSES: dict[str, type] = {}
_ALIASES: dict[str, dict[str, Any]] = dict(LIGHTNING_NAMES)  # alias -> {"name": strategy, **options}
_discovered = False


def register(cls: S) -> S:
    """Class decorator: make ``cls`` (with its ``name``, ``Options`` and ``aliases``) available by name."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute name = '<strategy name>' to be registered")
    if name in _CLASSES and _CLASSES[name] is not cls:
        raise ValueError(f"strategy name '{name}' is registered twice: {_CLASSES[name].__qualname__} and "
                         f"{cls.__qualname__}")
    _CLASSES[name] = cls
    for alias, options in getattr(cls, "aliases", {}).items():
        _ALIASES[alias] = {"name": name, **options}
    return cls


def _discover() -> None:
    """Import every module of the package once, so every strategy has registered itself."""
    global _discovered
    if _discovered:
        return
    package = importlib.import_module(PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        _import(f"{PACKAGE}.{info.name}")
    _discovered = True


def _import(module_name: str) -> None:
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise


def _lookup(name: str) -> type | None:
    if name not in _CLASSES and importlib.util.find_spec(f"{PACKAGE}.{name}") is not None:
        _import(f"{PACKAGE}.{name}")
    if name not in _CLASSES:
        _discover()
    return _CLASSES.get(name)


class _Registered(Mapping):
    """Every registered name -> its class (iterating discovers them all)."""

    def __getitem__(self, name: str) -> type:
        cls = _lookup(name)
        if cls is None:
            raise KeyError(name)
        return cls

    def __iter__(self) -> Iterator[str]:
        _discover()
        return iter(sorted(_CLASSES, key=_order))

    def __len__(self) -> int:
        _discover()
        return len(_CLASSES)


_PREFERRED = ("single", "dp", "ddp", "fsdp", "model_parallel", "pipeline", "parallel")


def _order(name: str) -> tuple[int, str]:
    return (_PREFERRED.index(name) if name in _PREFERRED else len(_PREFERRED), name)


_STRATEGIES: Mapping[str, type] = _Registered()


def available_strategies() -> list[str]:
    return ["auto", *_STRATEGIES]


def strategy_class(name: str) -> type:
    cls = _lookup(name)
    if cls is None:
        raise ConfigError(f"unknown strategy '{name}'{suggest(name, available_strategies(), n=2)}")
    return cls


def lightning_names() -> dict[str, dict[str, Any]]:
    """Aliases (Lightning's strategy strings) -> the strategy mapping they stand for."""
    _discover()
    return dict(_ALIASES)


def normalize_strategy(value: Any) -> dict[str, Any]:
    """``"ddp"`` and ``{"name": "ddp", ...}`` both become the mapping form."""
    return spec_mapping(value, _ALIASES, names=_STRATEGIES)


class _RegisteredOptions(Mapping):
    """Every registered name -> its ``Options`` class, for ``options.check_strategy_spec``."""

    def __getitem__(self, name: str) -> type:
        return _STRATEGIES[name].Options

    def __iter__(self) -> Iterator[str]:
        return iter(_STRATEGIES)

    def __len__(self) -> int:
        return len(_STRATEGIES)


def validate_strategy_spec(spec: Any, accelerator: str | None = None) -> Any:
    """Check the name and the options of ``{name: ..., **options}`` (``options.check_strategy_spec``, over
    every registered class); a Strategy instance passes. With ``accelerator``, also what the strategy can
    run there (``check_options``: context parallel on CPU)."""
    if not isinstance(spec, dict):
        if isinstance(spec, Strategy):
            return spec
        raise ConfigError(f"trainer.strategy must be a name or a mapping, got {type(spec).__name__}")
    options = dict(spec)
    name = options.pop("name", "auto")
    if wants_plan(name, options):
        # plan: true / 'auto' degrees (plan_spec.py): checked with the 'auto' degrees at their defaults
        option_names = [f.name for f in dataclasses.fields(strategy_class(name).Options)]
        plain, request = split_plan(options, option_names)
        return with_plan(validate_strategy_spec({"name": name, **plain}, accelerator), request)
    name, parsed = check_strategy_spec(spec, _RegisteredOptions())
    if name == "auto":
        return {"name": "auto"}
    if accelerator is not None:
        strategy_class(name).check_options(parsed, "cuda" if accelerator in ("cuda", "gpu") or (
            accelerator == "auto" and torch.cuda.is_available()) else "cpu")
    return {"name": name, **dataclasses.asdict(parsed)}


def resolve_strategy_name(name: str, processes: int) -> str:
    if name != "auto":
        return name
    return "ddp" if processes > 1 else "single"


def build_strategy(spec: dict[str, Any], *, precision: str | Precision, **kwargs: Any) -> Any:
    """The strategy ``spec`` names, with its collaborators built once: the ``Precision`` object here, and
    (strategies with a device mesh) the ``ParallelDims`` of the job in the class's ``build``, which makes
    the instance (a class may hand some options to another one); ``kwargs`` are the rest of the
    constructor's keywords (accelerator, devices, num_nodes, timeout, env, compile and checkpointing
    options).

    ``spec`` is what ``validate_strategy_spec`` returned (the Trainer's config holds it): its values were
    type-checked there, so here they only fill the options dataclass (its ``__post_init__`` checks run
    again)."""
    options = dict(spec)
    cls = strategy_class(options.pop("name"))
    known = {f.name for f in dataclasses.fields(cls.Options)}
    if options.keys() <= known:
        parsed = cls.Options(**options)
    else:  # the error names the valid keys
        parsed = validate_dataclass(cls.Options, options, f"trainer.strategy ({cls.name})")
    if not isinstance(precision, Precision):
        precision = Precision.for_accelerator(precision, kwargs["accelerator"])
    return cls.build(parsed, precision=precision, **kwargs)
