"""``Trainer``: builds the strategy, runs the loops, owns loop state. It never asks which strategy
it has — everything that differs between parallelisms is behind the strategy's verbs."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from omegaconf import OmegaConf

from polytrain.callbacks.base import Callback
from polytrain.callbacks.checkpoint import ModelCheckpoint
from polytrain.callbacks.early_stopping import EarlyStopping
from polytrain.callbacks.loggers import Logger
from polytrain.callbacks.progress import ProgressBar
from polytrain.core import divergence, heartbeat
from polytrain.core.errors import ConfigError
from polytrain.core.rng import enable_deterministic
from polytrain.parallel.activation_checkpointing import resolve_checkpointing
from polytrain.parallel.compile import resolve_compile
from polytrain.strategies.base import Strategy
from polytrain.strategies.launcher import LaunchPlan, plan_launch
from polytrain.strategies.registry import build_strategy, strategy_class
from polytrain.trainer import lifecycle
from polytrain.trainer.checkpoint import build_payload
from polytrain.trainer.config import (
    TrainerConfig,
    load_config,
    parse_max_time,
    trainer_to_dict,
    validate_trainer_config,
)
from polytrain.trainer.data_connector import batch_limit, request_loader
from polytrain.trainer.datamodule import DataModule
from polytrain.trainer.default_callbacks import build_callbacks
from polytrain.trainer.entry_points import run_stage
from polytrain.trainer.launch import launch_from_trainer
from polytrain.trainer.metrics import MetricCollector
from polytrain.trainer.module import TrainModule, overrides
from polytrain.trainer.profiler import build_profiler
from polytrain.trainer.steps import StepMixin

log = logging.getLogger("polytrain")

_OBJECT_KEYS = ("callbacks", "logger", "strategy")


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, dict))


class Trainer(StepMixin):
    """Keyword arguments are exactly the ``trainer:`` config section (see ``TrainerConfig``; Lightning's
    names); ``callbacks``, ``logger`` and ``strategy`` also accept objects."""

    def __init__(self, **kwargs: Any) -> None:
        objects = {k: kwargs.pop(k) for k in _OBJECT_KEYS if k in kwargs and not _is_plain(kwargs[k])}
        callback_objects = []
        if isinstance(kwargs.get("callbacks"), (list, tuple)):
            callback_objects = [c for c in kwargs["callbacks"] if isinstance(c, Callback)]
            kwargs["callbacks"] = [c for c in kwargs["callbacks"] if not isinstance(c, Callback)]
        if isinstance(objects.get("callbacks"), (list, tuple)):
            callback_objects += list(objects.pop("callbacks"))
        elif isinstance(objects.get("callbacks"), Callback):
            callback_objects.append(objects.pop("callbacks"))
        self.config: TrainerConfig = validate_trainer_config(kwargs)
        if "strategy" in objects:
            self.config.strategy = objects["strategy"]
        self.base_callbacks: list[Callback] = build_callbacks(self.config, callback_objects, objects.get("logger"))
        self.callbacks: list[Callback] = list(self.base_callbacks)
        self.strategy: Strategy | None = None
        self.module: TrainModule | None = None
        self.datamodule: DataModule | None = None
        self.metrics = MetricCollector()
        self.profiler = build_profiler(self.config.profiler, self)  # trainer.profiler; a pass-through by default
        self.hooks: Any = None
        self.guard: Any = None
        self.optimizers: list[Any] = []
        self.lr_scheduler_configs: list[Any] = []
        self.given_loaders: dict[str, Any] = {}
        self.train_loader: Any = None
        self.val_loader: Any = None
        self.current_epoch = 0
        self.global_step = 0
        self.batch_in_epoch = 0
        self.batches_stepped = 0  # batches after which an optimizer stepped: the logging cadence
        self.eval_batches_seen: dict[str, int] = {}  # per entry point: the step axis of evaluation step values
        self.should_stop = False
        self.sanity_checking = False
        self.accumulating = False  # manual optimisation: this batch is not the last of its window
        self.skip_this_step = False
        self.stage: str | None = None
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.pending_rng: dict[str, Any] | None = None
        self.loader_rng: torch.Tensor | None = None  # what this epoch's iterator seeded its workers from
        self.resumed_mid_epoch = False
        self.resumed_loop: dict[str, Any] | None = None
        self.epoch_complete = True
        self.at_epoch_end = False  # True while on_train_epoch_end hooks run after a complete epoch
        self.num_training_batches: int | None = None
        self.num_val_batches: int | None = None
        self.train_batch_size: int | None = None
        self.sample_base = (0, 0)
        self.fit_ckpt_path: str | None = None
        self._run_config: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, config: Any) -> Trainer:
        """From a whole config (path, dict or DictConfig) or just its ``trainer`` section."""
        if isinstance(config, str):
            config = load_config(config)
        if hasattr(config, "items") and not isinstance(config, dict):
            config = OmegaConf.to_container(config, resolve=True)
        section = config.get("trainer", config) if "module" in config or "trainer" in config else config
        trainer = cls(**section)
        trainer._run_config = config if "module" in config else None
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
        return self.config.num_nodes

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
        return self.strategy.model if self.strategy is not None and self.strategy.model is not None else self.module

    @property
    def max_time_seconds(self) -> float | None:
        return parse_max_time(self.config.max_time) if self.config.max_time is not None else None

    @property
    def run_dir(self) -> str:
        return self.config.run_dir

    default_root_dir = run_dir

    @property
    def log_dir(self) -> str:
        return self.config.run_dir

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.callback

    @callback_metrics.setter
    def callback_metrics(self, values: dict[str, torch.Tensor]) -> None:
        self.metrics.callback = dict(values)

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
        return self.stage in ("validate", "test") or self.sanity_checking

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps ``fit`` will take (Lightning's; e.g. ``OneCycleLR(total_steps=...)`` in
        ``configure_optimizers``). As Lightning, asking before training requests the training loader
        early (this fit then uses that loader); a loader without length gives ``inf``."""
        cfg = self.config
        if self.train_loader is None:
            self.train_loader = request_loader(self, "train")
            self.__dict__["train_loader_early"] = True
        batches = batch_limit(self, "train", self.train_loader) if self.train_loader is not None else 0
        epochs = 1 if cfg.fast_dev_run else cfg.max_epochs if cfg.max_epochs is not None else \
            (1000 if cfg.max_steps < 0 else float("inf"))
        steps = float("inf") if batches is None else math.ceil(batches / cfg.accumulate_grad_batches) * max(epochs, 1)
        return min(steps, cfg.max_steps) if cfg.max_steps >= 0 else steps

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        return next((cb for cb in self.callbacks if isinstance(cb, ProgressBar)), None)

    @property
    def train_dataloader(self) -> Any:
        return self.train_loader

    @property
    def val_dataloaders(self) -> Any:
        return self.val_loader

    @property
    def training(self) -> bool:
        return self.stage == "fit" and not self.sanity_checking

    @property
    def validating(self) -> bool:
        return self.stage == "validate" or self.sanity_checking

    @property
    def testing(self) -> bool:
        return self.stage == "test"

    @property
    def predicting(self) -> bool:
        return self.stage == "predict"

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
    def fit(self, model: TrainModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | None = None) -> None:
        """Train; ``ckpt_path="last"`` (or ``trainer.resume``) continues from the newest checkpoint."""
        if isinstance(train_dataloaders, DataModule):
            train_dataloaders, datamodule = None, train_dataloaders
        self._run("fit", model, dict(train=train_dataloaders, val=val_dataloaders), datamodule, ckpt_path)

    def validate(self, model: TrainModule | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
                 verbose: bool = True, datamodule: DataModule | None = None) -> list[dict[str, float]]:
        return self._run("validate", model, dict(val=dataloaders), datamodule, ckpt_path)

    def test(self, model: TrainModule | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
             verbose: bool = True, datamodule: DataModule | None = None) -> list[dict[str, float]]:
        return self._run("test", model, dict(test=dataloaders), datamodule, ckpt_path)

    def predict(self, model: TrainModule | None = None, dataloaders: Any = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None,
                ckpt_path: str | None = None) -> list[Any]:
        """This rank's predictions, in the order of its share of the data (rank r: samples r, r+N, ...)."""
        return self._run("predict", model, dict(predict=dataloaders), datamodule, ckpt_path)

    def save_checkpoint(self, filepath: str, weights_only: bool = False) -> None:
        """Every rank must call this (it gathers RNG states and meets at a barrier). Under
        ``nan_policy: error`` a model that already holds NaN/inf is refused before anything is written."""
        if self.guard is not None:
            self.guard.check()
        self.strategy.save_checkpoint(build_payload(self, epoch_done=self.at_epoch_end), filepath)

    # ------------------------------------------------------------------ plumbing
    def _run(self, stage: str, model: TrainModule | None, loaders: dict[str, Any], datamodule: Any,
             ckpt_path: str | None) -> Any:
        model_given = model is not None
        model = model if model is not None else self.module
        if model is None:
            raise ValueError(f"trainer.{stage}() needs a TrainModule")
        if stage == "fit" and not overrides(model, "training_step"):
            raise ConfigError(f"{type(model).__name__} does not define training_step(self, batch, batch_idx); "
                              f"a TrainModule must return the loss to minimise from it")
        plan = plan_launch(self.config)
        if plan.method != "here":
            given = dict(train_dataloaders=loaders.get("train"), val_dataloaders=loaders.get("val")) \
                if stage == "fit" else dict(dataloaders=next(iter(loaders.values())))
            return launch_from_trainer(self, plan, stage, model, dict(given, datamodule=datamodule, ckpt_path=ckpt_path))
        self._setup_strategy(plan)
        self.stage, self.module = stage, model
        self.datamodule = datamodule if datamodule is not None else self.datamodule
        self.given_loaders = {k: v for k, v in loaders.items() if v is not None}
        model._attach(self)
        if self.datamodule is not None:
            self.datamodule.trainer = self
        try:
            return run_stage(self, stage, ckpt_path, model_given)
        except BaseException as exc:
            heartbeat.failed(exc, self.global_step)  # peers waiting on this rank learn why, and where
            for cb in self.callbacks:
                cb.on_exception(self, model, exc)
            if self.datamodule is not None:
                self.datamodule.on_exception(exc)
            explained = heartbeat.explain(exc)  # a collective timeout -> which rank stopped, and where
            if explained is not None:
                raise explained from exc
            raise

    def _setup_strategy(self, plan: LaunchPlan) -> None:
        if self.strategy is not None:
            return
        if isinstance(self.config.strategy, Strategy):
            self.strategy = self.config.strategy
        else:
            spec = dict(self.config.strategy)
            spec["name"] = plan.strategy_name
            if self.config.sync_batchnorm and "sync_batchnorm" in strategy_class(spec["name"]).Options.__dataclass_fields__:
                spec["sync_batchnorm"] = True  # Lightning's Trainer(sync_batchnorm=True); one process: nothing to sync
            self.strategy = build_strategy(
                spec, accelerator=plan.accelerator, devices=plan.devices, num_nodes=plan.num_nodes,
                precision=self.config.precision, timeout=self.config.timeout, env=plan.env,
            )
        if self.config.benchmark is not None:
            torch.backends.cudnn.benchmark = self.config.benchmark
        self.strategy.compile_options = resolve_compile(self.config.compile)
        self.strategy.checkpointing_options = resolve_checkpointing(self.config.activation_checkpointing)
        if self.config.deterministic:
            enable_deterministic()
        if self.config.detect_divergence:
            divergence.enable(self.config.timeout)  # before the process group starts
        self.strategy.setup_environment()
        self.metrics.device = self.strategy.collective_device
        heartbeat.start(self.strategy.global_rank, self.strategy.world_size, self.config.timeout)

    def restore_loop(self, loop: dict[str, Any]) -> None:
        self.current_epoch = int(loop["epoch"])
        self.global_step = int(loop["global_step"])
        self.batch_in_epoch = int(loop["batch_in_epoch"])
        self.batches_stepped = int(loop.get("batches_stepped", self.global_step))
        self.resumed_mid_epoch = self.batch_in_epoch > 0
        self.resumed_loop = loop  # sample_offset + dp_size: re-split if the data-parallel size changed

    def call_hook(self, name: str, *args: Any) -> Any:
        """The funnel for hooks a strategy fires inside its step: callbacks first, then the module."""
        return self.hooks(name, *args)

    def bind_strategy_hooks(self) -> None:
        backward = self.module.backward if self.hooks.module_overrides("backward") else None
        self.strategy.bind_hooks(self.call_hook, backward, self.hooks.batch_plan)
        lifecycle.bind_transfer(self)
