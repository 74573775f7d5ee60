"""The callback list a Trainer starts with: the user's, then defaults the config enables."""

from __future__ import annotations

import os
from typing import Any

from polytrain.callbacks.base import Callback
from polytrain.callbacks.compile_time import CompileTime
from polytrain.callbacks.csv_logger import CSVLogger
from polytrain.callbacks.experiment_loggers import MLFlowLogger, WandbLogger
from polytrain.callbacks.loggers import DummyLogger, ForeignLogger
from polytrain.callbacks.model_checkpoint import ModelCheckpoint
from polytrain.callbacks.progress_bar import ProgressBar
from polytrain.callbacks.summary import ModelSummary
from polytrain.callbacks.tensorboard_logger import TensorBoardLogger
from polytrain.core.errors import ConfigError
from polytrain.core.rank_zero import rank_zero_warn
from polytrain.parallel.compile import resolve_compile
from polytrain.trainer.configuration.config import TrainerConfig, instantiate

_LOGGER_NAMES = ("tensorboard", "csv", "mlflow", "wandb")
_OBJECT_KEYS = ("callbacks", "logger", "strategy")


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, dict))


def split_objects(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[Callback], dict[str, Any]]:
    """``Trainer(**kwargs)``: the config's plain values, the ``Callback`` objects given, and the other objects
    (a ``logger`` or ``strategy`` instance) that ``callbacks``, ``logger`` and ``strategy`` also accept."""
    kwargs = dict(kwargs)
    objects = {k: kwargs.pop(k) for k in _OBJECT_KEYS if k in kwargs and not _is_plain(kwargs[k])}
    callback_objects: list[Callback] = []
    if isinstance(kwargs.get("callbacks"), (list, tuple)):
        callback_objects = [c for c in kwargs["callbacks"] if isinstance(c, Callback)]
        kwargs["callbacks"] = [c for c in kwargs["callbacks"] if not isinstance(c, Callback)]
    if isinstance(objects.get("callbacks"), (list, tuple)):
        callback_objects += list(objects.pop("callbacks"))
    elif isinstance(objects.get("callbacks"), Callback):
        callback_objects.append(objects.pop("callbacks"))
    return kwargs, callback_objects, objects


def _loggers(spec: Any, run_dir: str, version: int | str | None) -> list[Callback]:
    """Loggers chosen by name. The file loggers write into the run's version directory
    (``<run_dir>/version_<n>``), which the Trainer settles for the whole run."""
    if spec is False or spec is None:
        return []
    if spec is True:
        spec = ["tensorboard", "csv"]
    if not isinstance(spec, (str, list, tuple)):
        raise ConfigError(f"trainer.logger={spec!r} is not valid; use true, false, one of "
                          f"{', '.join(_LOGGER_NAMES)}, or a list of them")
    names = [spec] if isinstance(spec, str) else list(spec)
    out: list[Callback] = []
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardLogger(run_dir, name="", version=version))
        elif name == "csv":
            # a row per step (the loss and the learning rate of a step together); a CSVLogger built by hand
            # writes Lightning's row per call unless asked
            out.append(CSVLogger(run_dir, name="", version=version, rows="step"))
        elif name == "mlflow":
            # by name: a file store in the run directory, unless MLFLOW_TRACKING_URI is set
            out.append(MLFlowLogger(save_dir=os.path.join(run_dir, "mlruns")))
        elif name == "wandb":  # online unless WANDB_MODE=offline; files under <run_dir>/wandb
            out.append(WandbLogger(save_dir=run_dir))
        else:
            raise ConfigError(f"trainer.logger has unknown logger '{name}'; valid: "
                              f"{', '.join(_LOGGER_NAMES)}, true, false")
    return out


def build_callbacks(cfg: TrainerConfig, objects: list[Callback], logger_objects: Any) -> list[Callback]:
    callbacks: list[Callback] = []
    for cb in objects:
        cb._user_given = True
        callbacks.append(cb)
    for i, spec in enumerate(cfg.callbacks):
        if not isinstance(spec, dict):
            raise ConfigError(f"trainer.callbacks[{i}] must be a mapping with _target_, got {spec!r}")
        cb = instantiate(spec, f"trainer.callbacks[{i}]")
        if not isinstance(cb, Callback):
            raise ConfigError(f"trainer.callbacks[{i}]: {spec['_target_']} is not a polytrain Callback")
        callbacks.append(cb)
    if cfg.fast_dev_run:
        # a quick check of every loop: nothing is logged or written; where loggers were asked for,
        # trainer.logger is a stand-in that takes every call, as Lightning's
        if logger_objects or (logger_objects is None and cfg.logger):
            callbacks.append(DummyLogger())
    elif logger_objects is not None:
        given = logger_objects if isinstance(logger_objects, (list, tuple)) else [logger_objects]
        callbacks.extend(ForeignLogger(obj) if ForeignLogger.wraps(obj) else obj for obj in given)
    else:
        callbacks.extend(_loggers(cfg.logger, cfg.run_dir, cfg.version))
    if cfg.enable_model_summary and not any(isinstance(c, ModelSummary) for c in callbacks):
        callbacks.append(ModelSummary())
    if resolve_compile(cfg.compile) is not None:
        callbacks.append(CompileTime())  # one log line: how long compiling took
    if cfg.enable_progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(ProgressBar())
    given = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    if cfg.enable_checkpointing and not cfg.fast_dev_run and not given:
        # the Trainer's own: last.ckpt beside the newest state, so `resume: last` continues from it even
        # when save_top_k would have pruned it (a ModelCheckpoint the user builds has Lightning's default)
        callbacks.append(ModelCheckpoint(save_last=True))
    if not cfg.enable_checkpointing and given:
        # Both were asked for: the callback, the more particular, is kept (Lightning refuses the pair)
        rank_zero_warn(f"enable_checkpointing=False, but the callbacks hold {len(given)} ModelCheckpoint: it "
                       f"saves checkpoints as configured. Remove it from the callbacks to save none")
    # Checkpointing runs last so a saved state includes what the other callbacks updated this step.
    callbacks.sort(key=lambda c: isinstance(c, ModelCheckpoint))
    return callbacks
