"""Running one stage (fit, validate, test, predict) between its set-up and tear-down."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from polytrain.trainer.checkpointing.resume import agree_on_checkpoint, restore_weights
from polytrain.trainer.checkpointing.run_directory import resolve_path
from polytrain.trainer.loops import lifecycle

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

_LOADER_STAGE = {"validate": "val", "test": "test", "predict": "predict"}


def run_stage(trainer: Trainer, stage: str, ckpt_path: str | None, model_given: bool = True,
              verbose: bool = False) -> Any:
    """The stage's loop, after ``Trainer`` set it up (``lifecycle.begin``), then its tear-down."""
    trainer.metrics.reset()
    if stage == "fit":
        with torch.autograd.set_detect_anomaly(trainer.config.detect_anomaly):  # as Lightning:
            # the fit loop only
            trainer.profiler.start(trainer.log_dir)
            try:
                with trainer.strategy.checkpoint_io.updates_wait_for_staging():
                    # The checkpoint was settled with the run's directory.
                    trainer.fit_loop.run(trainer.fit_collaborators(), trainer.ckpt_path)
            except BaseException:
                trainer.strategy.checkpoint_io.abandon()  # a save being written still completes
                raise
            trainer.strategy.checkpoint_io.finish()  # fit returns with the last async save on disk, or raises
            trainer.profiler.stop()
        result = None
    else:
        result = _evaluate(trainer, stage, ckpt_path, model_given)
        if verbose and stage != "predict" and trainer.is_global_zero:
            print(results_table(stage, result[0]), flush=True)
    lifecycle.end(trainer, stage)
    return result


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


def _evaluate(trainer: Trainer, stage: str, ckpt_path: str | None, model_given: bool) -> Any:
    loader_stage = _LOADER_STAGE[stage]
    best = getattr(trainer.checkpoint_callback, "best_model_path", None)
    if ckpt_path is None and not model_given and best:
        warnings.warn(f"trainer.{stage}() without a model after fit evaluates the best checkpoint "
                      f"({best}), as Lightning does; pass the model (current weights) or ckpt_path to choose",
                      stacklevel=4)
        ckpt_path = "best"
    if ckpt_path is not None:
        path = agree_on_checkpoint(trainer.strategy,
                                   lambda: resolve_path(trainer, ckpt_path, stage=trainer.stage),
                                   ckpt_path, trainer.run_dir)
        restore_weights(path, trainer.strategy, trainer.hooks)
    with torch.no_grad():  # as Lightning: the loader is asked for inside the (gradient-free) evaluation
        loader = trainer.data_connector.request(loader_stage)
    if loader is None:
        raise ValueError(f"no {loader_stage} data: pass dataloaders to {stage}() or define "
                         f"{loader_stage}_dataloader() on {type(trainer.module).__name__} "
                         f"(or its DataModule)")
    limit = trainer.data_connector.batch_limit(loader_stage, loader)
    if loader_stage == "val":  # trainer.val_dataloaders / num_val_batches show the standalone validation's
        trainer.fit_loop.data.use_val(loader, limit)
    result = trainer.evaluation.run(loader, loader_stage, limit, entry=trainer.stage,
                                    epoch=trainer.current_epoch, global_step=trainer.global_step)
    if stage == "predict":
        return result if trainer.predict_loop.return_predictions else None
    return [result]
