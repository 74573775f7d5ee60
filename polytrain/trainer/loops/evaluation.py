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
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from polytrain.callbacks.prediction_writer import BasePredictionWriter
from polytrain.core import heartbeat
from polytrain.core.states import RunningStage, TrainerState
from polytrain.data.index_recording import recorded_indices, with_index_recording
from polytrain.data.loaders import set_epoch, stop_workers
from polytrain.strategies.router import PADDING_BATCH, step_args
from polytrain.trainer.api.hooks import is_overridden
from polytrain.trainer.api.module import TrainModule
from polytrain.trainer.observability.metrics import publish

if TYPE_CHECKING:
    from polytrain.trainer.api.hooks import Hooks
    from polytrain.trainer.loops.progress import EvalProgress
    from polytrain.trainer.observability.metrics import MetricCollector

RUNNING_STAGE = {"val": RunningStage.VALIDATING, "test": RunningStage.TESTING,
                 "predict": RunningStage.PREDICTING}

# metric stage -> (hook word, step method)
STAGES = {"val": ("validation", "validation_step"), "test": ("test", "test_step"),
          "predict": ("predict", "predict_step")}


@dataclass
class PredictionRecord:
    """Lightning's ``trainer.predict_loop`` as prediction writers read it: this pass's predictions (kept
    when returned or written per epoch; one list per loader where there are several), the dataset indices
    of every batch, and of the current one."""

    return_predictions: bool = True
    per_loader: list[list[Any]] = field(default_factory=list)
    epoch_batch_indices: list[list[list[int]]] = field(default_factory=list)  # per loader, per batch
    current_batch_indices: list[int] = field(default_factory=list)

    @property
    def predictions(self) -> list[Any]:
        """The predictions of the pass: a list, or a list of lists where several loaders ran (as
        Lightning's)."""
        return self.per_loader[0] if len(self.per_loader) == 1 else self.per_loader

    def start(self, callbacks: list[Any], loaders: list[Any]) -> list[Any]:
        """A predict pass begins: the loaders to iterate (recording batch indices where a writer wants
        them)."""
        writers = [cb for cb in callbacks if isinstance(cb, BasePredictionWriter)]
        self.per_loader = [[] for _ in loaders]
        self.epoch_batch_indices, self.current_batch_indices = [[] for _ in loaders], []
        self._keep = self.return_predictions or any(w.on_epoch for w in writers)
        return [with_index_recording(loader) for loader in loaders] if writers else loaders

    def batch_started(self, loader: Any, batch_idx: int, loader_idx: int) -> None:
        seen = recorded_indices(loader)
        self.current_batch_indices = seen[batch_idx] if seen is not None and batch_idx < len(seen) else []
        if seen is not None:
            self.epoch_batch_indices[loader_idx].append(self.current_batch_indices)

    def batch_predicted(self, output: Any, loader_idx: int) -> None:
        if self._keep:
            self.per_loader[loader_idx].append(output)


def check_dataloader_idx_parameter(module: Any, word: str, stage: str, several: bool) -> None:
    """Where several loaders feed an evaluation, its step gets ``dataloader_idx``; where one does, it does
    not. A step (or batch hook) whose signature expects the other case would fail at its first call with
    a bare TypeError about arguments; say here which loader count met which signature."""
    for name in (f"{word}_step", f"on_{word}_batch_start", f"on_{word}_batch_end"):
        method = getattr(module, name, None)
        if method is None:
            continue
        try:
            params = inspect.signature(method).parameters
        except (TypeError, ValueError):  # a builtin or a C callable: nothing to read
            continue
        if "dataloader_iter" in params:
            continue  # a step that reads the iterator itself takes no indices
        named = params.get("dataloader_idx")
        takes_it = named is not None or any(p.kind is p.VAR_POSITIONAL for p in params.values())
        where = f"`{type(module).__name__}.{name}()`"
        if not several and named is not None and named.default is inspect.Parameter.empty:
            raise RuntimeError(f"You provided only a single `{stage}_dataloader`, but have included "
                               f"`dataloader_idx` in {where}, which one loader never passes. Remove the "
                               f"argument or give it a default value: `dataloader_idx=0`")
        if several and not takes_it:
            raise RuntimeError(f"You provided multiple `{stage}_dataloader`s, but there is no "
                               f"`dataloader_idx` argument in {where}, which each of them passes. Add "
                               f"`dataloader_idx=0` to its signature")


class EvaluationLoop:
    """Validation, test and predict passes (see the module's docstring), built with what they use: the
    strategy, the stage's hook funnel and metrics, the module and callbacks, the batch mover, the
    prediction record (``trainer.predict_loop``) and the evaluation step counters."""

    def __init__(self, strategy: Any, hooks: Hooks, metrics: MetricCollector, module: Any,
                 callbacks: list[Any], transfer_batch: Callable[[Any, int], Any],
                 predictions: PredictionRecord, progress: EvalProgress, state: TrainerState) -> None:
        self.strategy = strategy
        self.state = state  # trainer.state: a pass sets its stage (a fit's validation is VALIDATING)
        self.hooks = hooks
        self.metrics = metrics
        self.module = module
        self.callbacks = callbacks
        self.transfer_batch = transfer_batch
        self.predictions = predictions
        self.progress = progress

    def run(self, loaders: list[Any], stage: str, limits: list[int | None], *, entry: str, epoch: int,
            global_step: int, sanity: bool = False) -> Any:
        """One pass over ``loaders``, each up to its limit in ``limits``, one after the other: the epoch
        metrics as floats, one dict per loader (val/test), or the predictions. ``entry``: the entry point
        running it (``fit``, ``validate``, ...: each counts its evaluation steps); ``epoch`` and
        ``global_step``: where the fit stands (the sampler's epoch, the loggers' step).

        Where several loaders run, as in Lightning: each step and batch hook gets ``dataloader_idx``,
        ``batch_idx`` restarts at 0 for each loader, values logged in a step get the suffix
        ``/dataloader_idx_N``, and the epoch hooks run once for the whole pass."""
        outer = self.state.stage  # training, when a fit validates; restored when the pass ends
        if not sanity:
            self.state.stage = RUNNING_STAGE[stage]
        try:
            return self._run(loaders, stage, limits, entry, epoch, global_step, sanity)
        finally:
            self.state.stage = outer
            self.metrics.dataloader_idx = None

    def _run(self, loaders: list[Any], stage: str, limits: list[int | None], entry: str, epoch: int,
             global_step: int, sanity: bool) -> Any:
        word, step_name = STAGES[stage]
        module, hooks, metrics = self.module, self.hooks, self.metrics
        heartbeat.at(word)
        for loader in loaders:
            set_epoch(loader, epoch)
        modes = {m: m.training for m in module.modules()}
        metric_stage = "sanity" if sanity else stage
        eval_step = functools.partial(hooks.instrument(step_name, self.strategy.eval_step),
                                      step_name[:-len("_step")])
        record = self.predictions
        if stage == "predict":
            loaders = record.start(self.callbacks, loaders)
        several = len(loaders) > 1
        check_dataloader_idx_parameter(module, word, stage, several)
        with torch.no_grad():
            # The first loader's iterator before the hooks, as Lightning (it draws from the RNG); the others'
            # when their turn comes.
            iterator = iter(loaders[0])
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
            for loader_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                iterator = iterator if loader_idx == 0 else iter(loader)
                dataloader_idx = loader_idx if several else None
                metrics.dataloader_idx = dataloader_idx  # the suffix of what the steps log
                try:
                    for batch_idx, batch in enumerate(iterator):
                        if limit is not None and batch_idx >= limit:
                            break
                        if stage == "predict":
                            record.batch_started(loader, batch_idx, loader_idx)
                        output = self._eval_batch(eval_step, stage, word, batch, batch_idx, entry, sanity,
                                                  dataloader_idx)
                        if output is not PADDING_BATCH and stage == "predict":
                            record.batch_predicted(output, loader_idx)
                finally:
                    # A pass cut at its limit leaves workers behind. Persistent ones stay for the fit's next
                    # validation (a validate() call stops them when it returns); test and predict are one
                    # pass.
                    stop_workers(iterator, loader, keep_persistent=stage == "val")
            metrics.dataloader_idx = None
            result: Any = record.predictions
            if stage == "predict":
                hooks(f"on_{word}_epoch_end")
            else:
                result = per_loader(self._end_eval_epoch(word, metric_stage, global_step), len(loaders))
            metrics.start_stage(None)
            hooks(f"on_{word}_end")
            if stage != "predict" and is_overridden(module, f"on_{word}_model_train", TrainModule):
                with metrics.refusing(f"on_{word}_model_train"):
                    hooks.module(f"on_{word}_model_train")
            else:
                for m, training in modes.items():
                    m.training = training
        return result

    def _end_eval_epoch(self, word: str, metric_stage: str,
                        global_step: int) -> dict[str, tuple[float, int | None]]:
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
        return {name: (float(v), entry.loader) for name, (entry, v) in values.items()}

    def _eval_batch(self, eval_step: Any, stage: str, word: str, batch: Any, batch_idx: int, entry: str,
                    sanity: bool, dataloader_idx: int | None) -> Any:
        hooks, metrics = self.hooks, self.metrics
        batch = self.transfer_batch(batch, dataloader_idx or 0)
        metrics.batch = batch  # its size is read only if a value is logged per epoch
        hook_args = step_args(batch, batch_idx, dataloader_idx)
        hooks(f"on_{word}_batch_start", *hook_args)
        output = eval_step(batch, batch_idx, dataloader_idx)
        if output is PADDING_BATCH:
            return output
        hooks(f"on_{word}_batch_end", output, *hook_args)
        if stage != "predict" and metrics.has_fresh_step_values():
            # Per-step evaluation values go to the loggers on their own axis (the evaluation batch count),
            # unreduced: ranks may hold different numbers of evaluation batches, so no collective here.
            values = metrics.pop_step_values(sync=False)
            if not sanity:
                publish(metrics, hooks, values, self.progress.batches.get(entry, 0))
        if not sanity:  # as Lightning: each loop (fit's validation, validate, test) counts its own
            self.progress.next_step(entry)
        return output


def per_loader(values: dict[str, tuple[float, int | None]], n_loaders: int) -> list[dict[str, float]]:
    """An evaluation's epoch values (each with the loader it was logged under) as one dict per loader,
    Lightning's results: a loader's own values (``.../dataloader_idx_N``, or logged under it with
    ``add_dataloader_idx=False``) and those no loader was running for (the epoch-end hooks')."""
    if n_loaders <= 1:
        return [{name: v for name, (v, _) in values.items()}]
    return [{name: v for name, (v, loader) in values.items() if loader is None or loader == i}
            for i in range(n_loaders)]


def results_table(stage: str, results: list[dict[str, float]]) -> str:
    """Lightning's table of an evaluation's epoch metrics: one row per name, sorted, a column per loader
    with the value in full (blank where that loader has none)."""
    header = [f"{stage.capitalize()} metric", *(f"DataLoader {i}" for i in range(len(results)))]
    names = sorted({name for result in results for name in result})
    rows = [[name, *(str(r[name]) if name in r else "" for r in results)] for name in names]
    rows = rows or [["(nothing was logged)", *("" for _ in results)]]
    widths = [max(len(header[c]), *(len(row[c]) for row in rows)) + 4 for c in range(len(header))]
    rule = "─" * sum(widths)
    lines = [rule, "".join(h.center(w) for h, w in zip(header, widths)), rule]
    lines += ["".join(cell.center(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join([*lines, rule])
