"""What every entry point (fit, validate, test, predict) does around its loop, in Lightning's order:

    configure_callbacks -> prepare_data (one process per node, the rest wait) -> setup(stage) on the
    DataModule, the callbacks and the module -> configure_model and the strategy's wrapping ->
    ... the stage ... -> teardown(stage) on the DataModule, the callbacks and the module.

and the seeding rule (``polytrain.core.rng``): with ``trainer.seed`` unset, rank 0's random streams
are shared with every rank before anything is built, and nothing is reseeded.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from polytrain.callbacks.base import Callback
from polytrain.callbacks.checkpoint import ModelCheckpoint
from polytrain.checkpoint.layout import resolve_resume
from polytrain.core.errors import ConfigError
from polytrain.core.rng import capture_rng_state, restore_rng_state, seed_everything
from polytrain.trainer import checkpoint as ckpt
from polytrain.trainer.datamodule import DataModule
from polytrain.trainer.hooks import (
    CALLBACK_HOOKS,
    DATAMODULE_HOOKS,
    MODULE_HOOKS,
    Hooks,
    defines,
    overridden,
    warn_unknown_hooks,
)
from polytrain.trainer.module import TrainModule

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

log = logging.getLogger("polytrain")


def begin(trainer: Trainer, stage: str) -> None:
    """Everything before a stage's loop; every rank calls it (it holds collectives)."""
    module = trainer.module
    _seed(trainer)
    trainer.callbacks = _merge_callbacks(trainer.base_callbacks, module.configure_callbacks())
    trainer.hooks = Hooks(trainer, module, trainer.callbacks)
    warn_unknown_hooks(module, MODULE_HOOKS, TrainModule)
    for cb in trainer.callbacks:
        warn_unknown_hooks(cb, CALLBACK_HOOKS, Callback)
    if trainer.datamodule is not None:
        warn_unknown_hooks(trainer.datamodule, DATAMODULE_HOOKS, DataModule)
    if stage == "fit":
        ckpt.ensure_run_dir(trainer)
    _prepare_data(trainer)
    kwargs = {"stage": stage}
    if trainer.datamodule is not None:
        trainer.datamodule.setup(**kwargs)
    trainer.hooks.callbacks_only("setup", **kwargs)
    module.setup(**kwargs)
    first = trainer.strategy.module is not module
    if _overridden(module, "configure_model", TrainModule):
        # As Lightning: when defined, in every stage, so it must be idempotent; on meta the first time.
        before = [id(p) for p in module.parameters()]
        with trainer.strategy.model_init_context() if first else contextlib.nullcontext():
            module.configure_model()
        if not first and [id(p) for p in module.parameters()] != before:
            raise ConfigError(
                f"{type(module).__name__}.configure_model() built new layers when called again for {stage}(): the "
                f"trained weights were replaced. It runs in every stage (as in Lightning), so make it idempotent, "
                f"e.g. start it with `if hasattr(self, 'net'): return`")
    if first:
        trainer.strategy.setup_module(module)
    trainer.bind_strategy_hooks()


def end(trainer: Trainer, stage: str) -> None:
    kwargs = {"stage": stage}
    if trainer.datamodule is not None:
        trainer.datamodule.teardown(**kwargs)
    trainer.hooks.callbacks_only("teardown", **kwargs)
    trainer.module.teardown(**kwargs)


def _seed(trainer: Trainer) -> None:
    seed, strategy = trainer.config.seed, trainer.strategy
    if seed is not None:
        seed_everything(seed)  # identical on every rank while things are built; per rank once training starts
        return
    if strategy.world_size > 1:
        # Whatever the user seeded (or not) on rank 0, every rank builds from the same stream.
        state = strategy.broadcast(capture_rng_state() if strategy.is_global_zero else None)
        restore_rng_state({k: v for k, v in state.items() if k not in ("cuda", "sharded")})


def _merge_callbacks(base: list[Callback], extra: Any) -> list[Callback]:
    """``configure_callbacks``' callbacks replace the Trainer's of the same type; checkpointing last."""
    extra = [] if extra is None else [extra] if isinstance(extra, Callback) else list(extra)
    kinds = {type(cb) for cb in extra}
    merged = [cb for cb in base if type(cb) not in kinds] + extra
    merged.sort(key=lambda c: isinstance(c, ModelCheckpoint))
    return merged


def _prepare_data(trainer: Trainer) -> None:
    """Downloads run on one process per node (local rank 0) or, with ``prepare_data_per_node=False``,
    once in all (global rank 0); every rank then meets at a barrier, so no rank reads half a file.
    Without a ``prepare_data`` (decided by the classes, the same on every rank) there is no barrier,
    as in Lightning."""
    strategy = trainer.strategy
    preparers = [obj for obj, base in ((trainer.datamodule, DataModule), (trainer.module, TrainModule))
                 if obj is not None and _overridden(obj, "prepare_data", base)]
    for obj in preparers:
        per_node = getattr(obj, "prepare_data_per_node", True)
        if strategy.local_rank == 0 if per_node else strategy.is_global_zero:
            obj.prepare_data()
    if preparers:
        strategy.barrier("prepare_data")


_overridden = defines


def restore_for_fit(trainer: Trainer, ckpt_path: str | None) -> None:
    """Resume: rank 0 chooses the checkpoint and every rank loads the same one (file systems may
    differ in what they see)."""
    choice = ckpt_path if ckpt_path is not None else trainer.config.resume
    strategy = trainer.strategy
    path = resolve_path(trainer, choice) if strategy.is_global_zero else None
    path = strategy.broadcast(path)
    if path is None:
        return
    log.info("restoring from %s", path)
    ckpt.restore_payload(trainer, strategy.load_checkpoint(path))


def resolve_path(trainer: Trainer, choice: str | None) -> str | None:
    """``None`` | ``"last"`` | ``"auto"`` | ``"best"`` | a path -> the checkpoint to load."""
    if choice == "best":
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None)
        if not best:
            why = "there is no ModelCheckpoint callback" if callback is None else "it has not saved a checkpoint yet"
            raise ConfigError(f"ckpt_path='best' loads the best checkpoint of the ModelCheckpoint callback, but {why}; "
                              f"fit with checkpointing enabled first (monitor=... ranks them), or pass a path or 'last'")
        return best
    return resolve_resume(choice, trainer.run_dir)


def load_weights(trainer: Trainer, ckpt_path: str) -> None:
    """Evaluation from a checkpoint: weights only (optimizer state is not restored)."""
    strategy = trainer.strategy
    path = strategy.broadcast(resolve_path(trainer, ckpt_path) if strategy.is_global_zero else None)
    if path is None:
        raise FileNotFoundError(f"no checkpoint found for ckpt_path={ckpt_path!r} under {trainer.run_dir}")
    saved = strategy.optimizers
    strategy.optimizers = []
    try:
        payload = strategy.load_checkpoint(path)
    finally:
        strategy.optimizers = saved
    trainer.module.on_load_checkpoint(payload)


_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def bind_transfer(trainer: Trainer) -> None:
    """``trainer.transfer_batch``: the strategy's move, or the batch-transfer hooks around it when the
    DataModule (first) or the module overrides one of them."""
    strategy, module, datamodule = trainer.strategy, trainer.module, trainer.datamodule
    chosen: dict[str, Any] = {}
    for name in _TRANSFER_HOOKS:  # Lightning calls them always: skip only those nobody redefined
        if datamodule is not None and defines(datamodule, name, DataModule):
            chosen[name] = getattr(datamodule, name)
        elif overridden(module, name, TrainModule):
            chosen[name] = getattr(module, name)
    if not chosen:
        trainer.transfer_batch = strategy.batch_mover()
        return
    before, move, after = (chosen.get(n) for n in _TRANSFER_HOOKS)
    refusing = trainer.metrics.refusing("a batch-transfer hook")

    def transfer(batch: Any, dataloader_idx: int = 0) -> Any:
        with refusing:
            if before is not None:
                batch = before(batch, dataloader_idx)
            if move is not None:
                batch = strategy.precision.convert_input(move(batch, strategy.root_device, dataloader_idx))
            else:
                batch = strategy.batch_to_device(batch)
            return after(batch, dataloader_idx) if after is not None else batch

    trainer.transfer_batch = transfer
