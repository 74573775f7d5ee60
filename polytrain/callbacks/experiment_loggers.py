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

from polytrain.callbacks.loggers import DummyExperiment, Logger, flatten_hparams, prefixed

_INVALID_MLFLOW_CHARS = re.compile(r"[^a-zA-Z0-9_\-./ ]")


def require(module: str, extra: str) -> None:
    """Fail at construction, naming the install command, when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"this logger needs the '{module}' package, which is not installed: "
                          f"pip install polytrain[{extra}]  (or: pip install {module})")


class MLFlowLogger(Logger):
    """Metrics and parameters to an MLflow tracking server or a local store: Lightning's
    ``MLFlowLogger(experiment_name="lightning_logs", run_name=None, tracking_uri=None, tags=None,
    save_dir="./mlruns", log_model=False, prefix="", artifact_location=None, run_id=None)``.

    ``tracking_uri`` (else ``$MLFLOW_TRACKING_URI``, else ``file:<save_dir>``). MLflow 3 refuses its
    file store unless ``MLFLOW_ALLOW_FILE_STORE=true``; for the ``file:`` store this logger chose itself
    (none configured) it sets that, so a run works out of the box. Names MLflow rejects have the
    offending characters replaced by ``_``. ``log_model``: ``True`` uploads the checkpoints the
    ``ModelCheckpoint`` kept when the stage ends, ``"all"`` each one as it is written.
    ``name`` is the experiment id, ``version`` the run id, as Lightning.
    """

    def __init__(self, experiment_name: str = "lightning_logs", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, Any] | None = None,
                 save_dir: str = "./mlruns",
                 log_model: bool | str = False, prefix: str = "", artifact_location: str | None = None,
                 run_id: str | None = None, checkpoint_path_prefix: str = "",
                 synchronous: bool | None = None) -> None:
        require("mlflow", "mlflow")
        if log_model not in (False, True, "all"):
            raise ValueError(f"MLFlowLogger log_model={log_model!r}; valid: False, True, 'all'")
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        configured = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = configured or "file:" + os.path.abspath(save_dir)
        self._own_file_store = configured is None
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._checkpoint_prefix = checkpoint_path_prefix
        self._synchronous = synchronous
        self._run_id = run_id
        self._experiment_id: str | None = None
        self._client: Any = None
        self._entities: Any = None
        self._params_logged: set[str] = set()
        self._uploaded: set[str] = set()
        self._checkpoint_callback: Any = None

    @property
    def name(self) -> str | None:
        self.run_id  # noqa: B018 - creates the experiment and the run on first use
        return self._experiment_id

    @property
    def version(self) -> str | None:
        return self.run_id

    @property
    def save_dir(self) -> str | None:
        return self.tracking_uri[len("file:"):] if self.tracking_uri.startswith("file:") else None

    @property
    def experiment(self) -> Any:
        """The ``MlflowClient`` (Lightning's name for a logger's underlying object); a stand-in that
        does nothing on ranks that do not log."""
        if not self.writes_here:
            return DummyExperiment()
        if self._client is None:
            if self._own_file_store:
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            import mlflow  # late: optional dependency (polytrain[mlflow]), ~1 s to import

            self._client, self._entities = (mlflow.MlflowClient(tracking_uri=self.tracking_uri),
                                            mlflow.entities)
        return self._client

    @property
    def run_id(self) -> str:
        client = self.experiment
        if self._run_id is None:
            found = client.get_experiment_by_name(self.experiment_name)
            self._experiment_id = found.experiment_id if found is not None else client.create_experiment(
                self.experiment_name, artifact_location=self._artifact_location)
            run = client.create_run(self._experiment_id, run_name=self.run_name,
                                    tags={k: str(v) for k, v in self.tags.items()})
            self._run_id = run.info.run_id
        elif self._experiment_id is None:
            self._experiment_id = client.get_run(self._run_id).info.experiment_id
        return self._run_id

    @staticmethod
    def _name(key: str) -> str:
        return _INVALID_MLFLOW_CHARS.sub("_", key)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        run_id, stamp = self.run_id, int(time.time() * 1000)
        entries = [self._entities.Metric(self._name(k), float(v), stamp, int(step or 0))
                   for k, v in prefixed(metrics, self._prefix).items()]
        self.experiment.log_batch(run_id, metrics=entries)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        run_id = self.run_id
        # MLflow parameters cannot change once logged: a later stage only adds new names.
        flat = {self._name(k): str(v)[:6000] for k, v in flatten_hparams(params).items()}
        fresh = [self._entities.Param(k, v) for k, v in flat.items() if k not in self._params_logged]
        if fresh:
            self.experiment.log_batch(run_id, params=fresh)
            self._params_logged.update(p.key for p in fresh)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._checkpoint_callback = checkpoint_callback
        if self._log_model == "all":
            self._upload(checkpoint_callback)

    def _upload(self, callback: Any) -> None:
        """The checkpoint files the callback keeps, under ``<checkpoint_path_prefix>model/checkpoints/``."""
        paths = [p for _, p in getattr(callback, "kept", [])] + [getattr(callback, "last_model_path", None)]
        for path in paths:
            if path and os.path.isfile(path) and path not in self._uploaded:
                self.experiment.log_artifact(self.run_id, path,
                                             artifact_path=f"{self._checkpoint_prefix}model/checkpoints")
                self._uploaded.add(path)

    def finalize(self, status: str) -> None:
        if self._client is None or self._run_id is None:
            return
        if self._log_model is True and self._checkpoint_callback is not None and status == "success":
            self._upload(self._checkpoint_callback)
        self._client.set_terminated(self._run_id,
                                    {"success": "FINISHED", "failed": "FAILED"}.get(status, status))


def _wandb() -> Any:
    import wandb  # late: optional dependency (polytrain[wandb]), ~1 s to import

    return wandb


class WandbLogger(Logger):
    """Metrics and the config to Weights & Biases: Lightning's ``WandbLogger(name=None, save_dir=".",
    version=None, offline=False, dir=None, id=None, anonymous=None, project=None, log_model=False,
    experiment=None, prefix="", checkpoint_name=None, **kwargs)``; ``kwargs`` go to ``wandb.init``.
    ``offline=True`` (or ``WANDB_MODE=offline``) writes the run under ``<save_dir>/wandb/`` for a later
    ``wandb sync``. ``log_model``: ``True`` uploads the kept checkpoints as an artifact when the stage
    ends, ``"all"`` each one as it is written. ``watch``, ``log_image``, ``log_text``, ``log_table`` as
    Lightning's.

    W&B wants its own step to only grow, and evaluation step values have their own axis, so (as
    Lightning) each row carries ``trainer/global_step`` and the charts use it as their x axis. The run
    is finished when each stage ends; a later stage on the same logger resumes it (same id).
    """

    def __init__(self, name: str | None = None, save_dir: str = ".", version: str | None = None,
                 offline: bool = False, dir: str | None = None, id: str | None = None,  # noqa: A002 - Lightning's names
                 anonymous: bool | None = None, project: str | None = None, log_model: bool | str = False,
                 experiment: Any = None, prefix: str = "", checkpoint_name: str | None = None,
                 **init_kwargs: Any) -> None:
        require("wandb", "wandb")
        if log_model not in (False, True, "all"):
            raise ValueError(f"WandbLogger log_model={log_model!r}; valid: False, True, 'all'")
        self._name = name
        self._save_dir = dir if dir is not None else save_dir
        self.project = project or os.environ.get("WANDB_PROJECT", "lightning_logs")
        self.offline = offline
        self.id = id or version
        self.init_kwargs = dict(init_kwargs)
        if anonymous:
            self.init_kwargs["anonymous"] = "allow"
        self._log_model = log_model
        self._prefix = prefix
        self._checkpoint_name = checkpoint_name
        self._run: Any = experiment
        self._checkpoint_callback: Any = None
        self._uploaded: set[str] = set()

    @property
    def name(self) -> str | None:
        return self._run.name if self._run is not None else self._name

    @property
    def version(self) -> str | None:
        return self._run.id if self._run is not None else self.id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run (a stand-in that does nothing on ranks that do not log)."""
        if not self.writes_here:
            return DummyExperiment()
        if self._run is None:
            wandb = _wandb()

            os.makedirs(self.save_dir, exist_ok=True)
            kwargs: dict[str, Any] = dict(project=self.project, name=self._name, dir=self.save_dir,
                                          **self.init_kwargs)
            if self.offline:
                kwargs["mode"] = "offline"
            if self.id is not None:
                kwargs.update(id=self.id, resume="allow")
            self._run = wandb.init(**kwargs)
            self.id = self._run.id
            self._run.define_metric("trainer/global_step")
            self._run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return self._run

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = prefixed(metrics, self._prefix)
        self.experiment.log(row if step is None else {**row, "trainer/global_step": int(step)})

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.experiment.config.update(params, allow_val_change=True)

    def watch(self, model: Any, log: str | None = "gradients", log_freq: int = 100,
              log_graph: bool = True) -> None:
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    def log_text(self, key: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                 dataframe: Any = None, step: int | None = None) -> None:
        self.log_table(key, columns, data, dataframe, step)

    def log_table(self, key: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None) -> None:
        wandb = _wandb()
        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.log_metrics({key: table}, step)

    def log_image(self, key: str, images: list[Any], step: int | None = None, **kwargs: Any) -> None:
        wandb = _wandb()
        extras = [{k: v[i] for k, v in kwargs.items()} for i in range(len(images))]
        self.log_metrics({key: [wandb.Image(img, **extra) for img, extra in zip(images, extras)]}, step)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._checkpoint_callback = checkpoint_callback
        if self._log_model == "all":
            self._upload(checkpoint_callback)

    def _upload(self, callback: Any) -> None:
        wandb = _wandb()
        paths = [p for _, p in getattr(callback, "kept", [])] + [getattr(callback, "last_model_path", None)]
        for path in paths:
            if path and os.path.isfile(path) and path not in self._uploaded:
                artifact = wandb.Artifact(self._checkpoint_name or f"model-{self.experiment.id}",
                                          type="model")
                artifact.add_file(path, name="model.ckpt")
                self.experiment.log_artifact(artifact)
                self._uploaded.add(path)

    def finalize(self, status: str) -> None:
        if self._run is None:
            return
        if self._log_model is True and self._checkpoint_callback is not None and status == "success":
            self._upload(self._checkpoint_callback)
        self._run.finish(exit_code=0 if status == "success" else 1)
        self._run = None
