"""Metric loggers. They are callbacks that receive every published metric; only the logging rank
creates files, so other ranks never touch the run directory."""

from __future__ import annotations

import csv
import os
from typing import Any

from polytrain.callbacks.base import Callback


class Logger(Callback):
    watches_metrics = True  # flushes after the epoch's metrics are published

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None: ...

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


class TensorBoardLogger(Logger):
    """Scalars under ``<run_dir>/tensorboard``; view with ``tensorboard --logdir <run_dir>``."""

    def __init__(self, run_dir: str, subdir: str = "tensorboard") -> None:
        self.log_dir = os.path.join(run_dir, subdir)
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # late: 0.1 s; only a run that logs pays it

            self._writer = SummaryWriter(self.log_dir)
        return self._writer

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
    """One row per logging step in ``<run_dir>/metrics.csv``; columns grow as new names appear."""

    def __init__(self, run_dir: str, filename: str = "metrics.csv") -> None:
        self.path = os.path.join(run_dir, filename)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]

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

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.rows and self.rows[-1]["step"] == step:
            self.rows[-1].update(metrics)
        else:
            self.rows.append({"step": step, **metrics})
        self.columns.extend(k for k in metrics if k not in self.columns)

    def flush(self) -> None:
        if not self.rows:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
