"""Metric loggers, with Lightning's names and constructor arguments.

A logger is a callback that receives every published metric and, when a stage starts, the module's and
DataModule's hyperparameters (``save_hyperparameters``); only the logging rank writes, so other ranks
never touch the run directory, and on them ``logger.experiment`` is a stand-in that accepts any call and
does nothing (user code calling ``self.logger.experiment.add_image`` runs on every rank). File loggers
(``TensorBoardLogger``, ``CSVLogger``) write into a version directory of their own, as Lightning's do:
``<save_dir>/<name>/version_<n>``, the next free number unless ``version`` is given.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from polytrain.callbacks.base import Callback
from polytrain.checkpoint.layout import next_version, version_name
from polytrain.core.log_files import write_text
from polytrain.core.rank_zero import rank_zero_only


def plain_hparams(value: Any) -> Any:
    """Hyperparameters as plain values (numbers, strings, lists, dicts); anything else by its ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_hparams(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and type(value).__name__ == "Namespace":  # argparse, as Lightning accepts
        return plain_hparams(vars(value))
    if isinstance(value, (list, tuple)):
        return [plain_hparams(v) for v in value]
    return repr(value)


def flatten_hparams(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"opt": {"lr": 1}}`` -> ``{"opt/lr": 1}`` (Lightning's flattening for TensorBoard and MLflow)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_hparams(value, name + "/"))
        else:
            out[name] = value
    return out


def hyperparameters(trainer: Any, module: Any) -> dict[str, Any]:
    """What the loggers are given, as Lightning: the DataModule's initial hparams, then the module's
    (``save_hyperparameters(logger=False)`` keeps an object's out)."""
    return plain_hparams(merged_hparams(getattr(trainer, "datamodule", None), module))


def merged_hparams(datamodule: Any, module: Any) -> dict[str, Any]:
    """The DataModule's and the module's initial hyperparameters in one dict; a name both hold with
    different values raises (Lightning's RuntimeError), since the loggers could record only one of them."""
    logged = [getattr(obj, "hparams_initial", None) or {} for obj in (datamodule, module)
              if obj is not None and getattr(obj, "__dict__", {}).get("_log_hyperparams", True)]
    if len(logged) == 2:
        clashing = sorted(k for k in set(logged[0]) & set(logged[1]) if logged[0][k] != logged[1][k])
        if clashing:
            values = ", ".join(f"{k}: {logged[1][k]!r} vs {logged[0][k]!r}" for k in clashing)
            raise RuntimeError(f"Error while merging hparams: the keys {clashing} are present in both the "
                               f"{type(module).__name__}'s and the {type(datamodule).__name__}'s hparams but "
                               f"have different values ({values}). Rename one, or save it with only one of "
                               f"them")
    params: dict[str, Any] = {}
    for one in logged:
        params.update(one)
    return params


def prefixed(metrics: Mapping[str, float], prefix: str, separator: str = "-") -> dict[str, float]:
    """Lightning's ``prefix`` argument: ``{"loss": 1}`` with prefix ``train`` -> ``{"train-loss": 1}``."""
    return {f"{prefix}{separator}{k}": v for k, v in metrics.items()} if prefix else dict(metrics)


class DummyExperiment:
    """What ``logger.experiment`` is on a rank that does not log: any attribute, any call, does nothing."""

    def nop(self, *args: Any, **kwargs: Any) -> None: ...

    def __getattr__(self, _: str) -> Callable[..., None]:
        return self.nop

    def __getitem__(self, _: Any) -> DummyExperiment:
        return self

    def __setitem__(self, *_: Any) -> None: ...


def rank_zero_experiment(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Lightning's decorator for a logger's ``experiment`` property: the real object on rank 0, a
    ``DummyExperiment`` on the other ranks."""

    @functools.wraps(fn)
    def experiment(self: Any) -> Any:
        return fn(self) if rank_zero_only.rank == 0 else DummyExperiment()  # type: ignore[attr-defined]

    return experiment


class Logger(Callback):
    """The base of every logger; subclass it as Lightning's ``Logger`` (``name``, ``version``,
    ``log_metrics``, ``log_hyperparams``; ``experiment``, ``save``, ``finalize`` optional)."""

    watches_metrics = True  # saves after the epoch's metrics are published

    @property
    def name(self) -> str | None:
        return None

    @property
    def version(self) -> int | str | None:
        return None

    @property
    def save_dir(self) -> str | None:
        return None

    @property
    def root_dir(self) -> str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        return None

    @property
    def group_separator(self) -> str:
        return "/"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The run's hyperparameters (plain values, possibly nested); called once per distinct set."""

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """The model's graph, for loggers that draw one (TensorBoard with ``log_graph=True``)."""

    def save(self) -> None:
        """Write what is buffered (called after each epoch and at the end of each stage)."""

    def finalize(self, status: str) -> None:
        """The stage ended (``status``: ``success`` or ``failed``): write everything."""
        self.save()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """A ``ModelCheckpoint`` wrote a file (loggers that upload checkpoints act here)."""

    def flush(self) -> None:
        self.save()

    # ------------------------------------------------------------------ as a callback
    @property
    def writes_here(self) -> bool:
        """Whether this process is the one that logs (known once a stage starts; before, global rank 0)."""
        logging_rank = self.__dict__.get("_logging_rank")
        return logging_rank if logging_rank is not None else rank_zero_only.rank == 0  # type: ignore[attr-defined]

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        # Every stage, as Lightning; a logger writes a given set of hyperparameters once.
        self.__dict__["_logging_rank"] = trainer.is_logging_rank
        if not trainer.is_logging_rank:
            return
        params = hyperparameters(trainer, module)
        if params and params != self.__dict__.get("_hparams_logged"):
            self.log_hyperparams(params)
            self.__dict__["_hparams_logged"] = params

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if trainer.is_logging_rank and metrics:
            # Lightning's epoch column
            self.log_metrics({**metrics, "epoch": int(trainer.current_epoch)}, step)

    def _save_if_logging(self, trainer: Any) -> None:
        if trainer.is_logging_rank:
            self.save()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self._save_if_logging(trainer)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if trainer.stage != "fit":  # a standalone validate()
            self._save_if_logging(trainer)

    def on_test_end(self, trainer: Any, module: Any) -> None:
        self._save_if_logging(trainer)

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self._save_if_logging(trainer)

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        if trainer.is_logging_rank:
            self.finalize("success")

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        if trainer.is_logging_rank:
            self.finalize("failed")


class DummyLogger(Logger):
    """What ``trainer.logger`` is under ``fast_dev_run`` where loggers were asked for, as Lightning's: it
    takes every call and writes nothing, so code that logs through ``self.logger.experiment`` runs."""

    @property
    def experiment(self) -> DummyExperiment:
        return DummyExperiment()

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None: ...

    def __getitem__(self, idx: int) -> DummyLogger:
        return self  # Lightning code may index trainer.loggers' entries


class ForeignLogger(Logger):
    """A logger written against Lightning's interface without subclassing ``Logger`` (an object with
    ``log_metrics`` and ``log_hyperparams``; ``name``, ``version``, ``save_dir``, ``log_dir``, ``save``,
    ``finalize``, ``log_graph``, ``after_save_checkpoint`` where it has them), driven as a ``Logger``: the
    loop's calls reach its methods; any other attribute is its own."""

    def __init__(self, logger: Any) -> None:
        self.__dict__["logger"] = logger

    @staticmethod
    def wraps(obj: Any) -> bool:
        """Whether ``obj`` is such a logger: not a callback, and it logs metrics and hyperparameters."""
        return (not isinstance(obj, Callback) and callable(getattr(obj, "log_metrics", None))
                and callable(getattr(obj, "log_hyperparams", None)))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["logger"], name)

    @property
    def name(self) -> str | None:
        return getattr(self.logger, "name", None)

    @property
    def version(self) -> int | str | None:
        return getattr(self.logger, "version", None)

    @property
    def save_dir(self) -> str | None:
        return getattr(self.logger, "save_dir", None)

    @property
    def log_dir(self) -> str | None:
        return getattr(self.logger, "log_dir", None)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logger.log_metrics(metrics, step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.logger.log_hyperparams(params, *args, **kwargs)

    def _optional(self, method: str, *args: Any) -> None:
        call = getattr(self.logger, method, None)
        if callable(call):
            call(*args)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        self._optional("log_graph", model, input_array)

    def save(self) -> None:
        self._optional("save")

    def finalize(self, status: str) -> None:
        self._optional("finalize", status)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._optional("after_save_checkpoint", checkpoint_callback)


class DirectoryLogger(Logger):
    """A logger that writes files under ``<save_dir>/<name>/<version>`` (``name`` empty or None: straight
    under ``save_dir``). The version is the next free ``version_<n>`` when first needed; in a job the
    Trainer settles it on global rank 0 and gives every rank the same one (``pin_version``)."""

    def __init__(self, save_dir: str | os.PathLike, name: str | None, version: int | str | None,
                 sub_dir: str | os.PathLike | None = None, prefix: str = "") -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._asked_version = version  # what the user asked for (None: the next free one, each run)
        self._version = version
        self._sub_dir = os.fspath(sub_dir) if sub_dir is not None else None
        self._prefix = prefix

    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self._save_dir, self._name) if self._name else self._save_dir

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(self.root_dir)
        return self._version

    @property
    def asked_version(self) -> int | str | None:
        return self._asked_version

    def pin_version(self, version: int | str) -> None:
        self._version = version

    @property
    def log_dir(self) -> str:
        path = os.path.join(self.root_dir, version_name(self.version))
        return os.path.join(path, self._sub_dir) if self._sub_dir else path


class _HparamsDumper(yaml.SafeDumper):
    """Safe YAML, plus classes and functions as Lightning writes them (``!!python/name:torch.nn.ReLU``,
    which ``load_hparams_from_yaml`` reads back): a hyperparameter naming a layer type stays in the file."""


for _kind in (type, types.FunctionType, types.BuiltinFunctionType):
    _HparamsDumper.add_multi_representer(_kind, yaml.representer.Representer.represent_name)


def write_hparams_yaml(path: str, params: dict[str, Any]) -> None:
    """``params`` as YAML; a value YAML cannot hold safely (a module, a tensor) is left out, with a warning
    naming it, as Lightning's ``save_hparams_to_yaml`` does."""
    kept: dict[str, Any] = {}
    for name, value in params.items():
        try:
            yaml.dump(value, Dumper=_HparamsDumper)
        except yaml.YAMLError:
            warnings.warn(f"Skipping {name!r} parameter because it is not possible to safely dump to YAML "
                          f"({type(value).__name__})", stacklevel=3)
            continue
        kept[name] = value
    write_text(path, yaml.dump(kept, Dumper=_HparamsDumper, sort_keys=False))
