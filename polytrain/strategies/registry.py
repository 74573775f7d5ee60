"""Strategies by name. Importing a strategy's module is deferred until it is asked for."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from polytrain.core.errors import ConfigError
from polytrain.core.options import validate_dataclass
from polytrain.strategies.base import Strategy

_STRATEGIES: dict[str, str] = {
    "single": "polytrain.strategies.single:SingleDeviceStrategy",
    "dp": "polytrain.strategies.dp:DataParallelStrategy",
    "ddp": "polytrain.strategies.ddp:DDPStrategy",
    "fsdp": "polytrain.strategies.fsdp:FSDPStrategy",
    "model_parallel": "polytrain.strategies.model_parallel:ModelParallelStrategy",
    "pipeline": "polytrain.strategies.pipeline:PipelineStrategy",
}


def available_strategies() -> list[str]:
    return ["auto", *_STRATEGIES]


def strategy_class(name: str) -> type:
    if name not in _STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}'; valid: {', '.join(available_strategies())}")
    module_name, _, cls_name = _STRATEGIES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            raise ConfigError(f"strategy '{name}' is not available in this build of polytrain") from None
        raise
    return getattr(module, cls_name)


# Lightning's strategy strings that are a polytrain strategy with options.
LIGHTNING_NAMES: dict[str, dict[str, Any]] = {
    "ddp_find_unused_parameters_true": {"name": "ddp", "find_unused_parameters": True},
    "ddp_find_unused_parameters_false": {"name": "ddp", "find_unused_parameters": False},
    "single_device": {"name": "single"},
}


def normalize_strategy(value: Any) -> dict[str, Any]:
    """``"ddp"`` and ``{"name": "ddp", ...}`` both become the mapping form."""
    if value is None:
        return {"name": "auto"}
    if isinstance(value, str):
        return dict(LIGHTNING_NAMES.get(value, {"name": value}))
    if isinstance(value, dict):
        return {"name": "auto", **value}
    if hasattr(value, "items"):
        return {"name": "auto", **dict(value.items())}
    return value  # a Strategy instance passed to Trainer(strategy=...)


def validate_strategy_spec(spec: Any) -> Any:
    """Check the name and the options of ``{name: ..., **options}``; a Strategy instance passes."""
    if not isinstance(spec, dict):
        if isinstance(spec, Strategy):
            return spec
        raise ConfigError(f"trainer.strategy must be a name or a mapping, got {type(spec).__name__}")
    options = dict(spec)
    name = options.pop("name", "auto")
    if name == "auto":
        if options:
            raise ConfigError(f"strategy 'auto' takes no options (got {', '.join(options)}); name a strategy")
        return {"name": "auto"}
    cls = strategy_class(name)
    valid = [f.name for f in dataclasses.fields(cls.Options)]
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ConfigError(f"strategy '{name}' has no option '{unknown[0]}'; valid: {', '.join(valid) or '(none)'}")
    parsed = validate_dataclass(cls.Options, options, f"trainer.strategy ({name})")
    return {"name": name, **dataclasses.asdict(parsed)}


def resolve_strategy_name(name: str, processes: int) -> str:
    if name != "auto":
        return name
    return "ddp" if processes > 1 else "single"


def build_strategy(spec: dict[str, Any], **kwargs: Any) -> Any:
    options = dict(spec)
    cls = strategy_class(options.pop("name"))
    return cls(validate_dataclass(cls.Options, options, f"trainer.strategy ({cls.name})"), **kwargs)
