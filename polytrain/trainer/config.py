"""Configuration: structured defaults <- YAML file <- ``key=value`` overrides, validated early.

Every section is a dataclass. Unknown keys, wrong types and missing values are rejected before
any process group starts, naming the key and the valid choices. ``_target_`` entries import and
call arbitrary code: a config is code, treat it like a script you would run.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from polytrain.core.errors import ConfigError
from polytrain.core.options import check_choice, check_keys, validate_dataclass
from polytrain.strategies.registry import normalize_strategy, validate_strategy_spec

PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")
ACCELERATORS = ("auto", "cpu", "cuda", "gpu")
LAUNCHERS = ("auto", "elastic", "spawn", "fork", "none")
CLIP_ALGORITHMS = ("norm", "value")
NAN_POLICIES = ("error", "skip")
LOGGERS = ("tensorboard", "csv")
# An anchor/alias "billion laughs" document is small on disk but huge once expanded.
MAX_YAML_NODES = 100_000


@dataclass
class TrainerConfig:
    """The ``trainer:`` section; ``Trainer(**kwargs)`` takes exactly these keywords."""

    accelerator: str = "auto"
    devices: Any = "auto"  # "auto" or a positive int: processes per node (or GPUs per process for dp)
    num_nodes: int = 1
    strategy: Any = "auto"  # a name, or a mapping {name: ..., <that strategy's options>}
    precision: str = "32"
    max_epochs: int | None = None
    max_steps: int = -1
    limit_train_batches: int | None = None
    limit_val_batches: int | None = None
    limit_test_batches: int | None = None
    limit_predict_batches: int | None = None
    val_check_interval: int | None = None  # validate every N training batches as well as per epoch
    check_val_every_n_epoch: int = 1
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    log_every_n_steps: int = 50
    seed: int = 0
    deterministic: bool = False
    run_dir: str = "runs/default"
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_model_summary: bool = True
    logger: Any = True  # True (TensorBoard), False, "tensorboard", "csv", or a list of those
    callbacks: list[Any] = field(default_factory=list)
    launcher: str = "auto"
    max_restarts: int = 0
    timeout: float = 1800.0  # seconds a collective may wait before the job is ended
    resume: str | None = None  # None, "last", "auto" (last if one exists) or a path
    use_distributed_sampler: bool = True
    nan_policy: str = "error"
    detect_divergence: bool = False


@dataclass
class RunConfig:
    """A whole job: what to train (``module``), optional ``data``, and the ``trainer`` section."""

    module: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def validate_trainer_config(data: dict[str, Any]) -> TrainerConfig:
    data = dict(data)
    if "strategy" in data:
        data["strategy"] = normalize_strategy(data["strategy"])
    if "precision" in data and data["precision"] is not None:
        data["precision"] = str(data["precision"])
    cfg: TrainerConfig = validate_dataclass(TrainerConfig, data, "trainer")
    check_choice(cfg.precision, PRECISIONS, "trainer.precision")
    check_choice(cfg.accelerator, ACCELERATORS, "trainer.accelerator")
    check_choice(cfg.launcher, LAUNCHERS, "trainer.launcher")
    check_choice(cfg.gradient_clip_algorithm, CLIP_ALGORITHMS, "trainer.gradient_clip_algorithm")
    check_choice(cfg.nan_policy, NAN_POLICIES, "trainer.nan_policy")
    _check_logger_and_callbacks(cfg)  # else they would fail only inside the workers
    if not (cfg.devices == "auto" or (isinstance(cfg.devices, int) and not isinstance(cfg.devices, bool) and cfg.devices > 0)):
        raise ConfigError(f"trainer.devices={cfg.devices!r} is not valid; use 'auto' or a positive integer")
    for name in ("num_nodes", "accumulate_grad_batches", "log_every_n_steps", "check_val_every_n_epoch"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"trainer.{name}={getattr(cfg, name)} must be at least 1")
    for name in ("val_check_interval", "max_epochs"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"trainer.{name}={value} must be at least 1 (or null)")
    if cfg.gradient_clip_val is not None and cfg.gradient_clip_val <= 0:
        raise ConfigError(f"trainer.gradient_clip_val={cfg.gradient_clip_val} must be positive (or null)")
    if cfg.timeout <= 0:
        raise ConfigError(f"trainer.timeout={cfg.timeout} must be a positive number of seconds")
    cfg.strategy = validate_strategy_spec(normalize_strategy(cfg.strategy))
    return cfg


def _check_logger_and_callbacks(cfg: TrainerConfig) -> None:
    names = [cfg.logger] if isinstance(cfg.logger, str) else cfg.logger
    if not (cfg.logger is None or isinstance(cfg.logger, bool)
            or (isinstance(names, list) and all(isinstance(n, str) and n in LOGGERS for n in names))):
        raise ConfigError(f"trainer.logger={cfg.logger!r} is not valid; use true, false, one of "
                          f"{', '.join(LOGGERS)}, or a list of them")
    for i, spec in enumerate(cfg.callbacks):
        if not (isinstance(spec, dict) and isinstance(spec.get("_target_"), str)):
            raise ConfigError(f"trainer.callbacks[{i}]={spec!r} is not valid; each callback must be a mapping "
                              f"with _target_: package.Class (and its keyword arguments)")


# --------------------------------------------------------------------------- YAML loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader already refuses ``!!python/*`` tags; this one also bounds alias expansion."""


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = 1  # guards against recursive aliases
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    memo[key] = size
    return size


def parse_yaml(text: str, source: str = "<config>") -> dict[str, Any]:
    try:
        loader = _StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return {}
            size = _expanded_size(node, {})
            if size > MAX_YAML_NODES:
                raise ConfigError(
                    f"{source}: the document expands to {size} nodes through anchors/aliases "
                    f"(limit {MAX_YAML_NODES}); refusing it as a likely alias bomb"
                )
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML or uses a forbidden tag: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping (module:, trainer:, ...)")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value, e.g. trainer.max_epochs=3")
    key, raw = item.split("=", 1)
    value = parse_yaml(f"v: {raw}", f"override '{item}'")["v"] if raw.strip() else ""
    return key.strip().split("."), value


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if part == "strategy" and isinstance(child, str):
            child = {"name": child}  # trainer.strategy.X=... on a shorthand "ddp"
        if not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
    node[path[-1]] = value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Merge a YAML file and ``key=value`` overrides into one validated plain dict."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                data = parse_yaml(fh.read(), str(path))
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
        data.setdefault("config_dir", os.path.dirname(os.path.abspath(path)))
    for item in overrides or []:
        keys, value = parse_override(item)
        _set_path(data, keys, value)
    return validate_run_config(data)


def validate_run_config(data: dict[str, Any]) -> dict[str, Any]:
    data = dict(data)
    config_dir = data.pop("config_dir", None)
    check_keys(data, ["module", "data", "trainer"], "config")
    if not data.get("module") or "_target_" not in data["module"]:
        raise ConfigError("config.module must name the TrainModule to train: module: {_target_: pkg.Class, ...}")
    for section in ("module", "data"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ConfigError(f"config.{section} must be a mapping with a _target_ key")
    trainer = validate_trainer_config(data.get("trainer") or {})
    out = {"module": data["module"], "data": data.get("data"), "trainer": trainer_to_dict(trainer)}
    if config_dir:
        out["config_dir"] = config_dir
    return out


def trainer_to_dict(cfg: TrainerConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


# --------------------------------------------------------------------------- _target_


def import_target(target: str) -> Any:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"_target_ '{target}' must be a dotted path like package.module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"_target_ '{target}': cannot import module '{module_name}': {err}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"_target_ '{target}': module '{module_name}' has no attribute '{attr}'") from None


def instantiate(spec: dict[str, Any], where: str, config_dir: str | None = None) -> Any:
    """Import ``spec['_target_']`` and call it with the remaining keys. This runs code."""
    if config_dir and config_dir not in sys.path:
        sys.path.insert(0, config_dir)
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if not isinstance(target, str):
        raise ConfigError(f"{where} needs a _target_: package.Class entry")
    kwargs = {k: instantiate(v, f"{where}.{k}", config_dir) if isinstance(v, dict) and "_target_" in v else v
              for k, v in spec.items()}
    factory = import_target(target)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{where}: {target} does not accept {sorted(kwargs)}: {err}") from None
    except ValueError:
        pass  # no introspectable signature (some builtins): let the call itself decide
    return factory(**kwargs)
