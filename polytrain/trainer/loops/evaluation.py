"""Validation, test and predict passes, in Lightning's hook order.

A pass switches the module to eval mode (``on_<stage>_model_eval``), runs with gradients off, calls
``on_<stage>_start``/``epoch_start``, then per batch the batch-transfer hooks,
``on_<stage>_batch_start``, the step and ``on_<stage>_batch_end``; then the epoch's metrics are reduced
across ranks (so ``on_<stage>_epoch_end`` reads this epoch's values in ``callback_metrics``), the hook
runs, what it logged is reduced too, everything is published, ``on_<stage>_end`` runs, and each
submodule's train/eval mode is restored (or ``on_<stage>_model_train`` called when the module defines
it). Sharded strategies may hand out padding batches (so every rank runs as many forwards as the
others); the strategy marks them and they never reach a hook or a metric.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from polytrain.callbacks.prediction_writer import BasePredictionWriter
from polytrain.core import heartbeat
from polytrain.data.index_recording import recorded_indices, with_index_recording
from polytrain.data.loaders import set_epoch, stop_workers
from polytrain.strategies.router import PADDING_BATCH
from polytrain.trainer.api.hooks import is_overridden
from polytrain.trainer.api.module import TrainModule
from polytrain.trainer.observability.metrics import publish

if TYPE_CHECKING:
    from polytrain.trainer.api.hooks import Hooks
    from polytrain.trainer.loops.progress import EvalProgress
    from polytrain.trainer.observability.metrics import MetricCollector

# metric stage -> (hook word, step method)
STAGES = {"val": ("validation", "validation_step"), "test": ("test", "test_step"),
          "predict": ("predict", "predict_step")}


@dataclass
class PredictionRecord:
    """Lightning's ``trainer.predict_loop`` as prediction writers read it: this pass's predictions (kept
    when returned or written per epoch), the dataset indices of every batch, and of the current one."""

    return_predictions: bool = True
    predictions: list[Any] = field(default_factory=list)
    epoch_batch_indices: list[list[list[int]]] = field(default_factory=list)  # per loader, per batch
    current_batch_indices: list[int] = field(default_factory=list)

    def start(self, callbacks: list[Any], loader: Any) -> Any:
        """A predict pass begins: the loader to iterate (recording batch indices when a writer wants them)."""
        writers = [cb for cb in callbacks if isinstance(cb, BasePredictionWriter)]
        self.predictions, self.epoch_batch_indices, self.current_batch_indices = [], [[]], []
        self._keep = self.return_predictions or any(w.on_epoch for w in writers)
        return with_index_recording(loader) if writers else loader

    def batch_started(self, loader: Any, batch_idx: int) -> None:
        seen = recorded_indices(loader)
        self.current_batch_indices = seen[batch_idx] if seen is not None and batch_idx < len(seen) else []
        if seen is not None:
            self.epoch_batch_indices[0].append(self.current_batch_indices)

    def batch_predicted(self, output: Any) -> None:
        if self._keep:
            self.predictions.append(output)


class EvaluationLoop:
    """Validation, test and predict passes (see the module's docstring), built with what they use: the
    strategy, the stage's hook funnel and metrics, the module and callbacks, the batch mover, the
    prediction record (``trainer.predict_loop``) and the evaluation step counters."""

    def __init__(self, strategy: Any, hooks: Hooks, metrics: MetricCollector, module: Any,
                 callbacks: list[Any], transfer_batch: Callable[[Any], Any], predictions: PredictionRecord,
                 progress: EvalProgress) -> None:
        self.strategy = strategy
        self.hooks = hooks
        self.metrics = metrics
        self.module = module
        self.callbacks = callbacks
        self.transfer_batch = transfer_batch
        self.predictions = predictions
        self.progress = progress

    def run(self, loader: Any, stage: str, limit: int | None, *, entry: str, epoch: int, global_step: int,
            sanity: bool = False) -> Any:
        """One pass over ``loader``: the epoch metrics as floats (val/test) or the predictions. ``entry``:
        the entry point running it (``fit``, ``validate``, ...: each counts its evaluation steps);
        ``epoch`` and ``global_step``: where the fit stands (the sampler's epoch, the loggers' step)."""
        word, step_name = STAGES[stage]
        module, hooks, metrics = self.module, self.hooks, self.metrics
        heartbeat.at(word)
        set_epoch(loader, epoch)
        modes = {m: m.training for m in module.modules()}
        metric_stage = "sanity" if sanity else stage
        eval_step = functools.partial(hooks.instrument(step_name, self.strategy.eval_step),
                                      step_name[:-len("_step")])
        record = self.predictions
        if stage == "predict":
            loader = record.start(self.callbacks, loader)
        with torch.no_grad():
            iterator = iter(loader)  # before the hooks, as Lightning (the iterator draws from the RNG)
            with metrics.refusing(f"on_{word}_model_eval"):
                hooks.module(f"on_{word}_model_eval")
            metrics.start_stage(None if stage == "predict" else metric_stage, defaults=(False, True))
            if stage == "predict":
                metrics.refused_in = "a predict hook"
            metrics.eval_epoch_level = True
            hooks(f"on_{word}_start")
            hooks(f"on_{word}_epoch_start")
            metrics.eval_epoch_level = False
            self.strategy.prepare_evaluation()  # every rank: what a wrapper's first evaluation forward does
            try:
                for batch_idx, batch in enumerate(iterator):
                    if limit is not None and batch_idx >= limit:
                        break
                    if stage == "predict":
                        record.batch_started(loader, batch_idx)
                    output = self._eval_batch(eval_step, stage, word, batch, batch_idx, entry, sanity)
                    if output is not PADDING_BATCH and stage == "predict":
                        record.batch_predicted(output)
            finally:
                # A pass cut at its limit leaves workers behind. Persistent ones stay for the fit's next
                # validation (a validate() call stops them when it returns); test and predict are one pass.
                stop_workers(iterator, loader, keep_persistent=stage == "val")
            result: Any = record.predictions
            if stage == "predict":
                hooks(f"on_{word}_epoch_end")
            else:
                result = self._end_eval_epoch(word, metric_stage, global_step)
            metrics.start_stage(None)
            hooks(f"on_{word}_end")
            if stage != "predict" and is_overridden(module, f"on_{word}_model_train", TrainModule):
                with metrics.refusing(f"on_{word}_model_train"):
                    hooks.module(f"on_{word}_model_train")
            else:
                for m, training in modes.items():
                    m.training = training
        return result

    def _end_eval_epoch(self, word: str, metric_stage: str, global_step: int) -> dict[str, float]:
        """The epoch's values reduced before ``on_<stage>_epoch_end`` (it reads them), what the hook logged
        reduced after it, then all of them published at once (the sanity check's are dropped)."""
        metrics, group = self.metrics, self.strategy.dp_group
        values = metrics.reduce_epoch(metric_stage, group)
        metrics.eval_epoch_level = True
        self.hooks(f"on_{word}_epoch_end")
        metrics.eval_epoch_level = False
        values.update(metrics.reduce_epoch(metric_stage, group, more=True))
        if metric_stage == "sanity":
            metrics.discard("sanity")
        else:
            publish(metrics, self.hooks, values, global_step)
        metrics.end_eval_epoch()
        return {name: float(v) for name, (_, v) in values.items()}

    def _eval_batch(self, eval_step: Any, stage: str, word: str, batch: Any, batch_idx: int, entry: str,
                    sanity: bool) -> Any:
        hooks, metrics = self.hooks, self.metrics
        batch = self.transfer_batch(batch)
        metrics.batch = batch  # its size is read only if a value is logged per epoch
        hooks(f"on_{word}_batch_start", batch, batch_idx)
        output = eval_step(batch, batch_idx)
        if output is PADDING_BATCH:
            return output
        hooks(f"on_{word}_batch_end", output, batch, batch_idx)
        if stage != "predict" and metrics.has_fresh_step_values():
            # Per-step evaluation values go to the loggers on their own axis (the evaluation batch count),
            # unreduced: ranks may hold different numbers of evaluation batches, so no collective here.
            values = metrics.pop_step_values(sync=False)
            if not sanity:
                publish(metrics, hooks, values, self.progress.batches.get(entry, 0))
        if not sanity:  # as Lightning: each loop (fit's validation, validate, test) counts its own
            self.progress.next_step(entry)
        return output


def results_table(stage: str, metrics: dict[str, float]) -> str:
    """Lightning's table of an evaluation's epoch metrics: one row per name, sorted, the value in full."""
    header = (f"{stage.capitalize()} metric", "DataLoader 0")
    rows = [(name, str(value)) for name, value in sorted(metrics.items())] or [("(nothing was logged)", "")]
    left = max(len(header[0]), *(len(r[0]) for r in rows)) + 4
    right = max(len(header[1]), *(len(r[1]) for r in rows)) + 4
    rule = "─" * (left + right)
    lines = [rule, header[0].center(left) + header[1].center(right), rule]
    lines += [name.center(left) + value.center(right) for name, value in rows]
    return "\n".join([*lines, rule])
