"""Loggers for experiment trackers, optional dependencies: MLflow (``pip install polytrain[mlflow]``) and
Weights & Biases (``pip install polytrain[wandb]``). Each receives what the CSV logger writes: the metrics
of every logging step with their step (the optimizer step count) and ``epoch``, and the hyperparameters.

Their libraries are imported when the first value is written (on the logging rank only), so a job
that does not use them never pays for the import; a missing library is reported when the logger is
built, before any process starts.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from typing import Any

from polytrain.callbacks.loggers import Logger, flatten_hparams

_INVALID_MLFLOW_CHARS = re.compile(r"[^a-zA-Z0-9_\-./ ]")


def require(module: str, extra: str) -> None:
    """Fail at construction, naming the install command, when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"this logger needs the '{module}' package, which is not installed: "
                          f"pip install polytrain[{extra}]  (or: pip install {module})")


class MLFlowLogger(Logger):
    """Metrics and parameters to an MLflow tracking server or a local store (Lightning's ``MLFlowLogger``).

    ``tracking_uri`` (else ``$MLFLOW_TRACKING_URI``, else ``file:<save_dir>``). MLflow 3 refuses its
    file store unless ``MLFLOW_ALLOW_FILE_STORE=true``; for the ``file:`` store this logger chose itself
    (none configured) it sets that, so a run works out of the box. Names MLflow rejects have the
    offending characters replaced by ``_``.
    """

    def __init__(self, experiment_name: str = "polytrain", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, Any] | None = None, save_dir: str = "./mlruns",
                 run_id: str | None = None) -> None:
        require("mlflow", "mlflow")
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        configured = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = configured or "file:" + os.path.abspath(save_dir)
        self._own_file_store = configured is None
        self._run_id = run_id
        self._client: Any = None
        self._entities: Any = None
        self._params_logged: set[str] = set()

    @property
    def experiment(self) -> Any:
        """The ``MlflowClient`` (Lightning's name for a logger's underlying object)."""
        if self._client is None:
            if self._own_file_store:
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            import mlflow  # late: optional dependency (polytrain[mlflow]), ~1 s to import

            self._client, self._entities = mlflow.MlflowClient(tracking_uri=self.tracking_uri), mlflow.entities
        return self._client

    @property
    def run_id(self) -> str:
        client = self.experiment
        if self._run_id is None:
            found = client.get_experiment_by_name(self.experiment_name)
            experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment_name)
            run = client.create_run(experiment_id, run_name=self.run_name,
                                    tags={k: str(v) for k, v in self.tags.items()})
            self._run_id = run.info.run_id
        return self._run_id

    @staticmethod
    def _name(key: str) -> str:
        return _INVALID_MLFLOW_CHARS.sub("_", key)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        run_id, stamp = self.run_id, int(time.time() * 1000)
        entries = [self._entities.Metric(self._name(k), float(v), stamp, int(step)) for k, v in metrics.items()]
        self.experiment.log_batch(run_id, metrics=entries)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        run_id = self.run_id
        # MLflow parameters cannot change once logged: a later stage only adds new names.
        flat = {self._name(k): str(v)[:6000] for k, v in flatten_hparams(params).items()}
        fresh = [self._entities.Param(k, v) for k, v in flat.items() if k not in self._params_logged]
        if fresh:
            self.experiment.log_batch(run_id, params=fresh)
            self._params_logged.update(p.key for p in fresh)

    def _finish(self, status: str) -> None:
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id, status)

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        if trainer.is_logging_rank:
            self._finish("FINISHED")

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        if trainer.is_logging_rank:
            self._finish("FAILED")


class WandbLogger(Logger):
    """Metrics and the config to Weights & Biases (Lightning's ``WandbLogger``). ``offline=True`` (or
    ``WANDB_MODE=offline``) writes the run under ``<save_dir>/wandb/`` for a later ``wandb sync``.

    W&B wants its own step to only grow, and evaluation step values have their own axis, so (as
    Lightning) each row carries ``trainer/global_step`` and the charts use it as their x axis. The run
    is finished when each stage ends; a later stage on the same logger resumes it (same id).
    """

    def __init__(self, name: str | None = None, save_dir: str = ".", project: str = "polytrain",
                 offline: bool = False, id: str | None = None, **init_kwargs: Any) -> None:  # noqa: A002 - W&B's name
        require("wandb", "wandb")
        self.name = name
        self.save_dir = save_dir
        self.project = project
        self.offline = offline
        self.id = id
        self.init_kwargs = init_kwargs
        self._run: Any = None

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run."""
        if self._run is None:
            import wandb  # late: optional dependency (polytrain[wandb]), ~1 s to import

            os.makedirs(self.save_dir, exist_ok=True)
            kwargs: dict[str, Any] = dict(project=self.project, name=self.name, dir=self.save_dir, **self.init_kwargs)
            if self.offline:
                kwargs["mode"] = "offline"
            if self.id is not None:
                kwargs.update(id=self.id, resume="allow")
            self._run = wandb.init(**kwargs)
            self.id = self._run.id
            self._run.define_metric("trainer/global_step")
            self._run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return self._run

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.experiment.log({**metrics, "trainer/global_step": int(step)})

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.experiment.config.update(params, allow_val_change=True)

    def _finish(self, exit_code: int) -> None:
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        if trainer.is_logging_rank:
            self._finish(0)

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        if trainer.is_logging_rank:
            self._finish(1)
