"""Where a ``Trainer`` runs: its strategy for this process, or worker processes started for a method
called outside any launcher."""

from __future__ import annotations

import copy
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import divergence
from polytrain.core.rng import enable_deterministic
from polytrain.parallel.activation_checkpointing import resolve_checkpointing
from polytrain.parallel.compile import resolve_compile
from polytrain.strategies.base import Strategy
from polytrain.strategies.launcher import LaunchPlan, launch_spawn, relaunch_script
from polytrain.strategies.plan_spec import is_planned, resolved_spec
from polytrain.strategies.registry import build_strategy, strategy_class
from polytrain.trainer.configuration.config import TrainerConfig, trainer_to_dict

if TYPE_CHECKING:
    from polytrain.trainer.api.module import TrainModule
    from polytrain.trainer.trainer import Trainer


def _spawn_entry(trainer_cls: type[Trainer], trainer_kwargs: dict[str, Any], callbacks: list[Any], stage: str,
                 module: TrainModule, kwargs: dict[str, Any], result_path: str) -> None:
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
        torch.save({"state_dict": state_dict, "result": result, "log_dir": trainer.log_dir,
                    "ckpt_path": trainer.ckpt_path,
                    "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   result_path)
    trainer.strategy.teardown()


def launch_from_trainer(trainer: Trainer, plan: LaunchPlan, stage: str, module: TrainModule,
                        kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run ``stage`` in worker processes; the trained weights are loaded into ``module``, and what the
    launching Trainer shows afterwards comes back: ``result``, ``callback_metrics``, ``log_dir``,
    ``ckpt_path``."""
    if plan.method == "elastic":
        relaunch_script(plan, trainer.config.max_restarts)  # exits with the job's status
    trainer_kwargs = trainer_to_dict(trainer.config)
    user_callbacks = [cb for cb in trainer.callbacks if getattr(cb, "_user_given", False)]
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.pt")
        launch_spawn(plan, _spawn_entry,
                     (type(trainer), trainer_kwargs, user_callbacks, stage, module, kwargs, result_path))
        out = torch.load(result_path, weights_only=False)  # written by our own worker just now
    if stage == "fit":
        module.load_state_dict(out.pop("state_dict"))
    out["callback_metrics"] = {k: torch.tensor(v) for k, v in out["callback_metrics"].items()}
    return out


def strategy_for(config: TrainerConfig, plan: LaunchPlan) -> Strategy:
    """The strategy this process runs (a ``Strategy`` given as ``trainer.strategy`` is used as it is),
    with the process-wide switches the config asks for set before its process group starts."""
    compile_options = resolve_compile(config.compile)
    checkpointing = resolve_checkpointing(config.activation_checkpointing)
    if isinstance(config.strategy, Strategy):
        strategy = config.strategy
        strategy.adopt_model_transforms(compile_options, checkpointing)
    else:
        spec = dict(config.strategy)
        if is_planned(spec):  # plan: true, resolved by trainer.planned when the stage started
            spec, planned_ac = resolved_spec(spec)
            if checkpointing is None and planned_ac:
                checkpointing = resolve_checkpointing({"mode": "op"} if planned_ac == "op" else True)
        spec["name"] = plan.strategy_name
        if (config.sync_batchnorm
                and "sync_batchnorm" in strategy_class(spec["name"]).Options.__dataclass_fields__):
            # Lightning's Trainer(sync_batchnorm=True); one process: nothing to sync
            spec["sync_batchnorm"] = True
        strategy = build_strategy(spec, accelerator=plan.accelerator, devices=plan.devices,
                                  num_nodes=plan.num_nodes,
                                  precision=config.precision, timeout=config.timeout, env=plan.env,
                                  compile_options=compile_options, checkpointing_options=checkpointing)
    if config.benchmark is not None:
        torch.backends.cudnn.benchmark = config.benchmark
    if config.deterministic:
        enable_deterministic()
    if config.detect_divergence:
        divergence.enable(config.timeout)  # before the process group starts
    return strategy
