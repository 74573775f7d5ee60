"""``Trainer``: builds the strategy, runs the loops, owns loop state. It never asks which strategy
it has — everything that differs between parallelisms is behind the strategy's verbs."""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import OmegaConf

from polytrain.callbacks.base import Callback
from polytrain.callbacks.checkpoint import ModelCheckpoint
from polytrain.callbacks.loggers import Logger
from polytrain.core import divergence, heartbeat
from polytrain.core.errors import ConfigError
from polytrain.core.rng import enable_deterministic
from polytrain.strategies.base import Strategy
from polytrain.strategies.launcher import LaunchPlan, plan_launch
from polytrain.strategies.registry import build_strategy
from polytrain.trainer import loops
from polytrain.trainer.checkpoint import build_payload
from polytrain.trainer.config import TrainerConfig, load_config, trainer_to_dict, validate_trainer_config
from polytrain.trainer.default_callbacks import build_callbacks
from polytrain.trainer.launch import launch_from_trainer
from polytrain.trainer.metrics import MetricCollector
from polytrain.trainer.module import TrainModule, overrides

log = logging.getLogger("polytrain")

_OBJECT_KEYS = ("callbacks", "logger", "strategy")


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, dict))


def _overridden(obj: Any, name: str, base: type) -> bool:
    """False only when ``obj.name`` is ``base``'s own method: not redefined by its class or instance."""
    return name in getattr(obj, "__dict__", {}) or getattr(type(obj), name, None) is not getattr(base, name, None)


def _hook_plan(callbacks: list[Callback], module: Any, name: str) -> tuple[list[Callback], bool]:
    return [cb for cb in callbacks if _overridden(cb, name, Callback)], _overridden(module, name, TrainModule)


class Trainer:
    """Keyword arguments are exactly the ``trainer:`` config section (see ``TrainerConfig``);
    ``callbacks``, ``logger`` and ``strategy`` also accept objects."""

    def __init__(self, **kwargs: Any) -> None:
        objects = {k: kwargs.pop(k) for k in _OBJECT_KEYS if k in kwargs and not _is_plain(kwargs[k])}
        callback_objects = []
        if isinstance(kwargs.get("callbacks"), (list, tuple)):
            callback_objects = [c for c in kwargs["callbacks"] if isinstance(c, Callback)]
            kwargs["callbacks"] = [c for c in kwargs["callbacks"] if not isinstance(c, Callback)]
        if isinstance(objects.get("callbacks"), (list, tuple)):
            callback_objects += [c for c in objects.pop("callbacks")]
        self.config: TrainerConfig = validate_trainer_config(kwargs)
        if "strategy" in objects:
            self.config.strategy = objects["strategy"]
        self.callbacks: list[Callback] = build_callbacks(self.config, callback_objects, objects.get("logger"))
        self.strategy: Strategy | None = None
        self.module: TrainModule | None = None
        self.metrics = MetricCollector()
        self.schedulers: list[dict[str, Any]] = []
        self.current_epoch = 0
        self.global_step = 0
        self.batch_in_epoch = 0
        self.should_stop = False
        self.stage = "fit"
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.pending_rng: dict[str, Any] | None = None
        self.resumed_mid_epoch = False
        self.at_epoch_end = False  # True while on_train_epoch_end hooks run after a complete epoch
        self.num_training_batches: int | None = None
        self.num_val_batches: int | None = None
        self._run_config: dict[str, Any] | None = None
        self._hook_plan: dict[str, tuple[Any, ...]] = {}

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
    def world_size(self) -> int:
        return self.strategy.world_size if self.strategy is not None else 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def is_logging_rank(self) -> bool:
        return self.strategy.is_logging_rank if self.strategy is not None else True

    @property
    def run_dir(self) -> str:
        return self.config.run_dir

    @property
    def loggers(self) -> list[Logger]:
        return [cb for cb in self.callbacks if isinstance(cb, Logger)]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    def config_dict(self) -> dict[str, Any]:
        if self._run_config is not None:
            return self._run_config
        return {"trainer": trainer_to_dict(self.config)}

    # ------------------------------------------------------------------ entry points
    def fit(self, module: TrainModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: Any = None, ckpt_path: str | None = None) -> None:
        """Train; ``ckpt_path="last"`` (or ``trainer.resume``) continues from the newest checkpoint."""
        self._run("fit", module, dict(train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders,
                                      datamodule=datamodule, ckpt_path=ckpt_path))

    def validate(self, module: TrainModule | None = None, dataloaders: Any = None, datamodule: Any = None,
                 ckpt_path: str | None = None) -> list[dict[str, float]]:
        return self._run("validate", module, dict(dataloaders=dataloaders, datamodule=datamodule,
                                                  ckpt_path=ckpt_path))

    def test(self, module: TrainModule | None = None, dataloaders: Any = None, datamodule: Any = None,
             ckpt_path: str | None = None) -> list[dict[str, float]]:
        return self._run("test", module, dict(dataloaders=dataloaders, datamodule=datamodule, ckpt_path=ckpt_path))

    def predict(self, module: TrainModule | None = None, dataloaders: Any = None, datamodule: Any = None,
                ckpt_path: str | None = None) -> list[Any]:
        """This rank's predictions, in the order of its share of the data (rank r: samples r, r+N, ...)."""
        return self._run("predict", module, dict(dataloaders=dataloaders, datamodule=datamodule,
                                                 ckpt_path=ckpt_path))

    def save_checkpoint(self, path: str) -> None:
        """Every rank must call this (it gathers RNG states and meets at a barrier). Under
        ``nan_policy: error`` a model that already holds NaN/inf is refused before anything is written."""
        guard = getattr(self, "guard", None)
        if guard is not None:
            guard.check()
        self.strategy.save_checkpoint(build_payload(self, epoch_done=self.at_epoch_end), path)

    # ------------------------------------------------------------------ plumbing
    def _run(self, stage: str, module: TrainModule | None, kwargs: dict[str, Any]) -> Any:
        module = module if module is not None else self.module
        if module is None:
            raise ValueError(f"trainer.{stage}() needs a TrainModule")
        if stage == "fit" and not overrides(module, "training_step"):
            raise ConfigError(f"{type(module).__name__} does not define training_step(self, batch, batch_idx); "
                              f"a TrainModule must return the loss to minimise from it")
        plan = plan_launch(self.config)
        if plan.method != "here":
            return launch_from_trainer(self, plan, stage, module, kwargs)
        self._setup_strategy(plan)
        self.stage = stage
        self.module = module
        module._attach(self)
        try:
            return getattr(loops, f"run_{stage}")(self, module, **kwargs)
        except BaseException as exc:
            for cb in self.callbacks:
                cb.on_exception(self, module, exc)
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
            self.strategy = build_strategy(
                spec, accelerator=plan.accelerator, devices=plan.devices, num_nodes=plan.num_nodes,
                precision=self.config.precision, timeout=self.config.timeout, env=plan.env,
            )
        if self.config.deterministic:
            enable_deterministic()
        if self.config.detect_divergence:
            divergence.enable(self.config.timeout)  # before the process group starts
        self.strategy.setup_environment()
        self.metrics.device = self.strategy.collective_device
        self.strategy.bind_hooks(self.call_hook)
        heartbeat.start(self.strategy.global_rank, self.strategy.world_size, self.config.timeout)

    def restore_loop(self, loop: dict[str, Any]) -> None:
        self.current_epoch = int(loop["epoch"])
        self.global_step = int(loop["global_step"])
        self.batch_in_epoch = int(loop["batch_in_epoch"])
        self.resumed_mid_epoch = self.batch_in_epoch > 0
        self.resumed_loop = loop  # sample_offset + dp_size: re-split if the data-parallel size changed

    def call_hook(self, name: str, *args: Any) -> None:
        """Callbacks first, then the module's hook of the same name (if it has one).

        Runs every training step, so the callbacks (and module) that only inherit the base class's
        no-op are skipped: which ones is worked out once per hook and callback list (~0.5 us a step).
        """
        key = (self.module, *self.callbacks)
        cached = self._hook_plan.get(name)
        if cached is None or cached[0] != key:
            cached = self._hook_plan[name] = (key, *_hook_plan(self.callbacks, self.module, name))
        for cb in cached[1]:
            getattr(cb, name)(self, self.module, *args)
        if cached[2]:
            hook = getattr(self.module, name, None)
            if hook is not None:
                hook(*args)
