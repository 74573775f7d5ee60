"""Validation, test and predict passes, in Lightning's hook order.

A pass switches the module to eval mode (``on_<stage>_model_eval``), runs with gradients off, calls
``on_<stage>_start``/``epoch_start``, then per batch the batch-transfer hooks,
``on_<stage>_batch_start``, the step and ``on_<stage>_batch_end``; then ``on_<stage>_epoch_end``,
publishes the epoch's metrics (reduced across ranks), ``on_<stage>_end``, and restores each
submodule's train/eval mode (or calls ``on_<stage>_model_train`` when the module defines it).
Sharded strategies may hand out padding batches (so every rank runs as many forwards as the
others); the strategy marks them and they never reach a hook or a metric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import heartbeat
from polytrain.data.loaders import set_epoch
from polytrain.strategies.base import PADDING_BATCH
from polytrain.trainer.hooks import defines
from polytrain.trainer.module import TrainModule

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

# metric stage -> (hook word, step method)
STAGES = {"val": ("validation", "validation_step"), "test": ("test", "test_step"),
          "predict": ("predict", "predict_step")}


def run_eval_pass(trainer: Trainer, loader: Any, stage: str, limit: int | None, sanity: bool = False) -> Any:
    """One pass over ``loader``. Returns the epoch metrics as floats (val/test) or the predictions."""
    word, step_name = STAGES[stage]
    module, strategy, hooks, metrics = trainer.module, trainer.strategy, trainer.hooks, trainer.metrics
    heartbeat.at(word)
    set_epoch(loader, trainer.current_epoch)
    modes = {m: m.training for m in module.modules()}
    metric_stage = "sanity" if sanity else stage
    outputs: list[Any] = []
    with torch.no_grad():
        iterator = iter(loader)  # before the hooks, as Lightning (the iterator draws from the RNG)
        with metrics.refusing(f"on_{word}_model_eval"):
            hooks(f"on_{word}_model_eval")
        metrics.start_stage(None if stage == "predict" else metric_stage, defaults=(False, True))
        if stage == "predict":
            metrics.refused_in = "a predict hook"
        metrics.eval_epoch_level = True
        hooks(f"on_{word}_start")
        hooks(f"on_{word}_epoch_start")
        metrics.eval_epoch_level = False
        for batch_idx, batch in enumerate(iterator):
            if limit is not None and batch_idx >= limit:
                break
            output = _eval_batch(trainer, stage, step_name, word, batch, batch_idx)
            if output is not PADDING_BATCH and stage == "predict":
                outputs.append(output)
        metrics.eval_epoch_level = True
        hooks(f"on_{word}_epoch_end")
        metrics.eval_epoch_level = False
        result: Any = outputs
        if stage != "predict":
            values = metrics.reduce_epoch(metric_stage, strategy.dp_group)
            if sanity:
                metrics.discard("sanity")
            else:
                trainer.publish(values, trainer.global_step)
            result = {name: float(v) for name, (_, v) in values.items()}
        metrics.start_stage(None)
        hooks(f"on_{word}_end")
        if stage != "predict" and defines(module, f"on_{word}_model_train", TrainModule):
            with metrics.refusing(f"on_{word}_model_train"):
                hooks(f"on_{word}_model_train")
        else:
            for m, training in modes.items():
                m.training = training
    return result


def _eval_batch(trainer: Trainer, stage: str, step_name: str, word: str, batch: Any, batch_idx: int) -> Any:
    hooks, metrics = trainer.hooks, trainer.metrics
    batch = trainer.transfer_batch(batch)
    metrics.batch = batch  # its size is read only if a value is logged per epoch
    hooks(f"on_{word}_batch_start", batch, batch_idx)
    output = trainer.strategy.eval_step(step_name[: -len("_step")], batch, batch_idx)
    if output is PADDING_BATCH:
        return output
    hooks(f"on_{word}_batch_end", output, batch, batch_idx)
    if stage != "predict" and metrics.has_fresh_step_values():
        # Per-step evaluation values go to the loggers on their own axis (the evaluation batch count),
        # unreduced: ranks may hold different numbers of evaluation batches, so no collective here.
        values = metrics.pop_step_values(sync=False)
        if not trainer.sanity_checking:
            trainer.publish(values, trainer.eval_batches_seen.get(trainer.stage, 0))
    if not trainer.sanity_checking:  # as Lightning: each loop (fit's validation, validate, test) counts its own
        trainer.eval_batches_seen[trainer.stage] = trainer.eval_batches_seen.get(trainer.stage, 0) + 1
    return output
