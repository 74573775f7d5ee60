"""Validating option mappings against dataclasses: unknown keys, wrong types and missing values are
``ConfigError`` s that name the key and list the valid choices. Used by the config loader and by
every strategy's options."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from polytrain.core.errors import ConfigError


def suggest(key: str, valid: list[str], n: int = 1) -> str:
    """`` (did you mean 'x'?); valid: ...`` (up to ``n`` guesses: a short name like ``dpp`` is near
    several)."""
    close = difflib.get_close_matches(key, valid, n=n)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return f"{hint}; valid: {', '.join(valid)}"


def check_keys(data: dict[str, Any], valid: list[str], where: str) -> None:
    unknown = [k for k in data if k not in valid]
    if unknown:
        key = unknown[0]
        raise ConfigError(f"{where} has no key '{key}'{suggest(key, valid)}")


def check_choice(value: Any, choices: tuple[str, ...], where: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), list(choices), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{where}={value!r} is not valid{hint}; choose one of: {', '.join(choices)}")


def _holds_a_container(annotation: Any) -> bool:
    """Whether ``annotation`` is a union of two or more types (``None`` aside: OmegaConf takes an optional
    list) with a list or mapping among them."""
    if typing.get_origin(annotation) is not typing.Union and not isinstance(annotation, types.UnionType):
        return False
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    containers = [a for a in members if typing.get_origin(a) in (list, dict) or a in (list, dict)]
    return len(members) > 1 and bool(containers)


def _keep_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=f.default)
    return dataclasses.field()


@functools.cache
def _omegaconf_schema(cls: type) -> type:
    """``cls`` in a form every supported OmegaConf accepts. A union with a container member
    (``list[int] | list[str]``) is refused by OmegaConf 2.3 and passed through unchecked by 2.4, so
    such a field is ``Any`` in the schema, and ``validate_dataclass`` checks it itself."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    if not any(_holds_a_container(hints[f.name]) for f in fields):
        return cls
    return dataclasses.make_dataclass(
        cls.__name__,
        [(f.name, Any if _holds_a_container(hints[f.name]) else hints[f.name], _keep_default(f))
         for f in fields],
    )


def validate_dataclass(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build ``cls`` from ``data``, rejecting unknown keys and values of the wrong type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}: {data!r}")
    valid = [f.name for f in dataclasses.fields(cls)]
    check_keys(data, valid, where)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(_omegaconf_schema(cls)), OmegaConf.create(data))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        name = str(key).split(".")[0].split("[")[0]
        declared = {f.name: f for f in dataclasses.fields(cls)}.get(name)
        expects = declared.metadata.get("expects") if declared is not None else None
        if expects is not None and name in data:  # a field that states its rule in words: those words
            raise ConfigError(f"{where}.{name} should be {expects}, got {data[name]!r} "
                              f"({type(data[name]).__name__}; expected {declared.type})") from None
        expected = declared.type if declared is not None else "?"
        raise ConfigError(
            f"{where}.{key}: {str(getattr(err, 'msg', err)).splitlines()[0]} (expected {expected})"
        ) from None
    except (TypeError, ValueError) as err:  # OmegaConf's own: a mapping where a list belongs, and the like
        nested = [f"{where}.{k} ({type(v).__name__})" for k, v in data.items() if isinstance(v, (dict, list))]
        raise ConfigError(f"{where}: {str(err).splitlines()[0]}: a mapping where a list belongs, or the "
                          f"reverse, in one of {', '.join(nested) or 'its keys'}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"{where} is missing required value(s): {', '.join(missing)}")
    obj = OmegaConf.to_object(merged)
    if not isinstance(obj, cls):  # built from the loosened schema: build the real one (its checks run)
        obj = cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})
    for f in dataclasses.fields(cls):
        # OmegaConf lets a mapping or list through as an element of a list[str] field.
        value = getattr(obj, f.name)
        if str(f.type).startswith("list[str]") and isinstance(value, list):
            for i, item in enumerate(value):
                if not isinstance(item, str):
                    raise ConfigError(f"{where}.{f.name}[{i}]={item!r} is not valid (expected {f.type})")
        # A union of list types passes OmegaConf unchecked: every element one of them, all alike.
        if str(f.type).startswith("list[int] | list[str]") and value is not None:
            kinds = {type(item) for item in value} if isinstance(value, list) else {type(value)}
            if not isinstance(value, list) or not (kinds <= {int} or kinds <= {str}):
                raise ConfigError(f"{where}.{f.name}={value!r} is not valid (expected {f.type}: all child "
                                  f"indices or all module paths)")
    return obj
