"""``TensorBoardLogger``: scalars, hyperparameters and whatever user code adds through ``.experiment`` (a
``torch.utils.tensorboard.SummaryWriter``), in ``<save_dir>/<name>/version_<n>``; view them with
``tensorboard --logdir <save_dir>``."""

from __future__ import annotations

import os
from typing import Any

from polytrain.callbacks.loggers import (
    DirectoryLogger,
    DummyExperiment,
    flatten_hparams,
    prefixed,
    write_hparams_yaml,
)
from polytrain.core.errors import ConfigError
from polytrain.core.log_files import is_url


class TensorBoardLogger(DirectoryLogger):
    """Lightning's ``TensorBoardLogger(save_dir, name="lightning_logs", version=None, log_graph=False,
    default_hp_metric=True, prefix="", sub_dir=None, **kwargs)``; ``kwargs`` go to ``SummaryWriter``.

    The hyperparameters go to the HParams tab (in the run's event file, as Lightning) and to
    ``hparams.yaml``; with ``default_hp_metric`` an ``hp_metric`` of -1 is logged beside them, as
    Lightning does, so the tab lists the run before any metric is attached.
    """

    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, save_dir: str | os.PathLike, name: str | None = "lightning_logs",
                 version: int | str | None = None, log_graph: bool = False, default_hp_metric: bool = True,
                 prefix: str = "", sub_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        if is_url(save_dir):
            raise ConfigError(f"TensorBoardLogger(save_dir={os.fspath(save_dir)!r}): torch's SummaryWriter "
                              f"writes event files to a local directory only; give a local or mounted "
                              f"directory (CSVLogger writes to a URL)")
        super().__init__(save_dir, name, version, sub_dir, prefix)
        self._log_graph = log_graph
        self._default_hp_metric = default_hp_metric
        self._writer_kwargs = kwargs
        self._writer: Any = None
        self._summary: Any = None
        self.hparams: dict[str, Any] = {}

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter`` (on ranks that do not log: a stand-in that does nothing)."""
        if not self.writes_here:
            return DummyExperiment()
        if self._writer is None:
            from torch.utils import tensorboard  # late: 0.1 s; only a run that logs pays it

            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = tensorboard.SummaryWriter(log_dir=self.log_dir, **self._writer_kwargs)
            self._summary = tensorboard.summary
        return self._writer

    def log_hyperparams(self, params: Any, metrics: dict[str, float] | None = None) -> None:
        writer = self.experiment
        if not self.writes_here:
            return
        params = dict(params) if not isinstance(params, dict) else params
        self.hparams.update(params)
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        if metrics:
            self.log_metrics(metrics, 0)
        flat = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
                for k, v in flatten_hparams(params).items()}
        # what add_hparams writes, minus its subfolder
        for event in self._summary.hparams(flat, metrics or {}):
            writer.file_writer.add_summary(event)
        write_hparams_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        writer = self.experiment
        for name, value in prefixed(metrics, self._prefix).items():
            if isinstance(value, dict):
                writer.add_scalars(name, value, step)
            else:
                writer.add_scalar(name, value, step)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        if not self._log_graph:
            return
        input_array = input_array if input_array is not None else getattr(model, "example_input_array", None)
        if input_array is None:
            raise ValueError("TensorBoardLogger(log_graph=True) needs an input: pass input_array, or set "
                             "model.example_input_array")
        self.experiment.add_graph(model, input_array)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        # The writer stays this logger's experiment (as Lightning's): a later stage writing through it
        # opens a new event file in the same directory.
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
