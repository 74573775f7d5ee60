"""What every entry point (fit, validate, test, predict) does around its loop, in Lightning's order:

    seed -> configure_callbacks -> prepare_data (one process per node, the rest wait) -> setup(stage) on
    the DataModule, the callbacks and the module -> configure_model and the strategy's wrapping ->
    ... the stage ... -> teardown(stage) on the DataModule, the callbacks and the module.

and the seeding rule (``polytrain.core.rng``): with ``trainer.seed`` unset, rank 0's random streams
are shared with every rank before anything is built, and nothing is reseeded. Every hook goes through
the stage's funnel (``Hooks``). Each step is handed what it uses: the strategy, the funnel, the module,
the DataModule, the callbacks.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

import torch

from polytrain.callbacks.base import Callback
from polytrain.callbacks.loggers import Logger, merged_hparams
from polytrain.callbacks.model_checkpoint import ModelCheckpoint
from polytrain.checkpoint.hugging_face import (
    find_pretrained,
    ignore_patterns,
    load_pretrained,
    pretrained_source,
    tied_weights,
    within,
)
from polytrain.core.errors import ConfigError, RankFailedError, first_few
from polytrain.core.rng import capture_rng_state, restore_rng_state, seed_all, user_seed
from polytrain.parallel.float8 import convert_to_float8, has_float8_matmuls, resolve_float8
from polytrain.parallel.fully_shard import uninitialisable_on_meta
from polytrain.trainer.api.datamodule import DataModule
from polytrain.trainer.api.hooks import (
    CALLBACK_HOOKS,
    DATAMODULE_HOOKS,
    MODULE_HOOKS,
    Hooks,
    is_overridden,
    warn_unknown_hooks,
)
from polytrain.trainer.api.module import TrainModule
from polytrain.trainer.observability.metrics import MetricCollector

log = logging.getLogger("polytrain")


def seed(strategy: Any, configured: int | None) -> None:
    """Every stage starts here. ``trainer.seed`` (``configured``): everything built before training sees
    the same stream on every rank. Without it, under several processes: when the user called
    ``seed_everything``, every rank is re-seeded from that seed, as Lightning's multi-process strategies do
    at each stage; otherwise rank 0's stream is shared, whatever the user seeded (or not) there."""
    if configured is not None:
        seed_all(configured)  # identical on every rank while things are built; per rank in training
        return
    if strategy.world_size > 1 and user_seed() is not None:
        seed_all(user_seed())
        return
    if strategy.world_size > 1:
        # Whatever the user seeded (or not) on rank 0, every rank builds from the same stream.
        state = strategy.broadcast(capture_rng_state() if strategy.is_global_zero else None)
        restore_rng_state({k: v for k, v in state.items() if k not in ("cuda", "sharded")})


def merge_callbacks(base: list[Callback], extra: Any) -> list[Callback]:
    """``configure_callbacks``' callbacks replace the Trainer's of the same type; checkpointing last."""
    extra = [] if extra is None else [extra] if isinstance(extra, Callback) else list(extra)
    kinds = {type(cb) for cb in extra}
    merged = [cb for cb in base if type(cb) not in kinds] + extra
    merged.sort(key=lambda c: isinstance(c, ModelCheckpoint))
    return merged


def begin(stage: str, *, strategy: Any, hooks: Hooks, module: TrainModule, datamodule: DataModule | None,
          callbacks: list[Callback], float8_option: Any, init_weights: Any = None) -> None:
    """Everything between the stage's funnel and its loop; every rank calls it (it holds collectives).
    ``float8_option`` is ``trainer.float8`` as configured; ``init_weights`` a Hugging Face directory whose
    weights fill the module's model once the strategy has placed it (None: not asked for, or a resume)."""
    warn_unknown_hooks(module, MODULE_HOOKS, TrainModule)
    for cb in callbacks:
        warn_unknown_hooks(cb, CALLBACK_HOOKS, Callback)
        # As Lightning: self.log / self.log_dict in a callback's hooks log through the module (a class
        # with methods of those names keeps them).
        for name in ("log", "log_dict"):
            if not hasattr(type(cb), name):
                setattr(cb, name, getattr(module, name))
    if datamodule is not None:
        warn_unknown_hooks(datamodule, DATAMODULE_HOOKS, DataModule)
    _prepare_data(strategy, hooks, module, datamodule)
    if any(isinstance(cb, Logger) for cb in callbacks):
        merged_hparams(datamodule, module)  # every rank: a clash raises everywhere, before anything is logged
    hooks.datamodule("setup", stage=stage)
    hooks.callbacks("setup", stage=stage)
    hooks.module("setup", stage=stage)
    first = strategy.module is not module
    if is_overridden(module, "configure_model", TrainModule):
        # As Lightning: when defined, in every stage, so it must be idempotent; on meta the first time.
        before = [id(p) for p in module.parameters()]
        if first:
            _configure_model(strategy, hooks, module, init_weights)
        else:
            hooks.module("configure_model")
        if not first and [id(p) for p in module.parameters()] != before:
            raise ConfigError(
                f"{type(module).__name__}.configure_model() built new layers when called again for "
                f"{stage}(): the trained weights were replaced. It runs in every stage (as in Lightning), so "
                f"make it idempotent, e.g. start it with `if hasattr(self, 'net'): return`")
    float8 = resolve_float8(float8_option)
    if first and float8 is not None and float8["auto"] and not has_float8_matmuls(strategy.root_device):
        log.info("float8: auto leaves the Linear layers in high precision: %s has no float8 matmuls",
                 strategy.root_device)
        float8 = None
    if first and float8 is not None:
        # Before the strategy: every parallelism then sees the layers in their final form.
        convert_to_float8(module, float8)
    pretrained = _pretrained_model(strategy, module, init_weights) if first else None
    if first:
        strategy.setup_module(module)
    if pretrained is not None:
        _fill_pretrained(strategy, pretrained)


def _pretrained_model(strategy: Any, module: TrainModule, init_weights: Any) -> Any:
    """The module's Hugging Face model that ``init_weights`` fills (None without one): found before the
    strategy changes the module, and announced to it, so a model on the meta device is only allocated."""
    if init_weights is None:
        return None
    directory, name = pretrained_source(init_weights)
    path, model = find_pretrained(module, name)
    strategy.expect_weights_after_setup(within(path))
    return directory, path, type(model).__name__, tied_weights(model), ignore_patterns(model)


def _fill_pretrained(strategy: Any, pretrained: Any) -> None:
    """The directory's weights into the model as the strategy holds it: each rank reads its own slices."""
    directory, path, architecture, ties, (ignore_missing, ignore_unexpected) = pretrained
    report = load_pretrained(strategy.state_parts(), path, ties, directory, ignore_missing, ignore_unexpected)
    if strategy.is_global_zero:
        log.info("init_weights: %s (%s) filled from %s: %d tensors; this rank read %d elements",
                 architecture, path or "the module itself", directory, report.tensors, report.elements_read)


def _configure_model(strategy: Any, hooks: Hooks, module: TrainModule, init_weights: Any) -> None:
    """The first ``configure_model``, under the strategy's init context (the meta device when it shards:
    each rank then allocates its shards only). Layers built on meta that no ``reset_parameters()`` can
    initialise (a library's own: Hugging Face's ``Conv1D``, ``LlamaRMSNorm``) are built again, at full size
    on the CPU from the same RNG state, as Lightning builds them unless asked for meta: the weights equal a
    one-process build, and the strategy shards them as it shards a model built in ``__init__``."""
    rng = torch.get_rng_state()
    attributes = {k: dict(v) if k in ("_modules", "_parameters", "_buffers") else v
                  for k, v in module.__dict__.items()}
    context = strategy.model_init_context()
    with context:
        hooks.module("configure_model")
    # Only what the strategy put on meta: a module that builds on meta itself keeps its own choice
    on_meta = isinstance(context, torch.device) and context.type == "meta"
    # what init_weights fills needs no initialisation: it stays on meta, and each rank reads its shards
    filled = (within(find_pretrained(module, pretrained_source(init_weights)[1])[0])
              if init_weights is not None else None)
    stuck = uninitialisable_on_meta(module, filled) if on_meta else []
    if not stuck:
        return
    if strategy.is_global_zero:
        log.warning("configure_model built layers on the meta device that have no reset_parameters() to "
                    "initialise them (%s): built again at full size on the CPU, then sharded. Give them "
                    "reset_parameters() to build on meta (each rank then holds its shards only)",
                    first_few(stuck))
    module.__dict__.clear()  # as before configure_model: it builds its layers again, not on meta
    module.__dict__.update(attributes)
    torch.set_rng_state(rng)
    hooks.module("configure_model")


def end(hooks: Hooks, stage: str) -> None:
    hooks.datamodule("teardown", stage=stage)
    hooks.callbacks("teardown", stage=stage)
    hooks.module("teardown", stage=stage)


def _prepare_data(strategy: Any, hooks: Hooks, module: TrainModule, datamodule: DataModule | None) -> None:
    """Downloads run on one process per node (local rank 0) or, with ``prepare_data_per_node=False``,
    once in all (global rank 0); every rank then meets at a barrier, so no rank reads half a file. If
    it raises, every rank stops with that rank's traceback (``_raise_first_failure``). Without a
    ``prepare_data`` (decided by the classes, the same on every rank) there is no barrier, as in Lightning."""
    preparers = [(obj, call) for obj, base, call in ((datamodule, DataModule, hooks.datamodule),
                                                     (module, TrainModule, hooks.module))
                 if obj is not None and is_overridden(obj, "prepare_data", base)]
    if not preparers:
        return
    error: Exception | None = None
    try:
        for obj, call in preparers:
            per_node = getattr(obj, "prepare_data_per_node", True)
            if strategy.local_rank == 0 if per_node else strategy.is_global_zero:
                call("prepare_data")
    except Exception as err:  # noqa: BLE001 - re-raised below, once every rank knows
        error = err
    # The barrier: every rank meets here, and learns whether a preparing rank failed.
    if strategy.reduce_boolean_decision(error is not None):
        _raise_first_failure(strategy, error, "prepare_data")


def _raise_first_failure(strategy: Any, error: Exception | None, step: str) -> None:
    """Every rank calls this once a rank failed in ``step``: the failing ranks raise their own error, the
    others an error holding the first failing rank's traceback (whichever a launcher shows first is real)."""
    reports = strategy.all_gather_object(None if error is None
                                         else "".join(traceback.format_exception(error)))
    if error is not None:
        raise error
    rank = next(r for r, report in enumerate(reports) if report is not None)
    raise RankFailedError(f"{step} raised on rank {rank}, so every rank stops (this is rank "
                          f"{strategy.global_rank}). "
                          f"Rank {rank}'s error:\n{reports[rank].rstrip()}")


def batch_transfer(strategy: Any, hooks: Hooks, metrics: MetricCollector,
                   indexed: bool = False) -> Callable[..., Any]:
    """How a stage moves each batch: the strategy's move, or the batch-transfer hooks around it when the
    DataModule or the module overrides one of them (``Hooks.transfer_plan``); what those log is refused.
    ``indexed``: the mover is called as ``(batch, dataloader_idx)`` (an evaluation's several loaders);
    training calls it with the batch alone, so its mover stays the strategy's own, a call fewer."""
    before, move, after = hooks.transfer_plan()
    if before is None and move is None and after is None:
        mover = strategy.batch_mover()
        if not indexed:
            return mover
        return lambda batch, dataloader_idx=0: mover(batch)
    refusing = metrics.refusing("a batch-transfer hook")

    def transfer(batch: Any, dataloader_idx: int = 0) -> Any:
        with refusing:
            if before is not None:
                batch = before(batch, dataloader_idx)
            if move is not None:
                batch = strategy.precision.convert_input(move(batch, strategy.root_device, dataloader_idx))
            else:
                batch = strategy.batch_to_device(batch)
            return after(batch, dataloader_idx) if after is not None else batch

    return transfer
