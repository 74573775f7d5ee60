"""Configuration: structured defaults <- YAML file <- ``key=value`` overrides, validated early.

Every section is a dataclass. Unknown keys, wrong types and missing values are rejected before
any process group starts, naming the key and the valid choices. ``_target_`` entries import and
call arbitrary code: a config is code, treat it like a script you would run. Loading a config
imports every ``_target_`` and matches its arguments against the signature (trainer/configuration/targets.py);
the objects are built only where they run (in the workers). Reading the file and the checks that need
no torch are ``config_file.py`` (``polytrain`` runs them first); the ones here need the strategies,
``torch.compile``'s signature, the profilers and the ``_target_`` classes.
"""

from __future__ import annotations

from typing import Any

from polytrain.core.errors import ConfigError
from polytrain.core.nodes import is_elastic_range
from polytrain.core.rank_zero import rank_zero_info
from polytrain.parallel.activation_checkpointing import resolve_checkpointing
from polytrain.parallel.compile import resolve_compile
from polytrain.parallel.float8 import resolve_float8
from polytrain.strategies.registry import normalize_strategy, validate_strategy_spec
from polytrain.trainer.configuration.config_file import (
    ACCELERATORS,
    LAUNCHERS,
    LOGGERS,
    PRECISION_ALIASES,
    PRECISIONS,
    TrainerConfig,
    check_sections,
    check_trainer_section,
    parse_duration,
    parse_yaml,
    read_config,
    trainer_to_dict,
)
from polytrain.trainer.configuration.targets import (
    check_arguments,
    check_run_targets,
    import_target,
    search_from,
)
from polytrain.trainer.observability.profiler import check_profiler_options

__all__ = ["ACCELERATORS", "LAUNCHERS", "LOGGERS", "PRECISIONS", "PRECISION_ALIASES", "ConfigError",
           "TrainerConfig", "elastic_warning", "instantiate", "load_config", "parse_duration", "parse_yaml",
           "trainer_to_dict", "validate_run_config", "validate_trainer_config"]


def validate_trainer_config(data: dict[str, Any]) -> TrainerConfig:
    """``config_file.check_trainer_section``, then what needs torch: the strategy's options, the profiler,
    ``torch.compile``'s keywords, activation checkpointing."""
    data = dict(data)
    if "strategy" in data:
        data["strategy"] = normalize_strategy(data["strategy"])
    cfg = check_trainer_section(data)
    if cfg.profiler is not None:
        # The names and each profiler's options (trainer/observability/profiler.py).
        check_profiler_options(cfg.profiler)
    resolve_compile(cfg.compile)
    resolve_checkpointing(cfg.activation_checkpointing)
    resolve_float8(cfg.float8)
    cfg.strategy = validate_strategy_spec(normalize_strategy(cfg.strategy), cfg.accelerator)
    if cfg.fast_dev_run:
        apply_fast_dev_run(cfg)
    else:
        say_whole_limits(data)
    return cfg


_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
           "overfit_batches", "val_check_interval")


def say_whole_limits(given: dict[str, Any]) -> None:
    """A limit set to ``1`` (one batch) reads much like ``1.0`` (every batch): say which one was meant,
    in Lightning's words, for the options the user set."""
    for name in _LIMITS:
        value = given.get(name)
        if type(value) is int and value == 1:
            what = "validation will run after every batch" if name == "val_check_interval" else (
                "1 batch per epoch will be used" if name == "limit_train_batches" else "1 batch will be used")
            rank_zero_info(f"`Trainer({name}=1)` was configured so {what}.")
        elif type(value) is float and value == 1.0:
            what = ("validation will run at the end of the training epoch" if name == "val_check_interval"
                    else "100% of the batches per epoch will be used" if name == "limit_train_batches"
                    else "100% of the batches will be used")
            rank_zero_info(f"`Trainer({name}=1.0)` was configured so {what}.")


def apply_fast_dev_run(cfg: TrainerConfig) -> None:
    """``fast_dev_run``'s settings, written into the options as Lightning writes them into its Trainer (so
    ``trainer.limit_train_batches``, ``trainer.max_epochs``, ... read what runs): n batches of every loop
    (of validation and test too), one epoch, no sanity check, validation once at the epoch's end."""
    if type(cfg.fast_dev_run) is int and cfg.fast_dev_run == 1:
        cfg.fast_dev_run = True  # Lightning's: one batch reads back as True
    batches = 1 if cfg.fast_dev_run is True else int(cfg.fast_dev_run)
    stages = ("test", "predict") if cfg.overfit_batches else ("train", "val", "test", "predict")
    for stage in stages:
        setattr(cfg, f"limit_{stage}_batches", batches)
    cfg.num_sanity_val_steps = 0
    cfg.max_epochs = 1
    cfg.val_check_interval = 1.0
    cfg.check_val_every_n_epoch = 1


def elastic_warning(cfg: TrainerConfig) -> str | None:
    """What an elastic config (``max_restarts`` > 0, or a node range) lacks to continue after a restart:
    ``resume: auto`` (or ``last``), and checkpoints taken during an epoch. Without them every restart, and
    every lost or joining node, starts the training over, silently."""
    if not (cfg.max_restarts or is_elastic_range(cfg.num_nodes)):
        return None
    missing = [] if cfg.resume in ("auto", "last") else ["trainer.resume: auto"]
    if not any(_checkpoints_within_epochs(spec) for spec in cfg.callbacks):
        missing.append("a ModelCheckpoint with every_n_train_steps (or train_time_interval) in "
                       "trainer.callbacks")
    if not missing:
        return None
    why = f"trainer.num_nodes={cfg.num_nodes}"
    if cfg.max_restarts:
        why = f"trainer.max_restarts={cfg.max_restarts}"
    return (f"{why} restarts the workers after a failure, but each restart will start the training over: add "
            f"{' and '.join(missing)} so it continues from the newest checkpoint (docs/reliability.md)")


def _checkpoints_within_epochs(spec: Any) -> bool:
    named = isinstance(spec, dict) and str(spec.get("_target_", "")).rsplit(".", 1)[-1] == "ModelCheckpoint"
    return named and bool(spec.get("every_n_train_steps") or spec.get("train_time_interval"))


def load_config(path: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Merge a YAML file and ``key=value`` overrides into one validated plain dict."""
    return validate_run_config(read_config(path, overrides))


def validate_run_config(data: dict[str, Any]) -> dict[str, Any]:
    sections = check_sections(data)
    config_dir = sections.pop("config_dir", None)
    trainer = validate_trainer_config(sections.get("trainer") or {})
    out = {"module": sections["module"], "data": sections.get("data"), "trainer": trainer_to_dict(trainer)}
    if config_dir:
        out["config_dir"] = config_dir
    check_run_targets(out)  # imported and matched against their signatures here, built only in the workers
    return out


# --------------------------------------------------------------------------- _target_


def instantiate(spec: dict[str, Any], where: str, config_dir: str | None = None) -> Any:
    """Import ``spec['_target_']`` and call it with the remaining keys. This runs code."""
    search_from(config_dir)
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if not isinstance(target, str):
        raise ConfigError(f"{where} needs a _target_: package.Class entry")
    kwargs = {k: instantiate(v, f"{where}.{k}", config_dir) if isinstance(v, dict) and "_target_" in v else v
              for k, v in spec.items()}
    factory = import_target(target, where)
    check_arguments(factory, kwargs, where, target)
    return factory(**kwargs)
