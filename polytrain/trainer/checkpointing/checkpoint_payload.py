"""The checkpoint payload (docs/architecture.md, "Checkpoints"): what the Trainer adds to the model and
optimizer state. Taking it back is ``trainer/checkpointing/resume.py``'s.

A payload holds everything needed to continue exactly: model and optimizer state (added by the
strategy, which knows whether they are sharded), schedulers, grad scaler, the loop's state (its
``state_dict``: epoch, global step, batches consumed in the epoch, whether a validation is due),
sampler seed, every rank's RNG state, every rank's state of stateful training data (``data``), the
config and the library version. Only plain types and tensors, so ``weights_only=True`` loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polytrain.core.rng import capture_rng_state
from polytrain.core.version import __version__
from polytrain.data.loaders import user_sampler_state
from polytrain.data.stateful import rank_entry
from polytrain.trainer.api.hparams import plain

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

FORMAT_VERSION = 1


def _rank_rng(trainer: Trainer) -> dict[str, Any]:
    """This rank's RNG streams (with the sharded-region stream, ``polytrain.layers.sharded_rng``);
    mid-epoch, the state the epoch's DataLoader iterator drew its workers' base seed from: a resume
    recreates that iterator and replays the consumed batches through the workers; and the generator of
    a split user sampler (``user_sampler``), which a resume sets before the epoch draws again."""
    state = capture_rng_state()
    loop = trainer.fit_loop
    mid_epoch = not loop.progress.at_epoch_end and loop.progress.batch_in_epoch > 0
    if mid_epoch and loop.data.loader_rng is not None:
        state["loader_iter"] = loop.data.loader_rng
    sampler = user_sampler_state(loop.data.train_loader, mid_epoch)
    if sampler is not None:
        state["user_sampler"] = sampler
    return state


def _rank_data(trainer: Trainer) -> dict[str, Any] | None:
    """This rank's stateful training data (``data/stateful.py``), or None. Mid-epoch from iterable-style
    data: the snapshot taken after the last consumed batch (the loop has fetched one batch ahead)."""
    loop, strategy = trainer.fit_loop, trainer.strategy
    stream, progress = loop.data.stream, loop.progress
    mid_epoch = not progress.at_epoch_end and progress.batch_in_epoch > 0
    snapshot = stream.state if mid_epoch and stream is not None and stream.snapshot is not None else None
    return rank_entry(loop.data.train_loader, strategy.dp_rank, strategy.dp_size, snapshot)


def _rank_states(trainer: Trainer) -> tuple[list[Any], list[Any] | None]:
    """Every rank's RNG state and data state, in one gather (a checkpoint adds no collective for data)."""
    gathered = trainer.strategy.all_gather_object((_rank_rng(trainer), _rank_data(trainer)))
    data = [d for _, d in gathered]
    return [r for r, _ in gathered], (data if any(d is not None for d in data) else None)


def build_payload(trainer: Trainer) -> dict[str, Any]:
    """Called on every rank (it gathers RNG states); the strategy adds model/optimizer state. Hooks in
    Lightning's order: callbacks' and the DataModule's ``state_dict``, then ``on_save_checkpoint`` of
    the callbacks and of the module (both may add keys)."""
    strategy, module, datamodule, hooks = trainer.strategy, trainer.module, trainer.datamodule, trainer.hooks
    loop = trainer.fit_loop.progress.state_dict()
    rng, data = _rank_states(trainer)
    payload: dict[str, Any] = {
        "polytrain": {"format": FORMAT_VERSION, "version": __version__},
        "epoch": loop["epoch"],
        "global_step": loop["global_step"],
        # The live model state, for hooks that read checkpoint["state_dict"] (Lightning code does); the
        # strategy writes the model itself (under "model", gathered or sharded), so this is not saved.
        "state_dict": module.state_dict(),
        "loop": loop,
        "sampler": {"seed": trainer.config.seed},
        "rng": rng,
        "schedulers": [s.scheduler.state_dict() for s in trainer.lr_scheduler_configs],
        "precision": strategy.precision.state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "config": plain(trainer.config_dict()),
        "hyper_parameters": plain(dict(module.hparams)),
    }
    if data is not None:
        payload["data"] = data  # per rank: {"dp_rank", "dp_size", "state"}
    if datamodule is not None:
        payload["datamodule"] = {type(datamodule).__qualname__: hooks.datamodule("state_dict")}
        payload["datamodule_hyper_parameters"] = plain(dict(datamodule.hparams))
    with trainer.metrics.refusing("on_save_checkpoint"):
        hooks.callbacks("on_save_checkpoint", payload)
        hooks.module("on_save_checkpoint", payload)
    return payload
