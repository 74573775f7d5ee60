"""Where a ``Trainer`` runs: its strategy for this process, or worker processes started for a method
called outside any launcher (the Trainer hands them the function each worker runs)."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from polytrain.checkpoint.layout import newest_resumable
from polytrain.core import divergence
from polytrain.core.rng import enable_deterministic
from polytrain.parallel.activation_checkpointing import resolve_checkpointing
from polytrain.parallel.compile import resolve_compile
from polytrain.strategies.base import Strategy
from polytrain.strategies.launcher import LaunchPlan, launch_spawn, relaunch_script
from polytrain.strategies.plan_spec import is_planned, resolved_spec
from polytrain.strategies.registry import build_strategy, strategy_class
from polytrain.trainer.configuration.config import TrainerConfig

if TYPE_CHECKING:
    from polytrain.trainer.api.module import TrainModule


def launch_workers(plan: LaunchPlan, worker: Callable[..., None], args: tuple[Any, ...], max_restarts: int,
                   stage: str, module: TrainModule, run_dir: str,
                   version: int | str | None) -> dict[str, Any]:
    """Run ``worker(*args, result_path)`` in worker processes (a script under an elastic launch is started
    again by it: this process then exits with the job's status). Global rank 0's worker saves what the
    launching process shows afterwards into ``result_path``: ``result``, ``callback_metrics``, ``log_dir``,
    ``ckpt_path`` and, after a fit, the trained weights, which are loaded into ``module``. ``run_dir`` and
    ``version``: where a script stopped by Ctrl-C finds the checkpoint it can continue from."""
    if plan.method == "elastic":
        # exits with the job's status
        relaunch_script(plan, max_restarts, stage, functools.partial(_stopped_lines, stage, run_dir, version))
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.pt")
        launch_spawn(plan, worker, (*args, result_path))
        out = torch.load(result_path, weights_only=False)  # written by our own worker just now
    if stage == "fit":
        module.load_state_dict(out.pop("state_dict"))
    out["callback_metrics"] = {k: torch.tensor(v) for k, v in out["callback_metrics"].items()}
    return out


def _stopped_lines(stage: str, run_dir: str, version: int | str | None) -> list[str]:
    """What a script's stopped job leaves: its newest complete checkpoint, and how to continue from it."""
    newest = newest_resumable(run_dir, version)
    if newest is None:
        return ["no checkpoint had been written"]
    lines = [f"the newest complete checkpoint is {newest[1]}"]
    if stage == "fit":
        lines.append("to continue it: run the script again with Trainer(..., resume=\"last\") or "
                     "trainer.fit(..., ckpt_path=\"last\")")
    return lines


def strategy_for(config: TrainerConfig, plan: LaunchPlan) -> Strategy:
    """The strategy this process runs (a ``Strategy`` given as ``trainer.strategy`` is used as it is);
    built, not started: ``apply_process_switches`` and its ``setup_environment`` come when a stage
    starts."""
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
                                  compile_options=compile_options,
                                  activation_checkpointing_options=checkpointing)
    return strategy


def apply_process_switches(config: TrainerConfig) -> None:
    """The process-wide switches the config asks for (cuDNN autotuning, deterministic kernels, the
    divergence check), set when a stage starts, before the strategy's process group does."""
    if config.benchmark is not None:
        torch.backends.cudnn.benchmark = config.benchmark
    if config.deterministic:
        enable_deterministic(warn_only=config.deterministic == "warn")
    if config.detect_divergence:
        divergence.enable(config.timeout)  # before the process group starts
