"""Metric loggers. They are callbacks that receive every published metric and, when a stage starts,
the module's and DataModule's hyperparameters (``save_hyperparameters``); only the logging rank
creates files, so other ranks never touch the run directory. MLflow and W&B: ``experiment_loggers``."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from typing import Any

import yaml

from polytrain.callbacks.base import Callback


def plain_hparams(value: Any) -> Any:
    """Hyperparameters as plain values (numbers, strings, lists, dicts); anything else by its ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_hparams(v) for k, v in value.items()}
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
    params: dict[str, Any] = {}
    for obj in (getattr(trainer, "datamodule", None), module):
        if obj is not None and getattr(obj, "__dict__", {}).get("_log_hyperparams", True):
            params.update(getattr(obj, "hparams_initial", None) or {})
    return plain_hparams(params)


class Logger(Callback):
    watches_metrics = True  # flushes after the epoch's metrics are published

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """The run's hyperparameters (plain values, possibly nested); called once per distinct set."""

    def flush(self) -> None: ...

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        # Every stage, as Lightning; a logger writes a given set of hyperparameters once.
        if not trainer.is_logging_rank:
            return
        params = hyperparameters(trainer, module)
        if params and params != self.__dict__.get("_hparams_logged"):
            self.log_hyperparams(params)
            self.__dict__["_hparams_logged"] = params

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if trainer.is_logging_rank and metrics:
            self.log_metrics({**metrics, "epoch": float(trainer.current_epoch)}, step)  # Lightning's epoch column

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_logging_rank:
            self.flush()

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_logging_rank:
            self.flush()

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        if trainer.is_logging_rank:
            self.flush()

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_logging_rank and trainer.stage != "fit":  # a standalone validate()
            self.flush()

    def on_test_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_logging_rank:
            self.flush()


def write_hparams_yaml(path: str, params: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        yaml.safe_dump(params, fh, sort_keys=False)
    os.replace(tmp, path)


class TensorBoardLogger(Logger):
    """Scalars under ``<run_dir>/tensorboard``; view with ``tensorboard --logdir <run_dir>``. The
    hyperparameters go to the HParams tab (in the same event file, as Lightning) and to ``hparams.yaml``."""

    def __init__(self, run_dir: str, subdir: str = "tensorboard") -> None:
        self.log_dir = os.path.join(run_dir, subdir)
        self._writer: Any = None
        self._summary: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils import tensorboard  # late: 0.1 s; only a run that logs pays it

            self._writer, self._summary = tensorboard.SummaryWriter(self.log_dir), tensorboard.summary
        return self._writer

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        writer = self.writer
        flat = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flatten_hparams(params).items()}
        for event in self._summary.hparams(flat, {}):  # what SummaryWriter.add_hparams writes, minus its subfolder
            writer.file_writer.add_summary(event)
        write_hparams_yaml(os.path.join(self.log_dir, "hparams.yaml"), params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CSVLogger(Logger):
    """One row per logging step in ``<run_dir>/metrics.csv``; columns grow as new names appear. The
    hyperparameters go to ``<run_dir>/hparams.yaml``."""

    def __init__(self, run_dir: str, filename: str = "metrics.csv") -> None:
        self.path = os.path.join(run_dir, filename)
        self.hparams_path = os.path.join(run_dir, "hparams.yaml")
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        self._unwritten = False  # rows changed since the file was last written (the fit's end rewrites it
        # only then: after an epoch-end flush it would write the same bytes again)

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        # After any resume: a resumed run continues the file instead of overwriting the rows before
        # the checkpoint (and drops rows past it, written by the run that was interrupted).
        if not trainer.is_logging_rank or self.rows or not os.path.exists(self.path):
            return
        with open(self.path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            self.columns = list(reader.fieldnames or ["step"])
            self.rows = [{k: v for k, v in row.items() if v != ""} for row in reader
                         if int(row["step"]) <= trainer.global_step]
        for row in self.rows:
            row["step"] = int(row["step"])
        self._unwritten = True  # rows past the checkpoint were dropped: the file must lose them too

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        write_hparams_yaml(self.hparams_path, params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.rows and self.rows[-1]["step"] == step:
            self.rows[-1].update(metrics)
        else:
            self.rows.append({"step": step, **metrics})
        self.columns.extend(k for k in metrics if k not in self.columns)
        self._unwritten = True

    def flush(self) -> None:
        if not self.rows or not self._unwritten:
            return
        self._unwritten = False
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
