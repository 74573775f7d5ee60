"""The config file, read and checked without torch: YAML (a safe loader, alias expansion bounded),
``key=value`` overrides, the ``trainer:`` section's dataclass, and every check that needs nothing heavy:
the sections, each trainer key, its type and its choices, the strategy's options, and the ``_target_``
arguments their source settles. ``polytrain`` runs this before it imports torch, so a typo there answers
at once; ``config.py`` then checks what needs torch: ``torch.compile``'s signature, the profilers and the
``_target_`` classes imported (which the source reading left undecided).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from polytrain.core.errors import ConfigError
from polytrain.core.nodes import node_range
from polytrain.core.option_checks import check_choice, check_keys, validate_dataclass
from polytrain.parallel.choices import check_context_parallel_device
from polytrain.strategies.options import OPTIONS, check_strategy_spec, spec_mapping, wants_plan
from polytrain.strategies.plan_spec import split_plan
from polytrain.trainer.configuration.target_source import check_targets_from_source

PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")
PRECISION_ALIASES = {"32-true": "32", "16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's other spellings
ACCELERATORS = ("auto", "cpu", "cuda", "gpu")
LAUNCHERS = ("auto", "elastic", "spawn", "fork", "none")
CLIP_ALGORITHMS = ("norm", "value")
NAN_POLICIES = ("error", "skip")
LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")  # mlflow/wandb: optional extras, polytrain[mlflow|wandb]
# An anchor/alias "billion laughs" document is small on disk but huge once expanded.
MAX_YAML_NODES = 100_000


@dataclass
class TrainerConfig:
    """The ``trainer:`` section; ``Trainer(**kwargs)`` takes exactly these keywords. Names and meanings
    are Lightning's where it has the option (docs/config.md lists them all)."""

    accelerator: str = "auto"
    # "auto", a positive int (processes per node; GPUs for dp), or a list of GPU indices
    devices: Any = "auto"
    num_nodes: Any = 1  # nodes in the job, or a "MIN:MAX" range for elastic training (torchrun's --nnodes)
    strategy: Any = "auto"  # a name, or a mapping {name: ..., <that strategy's options>}
    precision: str = "32"
    max_epochs: int | None = None
    # a stop request (early stopping) waits until this many epochs ran
    min_epochs: int | None = field(default=None, metadata={"expects": "an int >= 0 or null"})
    max_steps: int = -1
    min_steps: int | None = field(default=None, metadata={"expects": "an int >= 0 or null"})
    max_time: Any = None  # "DD:HH:MM:SS" or {"hours": 2, ...}: stop cleanly (and checkpoint) after that long
    limit_train_batches: Any = None  # a number of batches, or a fraction of the epoch (0.25)
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    limit_predict_batches: Any = None
    overfit_batches: Any = 0  # train (in order) and validate on this many batches, or fraction
    val_check_interval: Any = None  # validate every N training batches, or fraction of an epoch
    check_val_every_n_epoch: int | None = 1  # None: val_check_interval counts batches across epochs
    num_sanity_val_steps: int = 2  # validation batches before training (-1: all, 0: none)
    fast_dev_run: Any = False  # True or N: N batches of every loop, one epoch, no checkpoints or loggers
    reload_dataloaders_every_n_epochs: int = field(default=0, metadata={"expects": "an int >= 0"})
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None  # "norm" (the default when None) or "value"
    log_every_n_steps: int = 50
    seed: int | None = None  # None: polytrain leaves your RNG alone (docs/reproducibility.md)
    deterministic: Any = False  # true, false, or "warn" (ops without a deterministic kernel warn)
    benchmark: bool | None = None  # torch.backends.cudnn.benchmark (None: leave it as it is)
    detect_anomaly: bool = False
    sync_batchnorm: bool = False  # cross-process BatchNorm, for strategies that have the option
    run_dir: str = "runs/default"
    default_root_dir: str | None = None  # Lightning's name for run_dir
    # Each run writes into <run_dir>/version_<n> (the next free n); a number or a name picks the directory
    version: Any = None
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_model_summary: bool = True
    logger: Any = True  # True (TensorBoard + CSV), False, "tensorboard", "csv", ..., or a list of those
    callbacks: list[Any] = field(default_factory=list)
    profiler: Any = None  # None, "simple", "torch", or {name: torch, ...} (docs/profiler.md)
    # true, or a mapping of torch.compile keywords (+ modules: [Block]) (docs/compile.md)
    compile: Any = False
    # true, block class name(s), or {modules: [Block], every: 1, mode: full/op}
    activation_checkpointing: Any = False
    # true, or {recipe: tensorwise/rowwise/rowwise_with_gw_hp, filter_fqns: [...], convert_head: false}:
    # torchao's float8 Linear layers (docs/precision.md)
    float8: Any = False
    # a local Hugging Face model directory (config.json, *.safetensors) whose weights fill the module's
    # first PreTrainedModel once the strategy has placed or sharded it, or {path: DIR, model: attribute.path}
    # naming the model; a resume takes precedence (docs/hugging-face.md)
    init_weights: Any = None
    launcher: str = "auto"
    max_restarts: int = 0
    timeout: float = 1800.0  # seconds a collective may wait before the job is ended
    resume: str | None = None  # None, "last", "auto" (last if one exists) or a path
    # true: inject a DistributedSampler when data-parallel ranks > 1 (Lightning); "always": also on one
    # rank, which then reads the order N ranks read together; false: never
    use_distributed_sampler: Any = True
    nan_policy: str = "error"
    detect_divergence: bool = False
    # Lightning's: every feature that costs speed off (checkpoints, loggers, progress bar, summary, sanity
    # check); asking for one of them beside it is an error
    barebones: bool = False


@dataclass
class RunConfig:
    """A whole job: what to train (``module``), optional ``data`` (or ``datamodule:``, Lightning CLI's
    name), and the ``trainer`` section."""

    module: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check_trainer_section(data: dict[str, Any]) -> TrainerConfig:
    """The ``trainer:`` section as a ``TrainerConfig``: every key, type and choice checked (not yet the
    strategy's options, compile, activation checkpointing or the profiler: ``config.py`` does those)."""
    data = dict(data)
    for name in ("max_time", "val_check_interval"):  # a timedelta: OmegaConf holds plain values only
        if hasattr(data.get(name), "total_seconds"):
            data[name] = {"seconds": data[name].total_seconds()}
    if "precision" in data and data["precision"] is not None:
        data["precision"] = PRECISION_ALIASES.get(str(data["precision"]), str(data["precision"]))
    if data.get("barebones"):
        _apply_barebones(data)
    _apply_launcher_in_strategy_name(data)
    cfg: TrainerConfig = validate_dataclass(TrainerConfig, data, "trainer")
    check_choice(cfg.precision, PRECISIONS, "trainer.precision")
    check_choice(cfg.accelerator, ACCELERATORS, "trainer.accelerator")
    check_choice(cfg.launcher, LAUNCHERS, "trainer.launcher")
    if cfg.gradient_clip_algorithm is not None:
        check_choice(cfg.gradient_clip_algorithm, CLIP_ALGORITHMS, "trainer.gradient_clip_algorithm")
    check_choice(cfg.nan_policy, NAN_POLICIES, "trainer.nan_policy")
    _check_logger_and_callbacks(cfg)  # else they would fail only inside the workers
    _check_counts(cfg)
    if cfg.init_weights is not None:
        _check_init_weights(cfg.init_weights)
    _check_lightning_options(cfg)
    if cfg.gradient_clip_val is not None and cfg.gradient_clip_val <= 0:
        raise ConfigError(f"trainer.gradient_clip_val={cfg.gradient_clip_val} must be positive (or null)")
    if cfg.timeout <= 0:
        raise ConfigError(f"trainer.timeout={cfg.timeout} must be a positive number of seconds")
    if cfg.default_root_dir is not None:
        cfg.run_dir = cfg.default_root_dir
    return cfg


def _check_init_weights(option: Any) -> None:
    """A Hugging Face directory as save_pretrained writes it (or ``{path: DIR, model: NAME}``), checked before
    any worker starts (its tensors against the model once the model is built: checkpoint/hugging_face.py)."""
    if isinstance(option, dict) or hasattr(option, "keys"):
        option = dict(option)
        check_keys(option, ["path", "model"], "trainer.init_weights")
        if not isinstance(option.get("path"), str):
            raise ConfigError(f"trainer.init_weights needs path: the directory (got {option!r})")
        path = option["path"]
    elif isinstance(option, str):
        path = option
    else:
        raise ConfigError(f"trainer.init_weights={option!r}: give a directory, or {{path: DIR, model: "
                          f"attribute.path}}")
    if not os.path.isdir(path):
        raise ConfigError(f"trainer.init_weights={path!r} is not a directory: give a local Hugging Face "
                          f"model directory (config.json and *.safetensors, as save_pretrained writes it)")
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any(os.path.exists(os.path.join(path, name)) for name in weights):
        raise ConfigError(f"trainer.init_weights={path!r} holds neither {' nor '.join(weights)}: only "
                          f"safetensors weights are read (save_pretrained writes them by default)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# barebones: option -> (what it turns on, its value when off)
_BAREBONES_OFF = {"enable_checkpointing": ("Checkpointing", False), "logger": ("Logging", False),
                  "enable_progress_bar": ("The progress bar", False),
                  "enable_model_summary": ("The model summary", False),
                  "num_sanity_val_steps": ("Sanity checking", 0)}
_BAREBONES_REFUSED = {"fast_dev_run": "A development run is not meant for speed measurements",
                      "detect_anomaly": "Anomaly detection can impact raw speed",
                      "profiler": "Profiling can impact raw speed"}


# Lightning names how the processes start in the strategy's name; polytrain has a `launcher` option.
_LAUNCHER_IN_NAME = {"ddp_spawn": "spawn", "ddp_fork": "fork", "ddp_notebook": "fork"}


def _apply_launcher_in_strategy_name(data: dict[str, Any]) -> None:
    """``strategy: ddp_spawn`` (``ddp_fork``, ``ddp_notebook``), as Lightning: ``ddp`` whose processes the
    spawn (fork) launcher starts. A ``launcher`` that says otherwise is refused by name."""
    spec = data.get("strategy")
    name = spec.get("name") if isinstance(spec, Mapping) else spec
    if not isinstance(name, str) or name not in _LAUNCHER_IN_NAME:
        return
    launcher = _LAUNCHER_IN_NAME[name]
    if data.get("launcher", "auto") not in ("auto", launcher):
        raise ConfigError(f"trainer.strategy={name!r} starts its processes with the {launcher!r} launcher, "
                          f"but trainer.launcher={data['launcher']!r} was given; drop one of the two (or "
                          f"use strategy 'ddp' with the launcher you want)")
    data["strategy"] = {**spec, "name": "ddp"} if isinstance(spec, Mapping) else "ddp"
    data["launcher"] = launcher


def _apply_barebones(data: dict[str, Any]) -> None:
    """``barebones: true``, as Lightning: what it turns off is refused when also asked for, by name."""
    for name, (what, off) in _BAREBONES_OFF.items():
        if data.get(name, off) not in (None, off):
            raise ConfigError(f"`Trainer(barebones=True, {name}={data[name]!r})` was passed. {what} can "
                              f"impact raw speed so it is disabled in barebones mode; drop one of the two")
        data[name] = off
    for name, why in _BAREBONES_REFUSED.items():
        if data.get(name) not in (None, False, 0):
            raise ConfigError(f"`Trainer(barebones=True, {name}={data[name]!r})` was passed. {why}, so it is "
                              f"disabled in barebones mode; drop one of the two")


def _check_counts(cfg: TrainerConfig) -> None:
    devices = cfg.devices
    if not (devices == "auto" or (_is_int(devices) and devices > 0) or (
            isinstance(devices, list) and devices and all(_is_int(d) and d >= 0 for d in devices))):
        raise ConfigError(f"trainer.devices={devices!r} is not valid; use 'auto', a positive integer, or a "
                          f"list of GPU indices such as [0, 1]")
    node_range(cfg.num_nodes)  # raises with the fix for a bad count or range
    for name in ("accumulate_grad_batches", "log_every_n_steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"trainer.{name}={getattr(cfg, name)} must be at least 1")
    if cfg.max_epochs is not None and cfg.max_epochs < -1:
        raise ConfigError(f"trainer.max_epochs={cfg.max_epochs} is not valid; give a number of epochs "
                          f"(0 trains none), -1 (no limit: until max_steps, max_time or a stop) or null "
                          f"(1000)")
    if cfg.check_val_every_n_epoch is not None and cfg.check_val_every_n_epoch < 1:
        raise ConfigError(f"trainer.check_val_every_n_epoch={cfg.check_val_every_n_epoch} must be at least 1 "
                          f"(or null)")
    for name in ("min_epochs", "min_steps", "reload_dataloaders_every_n_epochs"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise ConfigError(f"trainer.{name} should be an int >= 0, got {value}")
    if cfg.num_sanity_val_steps < -1:
        raise ConfigError(f"trainer.num_sanity_val_steps={cfg.num_sanity_val_steps}; use -1 (all), 0 (none) "
                          f"or N")


def _check_batches_option(name: str, value: Any, allow_none: bool = True) -> None:
    """A number of batches (int >= 0) or a fraction (float in [0, 1])."""
    if value is None and allow_none:
        return
    if _is_int(value) and value >= 0:
        return
    if isinstance(value, float) and (0.0 <= value <= 1.0 or (value > 1 and value.is_integer())):
        return
    raise ConfigError(f"trainer.{name} was passed invalid value {value!r}; give a number of batches "
                      f"(e.g. 10) or a fraction of the epoch in [0, 1] (e.g. 0.25)")


def _check_lightning_options(cfg: TrainerConfig) -> None:
    version = cfg.version
    a_name = isinstance(version, str) and version and os.sep not in version and version not in (".", "..")
    if not (version is None or (_is_int(version) and version >= 0) or a_name):
        raise ConfigError(f"trainer.version={version!r}; give a number n (the directory version_<n>) or a "
                          f"directory name without '{os.sep}', or leave it unset for the next free "
                          f"version_<n>")
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
        _check_batches_option(name, getattr(cfg, name))
    _check_batches_option("overfit_batches", cfg.overfit_batches, allow_none=False)
    if cfg.deterministic not in (True, False, "warn"):
        raise ConfigError(f"trainer.deterministic={cfg.deterministic!r}; use true, false or 'warn'")
    if cfg.use_distributed_sampler not in (True, False, "always"):
        raise ConfigError(f"trainer.use_distributed_sampler={cfg.use_distributed_sampler!r}; use true, false "
                          f"or 'always'")
    interval = cfg.val_check_interval
    seconds = val_check_seconds(interval)  # raises for a duration written wrong
    if seconds is not None and seconds <= 0:
        raise ConfigError(f"trainer.val_check_interval={interval!r} is a duration of {seconds:g} s; give a "
                          f"positive one, e.g. 00:00:30:00 for every 30 minutes")
    a_count = _is_int(interval) and interval >= 1
    a_fraction = isinstance(interval, float) and 0.0 < interval <= 1.0
    if seconds is None and interval is not None and not (a_count or a_fraction):
        raise ConfigError(f"trainer.val_check_interval was passed invalid value {interval!r}; give a "
                          f"number of training batches (>= 1), a fraction of the epoch in (0, 1], or a "
                          f"duration (DD:HH:MM:SS, or a mapping such as {{minutes: 30}})")
    if isinstance(interval, float) and cfg.check_val_every_n_epoch is None:
        raise ConfigError(f"trainer.val_check_interval={interval}: `val_check_interval` should be an integer "
                          f"or a time-based duration (str 'DD:HH:MM:SS', datetime.timedelta, or dict kwargs "
                          f"for timedelta) when `check_val_every_n_epoch=None`. That setting counts training "
                          f"batches across epochs, where a fraction of one epoch means nothing")
    if not (isinstance(cfg.fast_dev_run, bool) or (_is_int(cfg.fast_dev_run) and cfg.fast_dev_run >= 0)):
        raise ConfigError(f"trainer.fast_dev_run={cfg.fast_dev_run!r} should be >= 0: use true, false, or a "
                          f"number of batches")
    if cfg.max_time is not None:
        parse_duration(cfg.max_time)


def parse_duration(value: Any, option: str = "max_time") -> float:
    """``"DD:HH:MM:SS"``, a mapping of ``weeks``/``days``/``hours``/``minutes``/``seconds`` or a
    ``timedelta`` -> seconds (``trainer.max_time``; ``trainer.val_check_interval`` as a duration)."""
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"trainer.{option}={value!r}; write it as DD:HH:MM:SS, e.g. 00:12:00:00 for 12 "
                              f"hours")
        days, hours, minutes, seconds = (int(p) for p in parts)
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    if isinstance(value, dict):
        units = {"weeks": 604800, "days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
        unknown = [k for k in value if k not in units]
        if unknown:
            raise ConfigError(f"trainer.{option} has unknown unit(s) {unknown}; valid: {', '.join(units)}")
        return float(sum(units[k] * float(v) for k, v in value.items()))
    if hasattr(value, "total_seconds"):
        return float(value.total_seconds())
    raise ConfigError(f"trainer.{option}={value!r}; use DD:HH:MM:SS or a mapping such as {{hours: 12}}")


def val_check_seconds(interval: Any) -> float | None:
    """``val_check_interval`` as a duration (``"DD:HH:MM:SS"``, a mapping of units; a ``timedelta`` arrives
    as one), in seconds; None for a count or a fraction of batches."""
    return parse_duration(interval, "val_check_interval") if isinstance(interval, (str, dict)) else None


def _check_logger_and_callbacks(cfg: TrainerConfig) -> None:
    names = [cfg.logger] if isinstance(cfg.logger, str) else cfg.logger
    if not (cfg.logger is None or isinstance(cfg.logger, bool)
            or (isinstance(names, list) and all(isinstance(n, str) and n in LOGGERS for n in names))):
        raise ConfigError(f"trainer.logger={cfg.logger!r} is not valid; use true, false, one of "
                          f"{', '.join(LOGGERS)}, or a list of them")
    for i, spec in enumerate(cfg.callbacks):
        if not (isinstance(spec, dict) and isinstance(spec.get("_target_"), str)):
            raise ConfigError(f"trainer.callbacks[{i}]={spec!r} is not valid; each callback must be a "
                              f"mapping with _target_: package.Class (and its keyword arguments)")


# --------------------------------------------------------------------------- YAML loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader already refuses ``!!python/*`` tags; this one also bounds alias expansion and reads
    ``1:4`` as the string it looks like (YAML 1.1 would make it the base-60 integer 64: a node range
    ``num_nodes: 1:4`` asking for 64 nodes)."""


_YAML_INT = "tag:yaml.org,2002:int"
_DECIMAL_INT = re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$")
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, _DECIMAL_INT if tag == _YAML_INT else regexp) for tag, regexp in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


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
    """``a.b.c=value`` into the nested config. A list (``trainer.callbacks``) is entered by index
    (``callbacks.1.async_save``) or by the class its entry builds
    (``callbacks.ModelCheckpoint.async_save``)."""
    node: Any = data
    for depth, part in enumerate(path[:-1]):
        if isinstance(node, list):
            node = node[_list_entry(node, part, ".".join(path[:depth]))]
            continue
        child = node.get(part)
        if part == "strategy" and isinstance(child, str):
            child = {"name": child}  # trainer.strategy.X=... on a shorthand "ddp"
        if not isinstance(child, (dict, list)):
            child = {}
        node[part] = child
        node = child
    if isinstance(node, list):
        node[_list_entry(node, path[-1], ".".join(path[:-1]))] = value
    else:
        node[path[-1]] = value


def _list_entry(entries: list[Any], part: str, where: str) -> int:
    """The position ``part`` names in a list: an index, or the one entry whose ``_target_`` is that class."""
    if part.lstrip("-").isdigit():
        index = int(part)
        if not -len(entries) <= index < len(entries):
            raise ConfigError(f"{where}.{part}: {where} has {len(entries)} entries (0 to {len(entries) - 1})")
        return index % len(entries)
    classes = [str(e.get("_target_", "")).rsplit(".", 1)[-1] if isinstance(e, dict) else "" for e in entries]
    found = [i for i, name in enumerate(classes) if name == part]
    if len(found) == 1:
        return found[0]
    present = ", ".join(f"{i}: {name or '?'}" for i, name in enumerate(classes)) or "none"
    if found:
        raise ConfigError(f"{where}.{part}: {where} has {len(found)} entries of class {part} (at {found}); "
                          f"name one by its index, e.g. {where}.{found[0]}.<option>=...")
    close = difflib.get_close_matches(part, [c for c in classes if c], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"{where}.{part}: {where} has no entry of class {part}{hint}; its entries: {present}. "
                      f"Name an entry by its class or its index, or set the whole list: {where}=[...]")


def read_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML file with ``key=value`` overrides merged in, as a plain dict (``config_dir``: the file's
    directory, where its ``_target_`` modules are looked for first); not checked yet."""
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
    return data


def check_sections(data: dict[str, Any]) -> dict[str, Any]:
    """``module``, ``data`` (or ``datamodule``) and ``trainer``: known sections, each of its kind; returns
    them, ``datamodule`` renamed ``data``."""
    data = dict(data)
    if "datamodule" in data:  # Lightning CLI's name for the section
        if data.get("data") is not None:
            raise ConfigError("config has both data: and datamodule: sections; they are the same thing (the "
                              "DataModule to use), keep one")
        data["data"] = data.pop("datamodule")
    sections = {k: v for k, v in data.items() if k != "config_dir"}
    check_keys(sections, ["module", "data", "datamodule", "trainer"], "config")
    if not data.get("module") or "_target_" not in data["module"]:
        raise ConfigError("config.module must name the TrainModule to train: "
                          "module: {_target_: pkg.Class, ...}")
    for section in ("module", "data"):
        value = data.get(section)
        if value is not None and not (isinstance(value, dict) and "_target_" in value):
            raise ConfigError(f"config.{section} must be a mapping with a _target_ key")
    return data


def first_check(path: str | os.PathLike, overrides: list[str] | None = None) -> None:
    """What ``polytrain`` checks before it imports torch: the file, the overrides, the sections, the
    trainer section's keys, types and choices, the strategy's name and options (a request to the planner
    included; context parallel refused on a cpu accelerator), and the ``_target_`` arguments as far as
    their source settles them (``target_source.py``). A ``ConfigError`` names what is wrong."""
    sections = check_sections(read_config(path, overrides))
    cfg = check_trainer_section(sections.get("trainer") or {})
    spec = spec_mapping(cfg.strategy)
    if isinstance(spec, dict):
        _check_strategy(spec, cfg.accelerator)
    check_targets_from_source({**sections, "trainer": {"callbacks": cfg.callbacks}})


def _check_strategy(spec: dict[str, Any], accelerator: str) -> None:
    """``registry.validate_strategy_spec`` over the package's own strategies, without torch."""
    options = dict(spec)
    name = options.pop("name", "auto")
    if wants_plan(name, options):  # the 'auto' degrees checked at their defaults, as the registry does
        plain, _ = split_plan(options, [f.name for f in dataclasses.fields(OPTIONS[name])])
        spec = {"name": name, **plain}
    _, parsed = check_strategy_spec(spec)
    if accelerator == "cpu" and isinstance(getattr(parsed, "cp", None), int):
        check_context_parallel_device(parsed.cp, accelerator)


def trainer_to_dict(cfg: TrainerConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
