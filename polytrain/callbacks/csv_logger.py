"""``CSVLogger``: a row per ``log_metrics`` call (or per step) in
``<save_dir>/<name>/version_<n>/metrics.csv`` (columns grow as new names appear), the hyperparameters in
``hparams.yaml`` beside it. ``save_dir`` may be a URL (``s3://bucket/logs``): see ``core/log_files.py``."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from polytrain.callbacks.loggers import DirectoryLogger, DummyExperiment, prefixed, write_hparams_yaml
from polytrain.core.log_files import read_text, write_text

ROWS = ("call", "step")  # a row per log_metrics call (Lightning's), or per step


class CSVExperiment:
    """What ``CSVLogger.experiment`` returns (Lightning's ``ExperimentWriter``): the rows, and the file
    they go to. ``rows="call"``: each ``log_metrics`` call is a row of its own, as in Lightning (values
    logged at one step by different callers, the loop, a LearningRateMonitor, an evaluation after the fit,
    keep their own ``epoch``). ``rows="step"``: a call at the step of the row before fills that row (the
    loss and the learning rate of a step on one row), unless it holds another value for a column the row
    has (another ``epoch``): then it starts a row. ``save`` writes the file whole."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str, rows: str = "call") -> None:
        self.log_dir = log_dir
        self.rows = rows
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = ["step"]
        self.hparams: dict[str, Any] = {}
        self._unwritten = False  # rows changed since the file was last written
        self._read_existing()

    def _read_existing(self) -> None:
        """Rows already in the file (a resumed run's, or a stage run later in the same directory) are
        kept: a stage adds its rows after them, never writes over them."""
        text = read_text(self.metrics_file_path)
        if text is None:
            return
        reader = csv.DictReader(io.StringIO(text, newline=""))
        self.metrics_keys = list(reader.fieldnames or ["step"])
        self.metrics = [{k: v for k, v in row.items() if v != ""} for row in reader]
        for row in self.metrics:
            row["step"] = int(row["step"])

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        write_hparams_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        step = len(self.metrics) if step is None else step
        last = self.metrics[-1] if self.metrics and self.rows == "step" else None
        if (last is not None and last["step"] == step
                and all(last.get(k, v) == v for k, v in metrics_dict.items())):
            last.update(metrics_dict)
        else:
            self.metrics.append({"step": step, **metrics_dict})
        self.metrics_keys.extend(k for k in metrics_dict if k not in self.metrics_keys)
        self._unwritten = True

    def continue_from(self, step: int) -> None:
        """A resumed run: keep the rows up to ``step`` (the checkpoint's) and continue after them; rows
        past it were written by the run that was interrupted after that checkpoint."""
        kept = [row for row in self.metrics if row["step"] <= step]
        if len(kept) != len(self.metrics):
            self.metrics = kept
            self._unwritten = True  # the file must lose them too

    def save(self) -> None:
        if not self.metrics or not self._unwritten:
            return
        self._unwritten = False
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
        writer.writeheader()
        writer.writerows(self.metrics)
        write_text(self.metrics_file_path, text.getvalue())


ExperimentWriter = CSVExperiment  # Lightning's name for it (loggers.csv_logs.ExperimentWriter)


class CSVLogger(DirectoryLogger):
    """Lightning's ``CSVLogger(save_dir, name="lightning_logs", version=None, prefix="",
    flush_logs_every_n_steps=100)``: the file is written every ``flush_logs_every_n_steps`` logged
    steps, at each epoch's end and when a stage ends. ``rows``: ``"call"`` (Lightning's file: a row per
    ``log_metrics`` call) or ``"step"`` (a row per step: what ``trainer.logger: csv`` or ``true`` writes;
    see ``CSVExperiment``).

    A run resumed from a checkpoint continues its own file: the rows up to the checkpoint's step are
    kept, rows the interrupted run wrote after it are dropped. A file this logger did not start is never
    written over: a fresh run in an existing version directory refuses before it starts (the Trainer
    checks), and a stage's rows are added to the rows already in memory, never replacing them.
    """

    def __init__(self, save_dir: str | os.PathLike, name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "",
                 flush_logs_every_n_steps: int = 100, rows: str = "call") -> None:
        if rows not in ROWS:
            raise ValueError(f"CSVLogger rows={rows!r}; valid: {', '.join(ROWS)}")
        super().__init__(save_dir, name, version, None, prefix)
        self._rows = rows
        self._flush_every = max(1, int(flush_logs_every_n_steps))
        self._experiment: CSVExperiment | None = None
        self._logged_steps = 0

    @property
    def experiment(self) -> Any:
        """The ``CSVExperiment`` (on ranks that do not log: a stand-in that does nothing)."""
        if not self.writes_here:
            return DummyExperiment()
        if self._experiment is None or self._experiment.log_dir != self.log_dir:
            self._experiment = CSVExperiment(self.log_dir, self._rows)
        return self._experiment

    @property
    def path(self) -> str:
        return os.path.join(self.log_dir, CSVExperiment.NAME_METRICS_FILE)

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        # After any resume (the loop has restored the step): continue this run's rows.
        if trainer.is_logging_rank and trainer.global_step > 0:
            self.experiment.continue_from(trainer.global_step)

    def log_hyperparams(self, params: Any = None) -> None:
        """``params`` (a dict or Namespace) into ``hparams.yaml``; none: the file with what was logged."""
        self.experiment.log_hparams(dict(vars(params) if hasattr(params, "__dict__") and not isinstance(
            params, dict) else (params or {})))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.experiment.log_metrics(prefixed(metrics, self._prefix), step)
        self._logged_steps += 1
        if self._logged_steps % self._flush_every == 0:
            self.save()

    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.save()
