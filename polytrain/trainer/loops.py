"""The loops. Per step they add no host-device sync of their own: values leave the device only
on logging steps, and decisions that change control flow are reduced across ranks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from polytrain.checkpoint.layout import resolve_resume
from polytrain.core import heartbeat
from polytrain.core.batch import batch_size_of
from polytrain.core.rng import restore_rng_state, seed_everything
from polytrain.data.loaders import loader_length, resume_position, set_epoch
from polytrain.strategies.base import PADDING_BATCH
from polytrain.trainer import checkpoint as ckpt
from polytrain.trainer.guards import NonFiniteGuard, check_batches
from polytrain.trainer.optim import parse_optimizers, step_schedulers

if TYPE_CHECKING:
    from polytrain.trainer.module import TrainModule
    from polytrain.trainer.trainer import Trainer

log = logging.getLogger("polytrain")


def _pick_loader(trainer: Trainer, module: TrainModule, given: Any, datamodule: Any, stage: str) -> Any:
    name = {"train": "train_dataloader", "val": "val_dataloader", "test": "test_dataloader",
            "predict": "predict_dataloader"}[stage]
    if given is not None:
        loader = given
    elif datamodule is not None and hasattr(datamodule, name):
        loader = getattr(datamodule, name)()
    else:
        loader = getattr(module, name)()
    if loader is None:
        return None
    strategy = trainer.strategy
    return strategy.process_dataloader(loader, stage, trainer.config.seed, trainer.config.use_distributed_sampler)


def _setup_module(trainer: Trainer, module: TrainModule, with_optimizers: bool) -> None:
    strategy = trainer.strategy
    if strategy.module is module:
        return  # already set up by an earlier stage on this trainer
    # Identical seeds on every rank while layers are built, so replicas start equal even when a
    # strategy does not broadcast them; per-rank streams afterwards (dropout must differ per rank).
    seed_everything(trainer.config.seed)
    with strategy.model_init_context():
        module.configure_model()
    strategy.setup_module(module)
    if with_optimizers:
        optimizers, trainer.schedulers = parse_optimizers(module.configure_optimizers())
        strategy.setup_optimizers(optimizers)
    seed_everything(trainer.config.seed + strategy.global_rank)


def _load(trainer: Trainer, path: str | None) -> None:
    if path is None:
        return
    # Rank 0 chooses and every rank loads the same file: file systems may differ in what they see.
    path = trainer.strategy.broadcast(path)
    log.info("restoring from %s", path)
    payload = trainer.strategy.load_checkpoint(path)
    ckpt.restore_payload(trainer, payload)


def _resolve_ckpt(trainer: Trainer, ckpt_path: str | None) -> str | None:
    choice = ckpt_path if ckpt_path is not None else trainer.config.resume
    path = resolve_resume(choice, trainer.run_dir) if trainer.strategy.is_global_zero else None
    return trainer.strategy.broadcast(path)


# --------------------------------------------------------------------------- fit


def run_fit(trainer: Trainer, module: TrainModule, train_dataloaders: Any, val_dataloaders: Any,
            datamodule: Any, ckpt_path: str | None) -> None:
    strategy = trainer.strategy
    cfg = trainer.config
    _setup_module(trainer, module, with_optimizers=True)
    train_loader = _pick_loader(trainer, module, train_dataloaders, datamodule, "train")
    if train_loader is None:
        raise ValueError(f"no training data: pass train_dataloaders to fit() or define train_dataloader() "
                         f"on {type(module).__name__}")
    val_loader = _pick_loader(trainer, module, val_dataloaders, datamodule, "val")
    trainer.train_batch_size = getattr(train_loader, "batch_size", None)  # checkpoints count samples with it
    trainer.num_training_batches = check_batches(trainer, train_loader, "train")
    trainer.num_val_batches = loader_length(val_loader) if val_loader is not None else 0
    if trainer.num_val_batches is not None and cfg.limit_val_batches is not None:
        trainer.num_val_batches = min(trainer.num_val_batches, cfg.limit_val_batches)
    _load(trainer, _resolve_ckpt(trainer, ckpt_path))
    ckpt.ensure_run_dir(trainer)
    for cb in trainer.callbacks:
        cb.setup(trainer, module, "fit")
    trainer.call_hook("on_fit_start")
    guard = trainer.guard = NonFiniteGuard(trainer)
    max_epochs = cfg.max_epochs if cfg.max_epochs is not None else (1000 if cfg.max_steps < 0 else 10**9)
    trainer.should_stop = _done(trainer, max_epochs)
    while not trainer.should_stop:
        _train_epoch(trainer, module, train_loader, val_loader, guard)
        if trainer.epoch_complete:
            # A mid-epoch stop (max_steps) keeps its position, so a checkpoint taken at fit end
            # resumes from the next batch instead of skipping the rest of the epoch.
            trainer.current_epoch += 1
            trainer.batch_in_epoch = 0
        trainer.should_stop = strategy.reduce_boolean_decision(trainer.should_stop) or _done(trainer, max_epochs)
    guard.check()
    trainer.call_hook("on_fit_end")
    for cb in trainer.callbacks:
        cb.teardown(trainer, module, "fit")


def _done(trainer: Trainer, max_epochs: int) -> bool:
    cfg = trainer.config
    return trainer.current_epoch >= max_epochs or (0 <= cfg.max_steps <= trainer.global_step)


def _train_epoch(trainer: Trainer, module: TrainModule, loader: Any, val_loader: Any, guard: NonFiniteGuard) -> None:
    strategy, cfg = trainer.strategy, trainer.config
    epoch = trainer.current_epoch
    start = trainer.batch_in_epoch
    num_batches = trainer.num_training_batches
    set_epoch(loader, epoch)
    # After a resume the position may come from another data-parallel size: re-split it.
    saved, trainer.resumed_loop = getattr(trainer, "resumed_loop", None), None
    start, manual_skip, trainer.sample_base = resume_position(loader, start, num_batches, strategy.dp_size, saved)
    if trainer.pending_rng is not None and not trainer.resumed_mid_epoch:
        # Saved at an epoch boundary: the original run drew from the RNG when this epoch's
        # iterator was created, so restore before creating it.
        restore_rng_state(trainer.pending_rng)
        trainer.pending_rng = None
    iterator = iter(loader)
    for _ in range(manual_skip):
        next(iterator)
    if trainer.pending_rng is not None:
        # Saved mid-epoch: that run created its iterator before the checkpoint, so restore after.
        restore_rng_state(trainer.pending_rng)
        trainer.pending_rng = None
    trainer.resumed_mid_epoch = False
    module.train()
    trainer.metrics.start_stage("train")
    trainer.call_hook("on_train_epoch_start")
    accumulate = cfg.accumulate_grad_batches
    optimizers = strategy.optimizers
    for batch_idx in range(start, num_batches):
        batch = next(iterator)
        batch = strategy.batch_to_device(batch)
        trainer.metrics.batch_size = batch_size_of(batch)
        trainer.batch_in_epoch = batch_idx + 1
        is_step = (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == num_batches
        heartbeat.beat(trainer.global_step, "training_step")
        with strategy.no_backward_sync(not is_step):
            result = strategy.forward_backward(batch, batch_idx, 1.0 / accumulate)
        guard.observe(result.loss, end_of_window=is_step)
        heartbeat.at("optimizer_step")
        if is_step:
            if guard.should_skip_step():
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
            elif _step_optimizers(strategy, optimizers, cfg, guard):
                trainer.global_step += 1
                step_schedulers(trainer.schedulers, "step", trainer.global_step, trainer.callback_metrics)
                if trainer.global_step % cfg.log_every_n_steps == 0:
                    guard.check()
                    _log_step(trainer, result.loss)
        heartbeat.at("on_train_batch_end")
        trainer.call_hook("on_train_batch_end", result.output, batch, batch_idx)
        if is_step and cfg.val_check_interval and (batch_idx + 1) % cfg.val_check_interval == 0 \
                and batch_idx + 1 < num_batches and val_loader is not None:
            run_evaluation(trainer, module, val_loader, "validate")
            module.train()
            trainer.metrics.start_stage("train")
        if 0 <= cfg.max_steps <= trainer.global_step:
            trainer.should_stop = True
            break
    heartbeat.at("train_epoch_end")
    epoch_values = trainer.metrics.reduce_epoch("train", strategy.dp_group)
    _publish(trainer, epoch_values, trainer.global_step)
    epoch_complete = trainer.batch_in_epoch >= num_batches
    if val_loader is not None and epoch_complete and (epoch + 1) % cfg.check_val_every_n_epoch == 0:
        run_evaluation(trainer, module, val_loader, "validate")
    if epoch_complete:
        step_schedulers(trainer.schedulers, "epoch", epoch + 1, trainer.callback_metrics)
    trainer.epoch_complete = epoch_complete
    trainer.at_epoch_end = epoch_complete  # a checkpoint taken now resumes at the next epoch
    try:
        trainer.call_hook("on_train_epoch_end")
    finally:
        trainer.at_epoch_end = False


def _step_optimizers(strategy: Any, optimizers: list[Any], cfg: Any, guard: NonFiniteGuard) -> bool:
    """False when every optimizer skipped its step (a non-finite gradient norm under nan_policy=skip)."""
    stepped = not optimizers
    for opt in optimizers:
        # The guard sees the gradient norm when clipping by norm computes one.
        if strategy.optimizer_step(opt, cfg.gradient_clip_val, cfg.gradient_clip_algorithm,
                                   check_norm=guard.check_grad_norm) is not False:
            stepped = True
        opt.zero_grad(set_to_none=True)
    return stepped


def _log_step(trainer: Trainer, loss: torch.Tensor | None) -> None:
    values = trainer.metrics.pop_step_values(trainer.strategy.dp_group)
    _publish(trainer, values, trainer.global_step)


def _publish(trainer: Trainer, values: dict[str, torch.Tensor], step: int) -> None:
    """Hand values to callbacks/loggers; the only place metrics leave the device."""
    if not values:
        return
    trainer.callback_metrics.update(values)
    scalars = {k: float(v) for k, v in values.items()}
    meta = trainer.metrics.meta
    trainer.progress_bar_metrics.update({k: v for k, v in scalars.items() if k in meta and meta[k].prog_bar})
    logged = {k: v for k, v in scalars.items() if k not in meta or meta[k].logger}
    trainer.logged_metrics.update(logged)
    for cb in trainer.callbacks:
        cb.on_log(trainer, logged, step)


# --------------------------------------------------------------------------- evaluation


def run_evaluation(trainer: Trainer, module: TrainModule, loader: Any, stage: str) -> dict[str, float]:
    strategy = trainer.strategy
    metric_stage = {"validate": "val", "test": "test"}[stage]
    hook_stage = "validation" if stage == "validate" else "test"
    heartbeat.at(stage)
    was_training = module.training
    module.eval()
    trainer.metrics.start_stage(metric_stage)
    for cb in trainer.callbacks:
        getattr(cb, f"on_{hook_stage}_start")(trainer, module)
    limit = trainer.config.limit_val_batches if stage == "validate" else trainer.config.limit_test_batches
    with torch.no_grad():
        for batch_idx, batch in enumerate(loader):
            if limit is not None and batch_idx >= limit:
                break
            batch = strategy.batch_to_device(batch)
            trainer.metrics.batch_size = batch_size_of(batch)
            output = strategy.eval_step(metric_stage if metric_stage != "val" else "validation", batch, batch_idx)
            if output is PADDING_BATCH:
                continue
            for cb in trainer.callbacks:
                getattr(cb, f"on_{hook_stage}_batch_end")(trainer, module, output, batch, batch_idx)
    values = trainer.metrics.reduce_epoch(metric_stage, strategy.dp_group)
    _publish(trainer, values, trainer.global_step)
    getattr(module, f"on_{hook_stage}_epoch_end")()
    for cb in trainer.callbacks:
        getattr(cb, f"on_{hook_stage}_end")(trainer, module)
    module.train(was_training)
    return {k: float(v) for k, v in values.items()}


def _eval_entry(trainer: Trainer, module: TrainModule, dataloaders: Any, datamodule: Any,
                ckpt_path: str | None, stage: str) -> list[dict[str, float]]:
    _setup_module(trainer, module, with_optimizers=False)
    loader_stage = "val" if stage == "validate" else "test"
    loader = _pick_loader(trainer, module, dataloaders, datamodule, loader_stage)
    if loader is None:
        raise ValueError(f"no {loader_stage} data: pass dataloaders to {stage}() or define "
                         f"{loader_stage}_dataloader() on {type(module).__name__}")
    if ckpt_path is not None:
        _load_weights_only(trainer, ckpt_path)
    return [run_evaluation(trainer, module, loader, stage)]


def _load_weights_only(trainer: Trainer, ckpt_path: str) -> None:
    path = resolve_resume(ckpt_path, trainer.run_dir) if trainer.strategy.is_global_zero else None
    path = trainer.strategy.broadcast(path)
    if path is None:
        raise FileNotFoundError(f"no checkpoint found for ckpt_path={ckpt_path!r} under {trainer.run_dir}")
    saved = trainer.strategy.optimizers
    trainer.strategy.optimizers = []  # evaluation restores weights, not optimizer state
    try:
        trainer.strategy.load_checkpoint(path)
    finally:
        trainer.strategy.optimizers = saved


def run_validate(trainer: Trainer, module: TrainModule, **kwargs: Any) -> list[dict[str, float]]:
    return _eval_entry(trainer, module, stage="validate", **kwargs)


def run_test(trainer: Trainer, module: TrainModule, **kwargs: Any) -> list[dict[str, float]]:
    return _eval_entry(trainer, module, stage="test", **kwargs)


def run_predict(trainer: Trainer, module: TrainModule, dataloaders: Any, datamodule: Any,
                ckpt_path: str | None) -> list[Any]:
    strategy = trainer.strategy
    _setup_module(trainer, module, with_optimizers=False)
    loader = _pick_loader(trainer, module, dataloaders, datamodule, "predict")
    if loader is None:
        raise ValueError(f"no predict data: pass dataloaders to predict() or define predict_dataloader() "
                         f"on {type(module).__name__}")
    if ckpt_path is not None:
        _load_weights_only(trainer, ckpt_path)
    module.eval()
    outputs = []
    limit = trainer.config.limit_predict_batches
    with torch.no_grad():
        for batch_idx, batch in enumerate(loader):
            if limit is not None and batch_idx >= limit:
                break
            batch = strategy.batch_to_device(batch)
            output = strategy.eval_step("predict", batch, batch_idx)
            if output is not PADDING_BATCH:
                outputs.append(output)
    return outputs

