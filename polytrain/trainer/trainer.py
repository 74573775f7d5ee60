"""``Trainer``: the entry points (fit, validate, test, predict, save_checkpoint) and Lightning's names
for what a run holds. Loop state lives in ``fit_loop`` (``trainer/loops/progress.py``), read here through
read-only properties; every hook goes through ``hooks`` (``trainer/api/hooks.py``). It never asks which
strategy it has: everything that differs between parallelisms is behind the strategy's verbs."""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any

import torch
from omegaconf import OmegaConf

from polytrain.callbacks.base import Callback
from polytrain.callbacks.early_stopping import EarlyStopping
from polytrain.callbacks.loggers import Logger
from polytrain.callbacks.model_checkpoint import ModelCheckpoint
from polytrain.callbacks.progress_bar import ProgressBar
from polytrain.checkpoint.reading import trusting_pickled_objects
from polytrain.core import heartbeat
from polytrain.core.errors import ConfigError, StageInterrupted
from polytrain.core.nodes import node_range
from polytrain.core.rank_zero import rank_zero_info, rank_zero_only
from polytrain.core.states import FIRST_STAGE, RunningStage, TrainerFn, TrainerState, TrainerStatus
from polytrain.core.worker_failure import report_uncaught_to_launcher
from polytrain.data.loaders import stop_workers
from polytrain.strategies.base import Strategy
from polytrain.strategies.launcher import LaunchPlan, plan_launch
from polytrain.strategies.plan_spec import is_planned
from polytrain.trainer.api.datamodule import DataModule
from polytrain.trainer.api.hooks import Hooks, is_overridden
from polytrain.trainer.api.module import TrainModule
from polytrain.trainer.configuration.config import (
    TrainerConfig,
    load_config,
    parse_duration,
    trainer_to_dict,
    validate_trainer_config,
)
from polytrain.trainer.configuration.default_callbacks import build_callbacks, split_objects
from polytrain.trainer.configuration.targets import check_run_targets
from polytrain.trainer.launch.planned import agree_on_plan, plan_layout
from polytrain.trainer.launch.process_placement import apply_process_switches, launch_workers, strategy_for
from polytrain.trainer.loops import lifecycle
from polytrain.trainer.loops.data_connector import DataConnector, reported_batches
from polytrain.trainer.loops.evaluation import EvaluationLoop, PredictionRecord, results_table
from polytrain.trainer.loops.fit_loop import FitCollaborators, FitLoop
from polytrain.trainer.loops.optimization import clip_gradients
from polytrain.trainer.loops.progress import EvalProgress
from polytrain.trainer.observability.metrics import MetricCollector
from polytrain.trainer.observability.profiler import build_profiler
from polytrain.trainer.persistence.checkpoint_payload import PayloadSources, build_payload
from polytrain.trainer.persistence.resume import agree_on_checkpoint, restore_weights
from polytrain.trainer.persistence.run_directory import (
    RunDirectory,
    RunSources,
    discard_if_unused,
    resolve_path,
    settle_run_directory,
)

log = logging.getLogger("polytrain")

_LOADER_STAGE = {"validate": "val", "test": "test", "predict": "predict"}


class Trainer:
    """Keyword arguments are exactly the ``trainer:`` config section (see ``TrainerConfig``; Lightning's
    names); ``callbacks``, ``logger`` and ``strategy`` also accept objects."""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("callbacks", []) is None or isinstance(kwargs.get("callbacks"), Callback):
            # Lightning's other forms: None (no callbacks of the user's) and a single callback
            kwargs["callbacks"] = [kwargs["callbacks"]] if kwargs["callbacks"] is not None else []
        kwargs, callback_objects, objects = split_objects(kwargs)
        self.config: TrainerConfig = validate_trainer_config(kwargs)
        if "strategy" in objects:
            self.config.strategy = objects["strategy"]
        self.callbacks: list[Callback] = build_callbacks(self.config, callback_objects, objects.get("logger"))
        self.strategy: Strategy | None = None
        self.module: TrainModule | None = None
        self.datamodule: DataModule | None = None
        self.metrics = MetricCollector()
        self.profiler = build_profiler(self.config.profiler)  # trainer.profiler; a pass-through
        # by default
        self.hooks: Hooks | None = None  # the running stage's hook funnel
        self.transfer_batch: Any = None  # the running stage's batch mover (the batch-transfer hooks, if any)
        self.state = TrainerState()  # trainer.state: fn, stage, status (core/states.py)
        self.fit_loop = FitLoop(self.config, self.state)  # loop state: trainer/loops/progress.py
        self.eval_progress = EvalProgress()
        self.predict_loop = PredictionRecord()  # what prediction writers read (Lightning's name)
        self.given_loaders: dict[str, Any] = {}
        self.stage: str | None = None
        self._run_config: dict[str, Any] | None = None
        self._run_directory: RunDirectory | None = None  # settled when a stage starts (run_directory.py)
        self._strategy_started = False
        self.strategy = _strategy_before_any_stage(self.config)

    @classmethod
    def from_config(cls, config: Any) -> Trainer:
        """From a whole config (path, dict or DictConfig) or just its ``trainer`` section."""
        if isinstance(config, str):
            config = load_config(config)
        if hasattr(config, "items") and not isinstance(config, dict):
            config = OmegaConf.to_container(config, resolve=True)
        section = config.get("trainer", config) if "module" in config or "trainer" in config else config
        trainer = cls(**section)
        # Every _target_ imported and its keywords checked (nothing built): a typo fails before any worker
        # starts.
        trainer._run_config = check_run_targets(config) if "module" in config else None
        return trainer

    # ------------------------------------------------------------------ properties
    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank if self.strategy is not None else 0

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank if self.strategy is not None else 0

    @property
    def node_rank(self) -> int:
        return self.strategy.env.node_rank if self.strategy is not None else 0

    @property
    def world_size(self) -> int:
        return self.strategy.world_size if self.strategy is not None else 1

    @property
    def num_nodes(self) -> int:
        """Nodes in the job; with ``num_nodes: "MIN:MAX"``, the nodes this rendezvous admitted."""
        if self.strategy is not None:
            return self.strategy.num_nodes
        return node_range(self.config.num_nodes)[0]

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def is_logging_rank(self) -> bool:
        return self.strategy.is_logging_rank if self.strategy is not None else True

    @property
    def lightning_module(self) -> TrainModule | None:
        return self.module

    @property
    def model(self) -> Any:
        """What the step runs through: the module, or the strategy's wrapper around it."""
        return (self.strategy.model if self.strategy is not None and self.strategy.model is not None
                else self.module)

    @property
    def max_time_seconds(self) -> float | None:
        return parse_duration(self.config.max_time) if self.config.max_time is not None else None

    @property
    def run_dir(self) -> str:
        return self.config.run_dir
    default_root_dir = run_dir

    @property
    def log_dir(self) -> str:  # this run's directory, <run_dir>/version_<n>, once a stage has settled it
        return self._run_directory.path if self._run_directory is not None else self.config.run_dir

    @property
    def ckpt_path(self) -> str | None:  # the checkpoint the fit resumed from
        return self._run_directory.resume_from if self._run_directory is not None else None

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.callback

    @property
    def loggers(self) -> list[Logger]:
        return [cb for cb in self.callbacks if isinstance(cb, Logger)]

    @property
    def logger(self) -> Logger | None:
        loggers = self.loggers
        return loggers[0] if loggers else None

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        return next((cb for cb in self.callbacks if isinstance(cb, EarlyStopping)), None)

    @property
    def early_stopping_callbacks(self) -> list[EarlyStopping]:
        return [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)]

    @property
    def evaluating(self) -> bool:
        return self.state.stage is not None and self.state.stage.evaluating

    @property
    def estimated_stepping_batches(self) -> int | float:  # e.g. OneCycleLR(total_steps=...): fit_loop.py
        return self.fit_loop.estimated_stepping_batches()

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        return next((cb for cb in self.callbacks if isinstance(cb, ProgressBar)), None)

    # What runs now (trainer.state.stage): a fit's validation is `validating`, not `training`, as Lightning.
    @property
    def training(self) -> bool:
        return self.state.stage == RunningStage.TRAINING

    @property
    def validating(self) -> bool:
        return self.state.stage == RunningStage.VALIDATING

    @property
    def testing(self) -> bool:
        return self.state.stage == RunningStage.TESTING

    @property
    def predicting(self) -> bool:
        return self.state.stage == RunningStage.PREDICTING

    @property
    def interrupted(self) -> bool:
        return self.state.status == TrainerStatus.INTERRUPTED

    # ------------------------------------------------------------------ loop state (read-only; FitLoop
    # writes it)
    @property
    def current_epoch(self) -> int:
        return self.fit_loop.progress.epoch

    @property
    def global_step(self) -> int:
        return self.fit_loop.progress.global_step

    @property
    def batch_in_epoch(self) -> int:
        return self.fit_loop.progress.batch_in_epoch

    @property
    def is_last_batch(self) -> bool:  # Lightning's: the newest training batch ends its epoch
        return self.fit_loop.progress.is_last_batch

    @property
    def batches_stepped(self) -> int:
        return self.fit_loop.progress.batches_stepped

    @property
    def should_stop(self) -> bool:
        return self.fit_loop.stopping.requested

    @should_stop.setter
    def should_stop(self, value: bool) -> None:  # a callback's request (EarlyStopping);
        # agreed on by the ranks
        self.fit_loop.stopping.request(bool(value))

    @property
    def sanity_checking(self) -> bool:
        return self.state.stage == RunningStage.SANITY_CHECKING

    @property
    def num_training_batches(self) -> int | float:
        """Batches of a training epoch (``inf``: a loader without length, as Lightning reports it)."""
        return _known_or_inf(self.fit_loop.data.num_training_batches)

    @property
    def enable_validation(self) -> bool:
        """Whether a fit validates (Lightning's): the module has a ``validation_step``, something gives a val
        loader (``fit``'s argument, the DataModule's or the module's ``val_dataloader``), and
        ``limit_val_batches`` is not 0."""
        module, data = self.module, self.datamodule
        if module is None or not is_overridden(module, "validation_step", TrainModule):
            return False
        given = self.given_loaders.get("val") is not None or (
            data is not None and is_overridden(data, "val_dataloader", DataModule)) or is_overridden(
            module, "val_dataloader", TrainModule)
        return given and self.config.limit_val_batches != 0

    @property
    def num_val_batches(self) -> list[int | float]:
        """Batches a validation runs of each validation loader (Lightning's list; ``inf``: no length)."""
        data = self.fit_loop.data
        counts = reported_batches(self.config, "val", data.val_loaders, data.val_batches)
        return [_known_or_inf(n) for n in counts]

    @property
    def train_loader(self) -> Any:
        return self.fit_loop.data.train_loader

    @property
    def val_loader(self) -> Any:
        """The validation loader, or the list of them where there are several (None: none)."""
        return _one_or_list(self.fit_loop.data.val_loaders)

    train_dataloader = train_loader
    val_dataloaders = val_loader

    @property
    def test_dataloaders(self) -> Any:
        """The newest test's loader, or the list of them where there were several (None: none yet)."""
        return _one_or_list(self.eval_progress.loaders.get("test"))

    @property
    def predict_dataloaders(self) -> Any:
        return _one_or_list(self.eval_progress.loaders.get("predict"))

    @property
    def num_test_batches(self) -> list[int | float]:
        return self._reported("test")

    @property
    def num_predict_batches(self) -> list[int | float]:
        return self._reported("predict")

    def _reported(self, stage: str) -> list[int | float]:
        progress = self.eval_progress
        counts = reported_batches(self.config, stage, progress.loaders.get(stage, []),
                                  progress.limits.get(stage, []))
        return [_known_or_inf(n) for n in counts]

    @property
    def num_sanity_val_batches(self) -> list[int | float]:
        """Batches the sanity check runs of each validation loader (``num_sanity_val_steps`` at most); a
        fit's alone, as Lightning's (empty in a Trainer that only validated)."""
        if self.state.fn != "fit":
            return []
        steps = self.config.num_sanity_val_steps
        return [n if steps == -1 else min(steps, n) for n in self.num_val_batches]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The fit's optimizers themselves, as Lightning's ``trainer.optimizers`` (a callback adding a
        parameter group, or checking ``type(optimizer)``, sees the real one)."""
        optimization = self.fit_loop.optimization
        return list(optimization.optimizers) if optimization is not None else []

    @property
    def stepping_optimizers(self) -> list[Any]:
        """The same optimizers, each wrapped so ``step()`` goes through the strategy (precision, hooks, step
        counting): what ``module.optimizers()`` hands out (``StepOptimizer``)."""
        optimization = self.fit_loop.optimization
        return list(optimization.wrapped) if optimization is not None else []

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        return self.fit_loop.lr_scheduler_configs

    @property
    def guard(self) -> Any:
        return self.fit_loop.guard

    @property
    def accumulating(self) -> bool:
        """Manual optimisation: this batch is not the last of its accumulation window."""
        return bool(getattr(self.fit_loop.optimization, "accumulating", False))

    # What went to the loggers and the progress bar, as Lightning holds them: the loggers' as 0-dim tensors
    # (made when read: the loop keeps floats, already on the host), the bar's as floats.
    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        return {name: torch.tensor(value) for name, value in self.metrics.logged.items()}

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return dict(self.metrics.progress_bar)

    def __getattr__(self, name: str) -> Any:
        # Lightning code reads options as attributes (trainer.max_epochs, trainer.accumulate_grad_batches).
        config = self.__dict__.get("config")
        if config is not None and name in TrainerConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"'Trainer' object has no attribute '{name}'")

    def config_dict(self) -> dict[str, Any]:
        if self._run_config is not None:
            return self._run_config
        return {"trainer": trainer_to_dict(self.config)}

    # ------------------------------------------------------------------ entry points
    # ``weights_only`` (every entry point, as Lightning's): False unpickles whatever the ``ckpt_path`` file
    # holds (a Lightning checkpoint whose hyperparameters are objects); None or True reads tensors and plain
    # values only, which is all a polytrain checkpoint ever holds.
    def fit(self, model: TrainModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | None = None,
            weights_only: bool | None = None) -> None:
        """Train; ``ckpt_path="last"`` (or ``trainer.resume``) continues from the newest checkpoint."""
        train_dataloaders, datamodule = _datamodule_in_loaders_place(train_dataloaders, datamodule)
        self._run("fit", model, dict(train=train_dataloaders, val=val_dataloaders), datamodule, ckpt_path,
                  weights_only=weights_only)

    def validate(self, model: TrainModule | None = None, dataloaders: Any = None,
                 ckpt_path: str | None = None, verbose: bool = True,
                 datamodule: DataModule | None = None, weights_only: bool | None = None
                 ) -> list[dict[str, float]]:
        """The epoch metrics of one pass over the validation data; ``verbose`` prints them as a table on
        global rank 0, as Lightning does."""
        dataloaders, datamodule = _datamodule_in_loaders_place(dataloaders, datamodule)
        return self._run("validate", model, dict(val=dataloaders), datamodule, ckpt_path, verbose,
                         weights_only)

    def test(self, model: TrainModule | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
             verbose: bool = True, datamodule: DataModule | None = None,
             weights_only: bool | None = None) -> list[dict[str, float]]:
        dataloaders, datamodule = _datamodule_in_loaders_place(dataloaders, datamodule)
        return self._run("test", model, dict(test=dataloaders), datamodule, ckpt_path, verbose, weights_only)

    def predict(self, model: TrainModule | None = None, dataloaders: Any = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None,
                ckpt_path: str | None = None, weights_only: bool | None = None) -> list[Any]:
        """This rank's predictions, in the order of its share of the data (rank r: samples r, r+N, ...);
        None with ``return_predictions=False`` (write them with a ``BasePredictionWriter`` instead)."""
        self.predict_loop.return_predictions = return_predictions is not False
        dataloaders, datamodule = _datamodule_in_loaders_place(dataloaders, datamodule)
        return self._run("predict", model, dict(predict=dataloaders), datamodule, ckpt_path,
                         weights_only=weights_only)

    def save_checkpoint(self, filepath: str, weights_only: bool = False, async_save: bool = False) -> None:
        """Every rank calls this (a collective); ``nan_policy: error`` refuses a model holding NaN/inf.
        ``weights_only``: the model (with the loop's position and the hyperparameters) but no optimizer,
        scheduler, precision or callback state; such a file starts a fit or an evaluation, not a resume."""
        if self.guard is not None:
            self.guard.check()
        waited = self.strategy.checkpoint_io.staging_waited()  # by updates, for the last async save's copy
        with self.fit_loop.goodput.saving(self.global_step, waited):  # training is blocked for this long
            sources = PayloadSources(
                strategy=self.strategy, hooks=self.hooks, metrics=self.metrics, module=self.module,
                datamodule=self.datamodule, callbacks=self.callbacks, progress=self.fit_loop.progress,
                epoch_data=self.fit_loop.data, schedulers=self.fit_loop.lr_scheduler_configs,
                config=self.config_dict(), seed=self.config.seed, weights_only=weights_only)
            self.strategy.save_checkpoint(build_payload(sources), filepath, async_save=async_save)

    # ------------------------------------------------------------------ plumbing
    def _run(self, stage: str, model: TrainModule | None, loaders: dict[str, Any], datamodule: Any,
             ckpt_path: str | None, verbose: bool = False, weights_only: bool | None = None) -> Any:
        with trusting_pickled_objects(weights_only is False):
            return self._run_trusting(stage, model, loaders, datamodule, ckpt_path, verbose, weights_only)

    def _run_trusting(self, stage: str, model: TrainModule | None, loaders: dict[str, Any], datamodule: Any,
                      ckpt_path: str | None, verbose: bool, weights_only: bool | None) -> Any:
        model_given = model is not None
        model = model if model is not None else self.module
        if model is None:
            raise ValueError(f"trainer.{stage}() needs a TrainModule")
        if stage == "fit" and not is_overridden(model, "training_step", TrainModule):
            raise ConfigError(f"{type(model).__name__} does not define training_step(self, batch, "
                              f"batch_idx); a TrainModule must return the loss to minimise from it")
        plan = plan_launch(self.config)
        if plan.method != "here":
            if stage == "fit":
                given = dict(train_dataloaders=loaders.get("train"), val_dataloaders=loaders.get("val"))
            else:
                given = dict(dataloaders=next(iter(loaders.values())))
            user_callbacks = [cb for cb in self.callbacks if getattr(cb, "_user_given", False)]
            args = (type(self), trainer_to_dict(self.config), user_callbacks, stage, model,
                    dict(given, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only))
            out = launch_workers(plan, _stage_in_worker, args, self.config.max_restarts, stage, model,
                                 self.config.run_dir, self.config.version)
            self.metrics.callback = out["callback_metrics"]
            self._run_directory = RunDirectory(out["log_dir"], out["ckpt_path"])
            # as Lightning's spawn launcher: how the stage ended, and where its best checkpoint is
            self.state.status, self.state.fn, self.state.stage = (out["state"]["status"], out["state"]["fn"],
                                                                  out["state"]["stage"])
            if out["best_model_path"] and self.checkpoint_callback is not None:
                self.checkpoint_callback.best_model_path = out["best_model_path"]
            return out["result"]
        report_uncaught_to_launcher()  # where a launcher ran this script again: see core/worker_failure.py
        model._attach(self)  # before planning: the planner traces training_step, which may read self.trainer
        planned = self.strategy is None and plan_layout(
            self.run_sources(), self._run_config, plan, model, loaders.get("train"),
            datamodule or self.datamodule, stage, ckpt_path)
        self._setup_strategy(plan)
        self.profiler.setup(self.global_rank, self.strategy.root_device.type)
        if planned:
            # trainer.strategy plan: true (trainer/launch/planned.py)
            agree_on_plan(self.strategy, self.config)
        self.stage, self.module = stage, model
        self.datamodule = datamodule if datamodule is not None else self.datamodule
        self.given_loaders = {k: v for k, v in loaders.items() if v is not None}
        if self.datamodule is not None:
            self.datamodule.trainer = self
        self.hooks = Hooks(self, model, self.callbacks, self.datamodule, self.profiler.instrument)
        fn = TrainerFn(stage)
        self.state.fn, self.state.stage, self.state.status = fn, FIRST_STAGE[fn], TrainerStatus.RUNNING
        try:
            self._begin_stage(ckpt_path)
            result = self._run_stage(stage, ckpt_path, model_given, verbose)
        except BaseException as exc:
            self.state.status = TrainerStatus.INTERRUPTED
            if stage == "fit":  # what on_exception saves resumes at the batch that raised
                self.fit_loop.progress.rewind_to_last_step()
            heartbeat.failed(exc, self.global_step)  # peers waiting on this rank learn why, and where
            self.hooks.callbacks("on_exception", exc)
            self.hooks.datamodule("on_exception", exc)
            discard_if_unused(self._run_directory, self.is_global_zero)
            explained = heartbeat.explain(exc)  # a collective timeout -> which rank stopped, and where
            if explained is not None:
                raise explained from exc
            if isinstance(exc, KeyboardInterrupt):
                # Lightning's graceful shutdown: the callbacks saw the interrupt (on_exception); the program
                # ends with Ctrl-C's exit status and no traceback.
                rank_zero_info(f"polytrain: {stage} interrupted (Ctrl-C) at step {self.global_step}")
                raise StageInterrupted(130) from exc
            raise
        self.state.status, self.state.stage = TrainerStatus.FINISHED, None
        return result

    def _begin_stage(self, ckpt_path: str | None) -> None:
        """The stage's callbacks (the module's ``configure_callbacks`` merged in), its seeding (after them,
        where Lightning's multi-process strategies re-seed), its hook funnel and batch mover; then everything
        before its loop."""
        # From the current list, as Lightning: a callback appended to trainer.callbacks between stages stays.
        self.callbacks = lifecycle.merge_callbacks(self.callbacks, self.hooks.module("configure_callbacks"))
        self.hooks = Hooks(self, self.module, self.callbacks, self.datamodule, self.profiler.instrument)
        self.data_connector = DataConnector(self.config, self.strategy, self.hooks, self.module,
                                            self.datamodule, self.given_loaders)
        lifecycle.seed(self.strategy, self.config.seed)
        self._run_directory = settle_run_directory(self.strategy, self.run_sources(), self.stage, ckpt_path,
                                                   self._run_directory)
        init_weights = self.config.init_weights
        if init_weights is not None and self.ckpt_path is not None:
            rank_zero_info(f"trainer.init_weights={init_weights!s} is not read: the run resumes from "
                           f"{self.ckpt_path}, whose weights take precedence")
            init_weights = None
        lifecycle.begin(self.stage, strategy=self.strategy, hooks=self.hooks, module=self.module,
                        datamodule=self.datamodule, callbacks=self.callbacks,
                        float8_option=self.config.float8, init_weights=init_weights)
        self.transfer_batch = lifecycle.batch_transfer(self.strategy, self.hooks, self.metrics)
        self.evaluation = EvaluationLoop(self.strategy, self.hooks, self.metrics, self.module, self.callbacks,
                                         lifecycle.batch_transfer(self.strategy, self.hooks, self.metrics,
                                                                  indexed=True),
                                         self.predict_loop, self.eval_progress, self.state)

    def _run_stage(self, stage: str, ckpt_path: str | None, model_given: bool, verbose: bool) -> Any:
        """The stage's loop, once ``_begin_stage`` set it up, then its tear-down."""
        self.metrics.start_run()
        self.module.zero_grad()  # as Lightning: gradients left by code before the stage do not leak into it
        if stage == "fit":
            # As Lightning, anomaly detection covers the fit loop only.
            with torch.autograd.set_detect_anomaly(self.config.detect_anomaly):
                self.profiler.start(self.log_dir)
                checkpoint_io = self.strategy.checkpoint_io
                try:
                    with checkpoint_io.updates_wait_for_staging():
                        # The checkpoint was settled with the run's directory.
                        self.fit_loop.run(self.fit_collaborators(), self.ckpt_path)
                except BaseException:
                    checkpoint_io.abandon()  # a save being written still completes
                    raise
                checkpoint_io.finish()  # fit returns with the last async save on disk, or raises
                self.profiler.stop()
            result = None
        else:
            result = self._evaluate(stage, ckpt_path, model_given)
            if verbose and stage != "predict" and self.is_global_zero and result:
                print(results_table(stage, result), flush=True)
        lifecycle.end(self.hooks, stage)
        return result

    def _evaluate(self, stage: str, ckpt_path: str | None, model_given: bool) -> Any:
        """validate, test or predict: the weights to evaluate (a checkpoint, the best one after a fit when
        no model is given), the stage's loader, one pass."""
        loader_stage = _LOADER_STAGE[stage]
        best = getattr(self.checkpoint_callback, "best_model_path", None)
        if ckpt_path is None and not model_given and best:
            warnings.warn(f"trainer.{stage}() without a model after fit evaluates the best checkpoint "
                          f"({best}), as Lightning does; pass the model (current weights) or ckpt_path to "
                          f"choose", stacklevel=5)
            ckpt_path = "best"
        if ckpt_path is not None:
            sources = self.run_sources()
            path = agree_on_checkpoint(self.strategy, lambda: resolve_path(sources, ckpt_path, stage=stage),
                                       ckpt_path, self.run_dir)
            restore_weights(path, self.strategy, self.hooks)
        connector = self.data_connector
        if connector.disabled(loader_stage):
            # limit_<stage>_batches=0: as Lightning, the loop does not run and no loader is asked for
            return None if stage == "predict" else []
        with torch.no_grad():  # as Lightning: the loader is asked for inside the (gradient-free) evaluation
            loaders = connector.request_eval(loader_stage)
        if not loaders:
            raise ConfigError(f"no {loader_stage} data: pass dataloaders to {stage}() or define "
                              f"{loader_stage}_dataloader() on {type(self.module).__name__} "
                              f"(or its DataModule)")
        limits = [connector.batch_limit(loader_stage, loader) for loader in loaders]
        if loader_stage == "val":  # trainer.val_dataloaders / num_val_batches show this validation's
            self.fit_loop.data.use_val(loaders, limits)
        else:
            self.eval_progress.loaders[loader_stage] = loaders
            self.eval_progress.limits[loader_stage] = limits
        try:
            result = self.evaluation.run(loaders, loader_stage, limits, entry=stage, epoch=self.current_epoch,
                                         global_step=self.global_step)
        finally:  # the stage is over: a persistent_workers loader's workers stop with it
            for loader in loaders:
                stop_workers(None, loader, keep_persistent=False)
        if stage == "predict":
            return result if self.predict_loop.return_predictions else None
        return result

    def run_sources(self) -> RunSources:
        """What decides where this Trainer's runs write and which checkpoint they resume."""
        return RunSources(config=self.config, loggers=self.loggers,
                          checkpoint_callback=self.checkpoint_callback)

    def fit_collaborators(self) -> FitCollaborators:
        """What this fit's loop works with, named (it is handed nothing else)."""
        return FitCollaborators(
            strategy=self.strategy, hooks=self.hooks, metrics=self.metrics, profiler=self.profiler,
            loaders=self.data_connector, evaluation=self.evaluation,
            transfer_batch=self.transfer_batch, module=self.module, datamodule=self.datamodule,
            callbacks=self.callbacks, loggers=self.loggers if self.is_logging_rank else [],
            log_dir=self.log_dir)

    def _setup_strategy(self, plan: LaunchPlan) -> None:
        if self._strategy_started:
            return
        if self.strategy is None:  # planned: the planner settled the degrees just now
            self.strategy = strategy_for(self.config, plan)
        apply_process_switches(self.config)
        self.strategy.setup_environment()
        self._strategy_started = True
        rank_zero_only.rank = self.strategy.global_rank  # what @rank_zero_only in user code reads
        self.metrics.device = self.strategy.collective_device
        heartbeat.start(self.strategy.global_rank, self.strategy.world_size, self.config.timeout)

    # ------------------------------------------------------------------ what the module calls
    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> None:
        """``TrainModule.clip_gradients``: unscaled first; a non-finite norm is the non-finite guard's to
        judge."""
        clip_gradients(self.strategy, self.guard, optimizer, value, algorithm)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.module.automatic_optimization:
            raise RuntimeError("manual_backward is for manual optimisation: set self.automatic_optimization "
                               "= False in __init__, or return the loss from training_step")
        self.strategy.manual_backward(loss, *args, **kwargs)


def _strategy_before_any_stage(config: TrainerConfig) -> Strategy | None:
    """``trainer.strategy`` from construction, as Lightning's (code wraps ``trainer.strategy.backward``
    before ``fit``), where the config alone settles it: not under ``plan: true`` (the planner needs the
    model, so the strategy is built when a stage starts) and not where a stage launches worker processes
    (each builds its own). Built only: its process group starts with the first stage. A layout this
    machine cannot run (GPU indices on a CPU machine) is still a valid config here; the stage that would
    run it says why it cannot, so nothing is built now."""
    if is_planned(config.strategy):
        return None
    try:
        plan = plan_launch(config)
        return strategy_for(config, plan) if plan.method == "here" else None
    except ConfigError:
        return None  # raised again, in the same words, when a stage starts


def _datamodule_in_loaders_place(loaders: Any,
                                 datamodule: DataModule | None) -> tuple[Any, DataModule | None]:
    """``trainer.fit(model, dm)`` / ``trainer.validate(model, dm)``: as Lightning, a DataModule passed where
    the loaders go is the stage's DataModule."""
    if not isinstance(loaders, DataModule):
        return loaders, datamodule
    if datamodule is not None:
        raise ValueError(f"a DataModule was passed both as the loaders ({type(loaders).__name__}) and as "
                         f"datamodule= ({type(datamodule).__name__}); pass one")
    return None, loaders


def _known_or_inf(count: int | None) -> int | float:
    return float("inf") if count is None else count


def _one_or_list(loaders: list[Any] | None) -> Any:
    """A stage's loaders as Lightning's trainer shows them: the loader, a list of several, or None."""
    if not loaders:
        return None
    return loaders[0] if len(loaders) == 1 else list(loaders)


def _stage_in_worker(trainer_cls: type[Trainer], trainer_kwargs: dict[str, Any], callbacks: list[Any],
                     stage: str, module: TrainModule, kwargs: dict[str, Any], result_path: str) -> None:
    """What each worker process runs for a method called outside any launcher (``launch_workers``): its own
    Trainer and stage; global rank 0 saves what the launching Trainer shows afterwards."""
    # torch.multiprocessing hands tensors to spawned workers in shared memory: without a private
    # copy every rank would step the same parameters (one update per rank per step).
    module = copy.deepcopy(module)
    trainer_kwargs = {**trainer_kwargs, "callbacks": list(trainer_kwargs["callbacks"]) + callbacks}
    trainer = trainer_cls(**trainer_kwargs)
    result = getattr(trainer, stage)(module, **kwargs)
    # Every rank: under sharded strategies (fsdp, tensor parallel) gathering the weights is a collective.
    state_dict = trainer.strategy.module_state_dict()
    if trainer.is_global_zero:
        # Hand the trained weights and the result back to the launching process.
        saver = trainer.checkpoint_callback
        torch.save({"state_dict": state_dict, "result": result, "log_dir": trainer.log_dir,
                    "ckpt_path": trainer.ckpt_path, "state": dataclasses.asdict(trainer.state),
                    "best_model_path": getattr(saver, "best_model_path", None),
                    "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   result_path)
    trainer.strategy.teardown()
