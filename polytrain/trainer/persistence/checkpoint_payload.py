"""The checkpoint payload (docs/architecture.md, "Checkpoints"): what the Trainer adds to the model and
optimizer state. Taking it back is ``trainer/persistence/resume.py``'s.

A payload holds everything needed to continue exactly: model and optimizer state (added by the
strategy, which knows whether they are sharded), schedulers, grad scaler, the loop's state (its
``state_dict``: epoch, global step, batches consumed in the epoch, whether a validation is due),
sampler seed, every rank's RNG state, every rank's state of stateful training data (``data``), the
config and the library version. Only plain types and tensors, so ``weights_only=True`` loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polytrain.checkpoint.hugging_face import RECORD_KEY, pretrained_records
from polytrain.core.rng import capture_rng_state
from polytrain.core.version import __version__
from polytrain.data.loaders import user_sampler_state
from polytrain.data.stateful import rank_entry
from polytrain.trainer.api.hparams import hparams_container, plain

if TYPE_CHECKING:
    from polytrain.trainer.loops.progress import EpochData, FitProgress

FORMAT_VERSION = 1


@dataclass(eq=False, repr=False)  # a bundle of live objects: no comparison, no dump
class PayloadSources:
    """What a checkpoint payload is read from, each named: the Trainer gathers them for a save."""

    strategy: Any
    hooks: Any  # the stage's funnel (callbacks' and the module's on_save_checkpoint, the DataModule's state)
    metrics: Any  # its ``refusing``: logging inside on_save_checkpoint is an error, as Lightning
    module: Any
    datamodule: Any
    callbacks: list[Any]
    progress: FitProgress
    epoch_data: EpochData  # the loader (user sampler, stateful data) and the epoch iterator's RNG
    schedulers: list[Any]  # the fit's LR scheduler configs
    config: dict[str, Any]  # the run's whole config, as ``trainer.config_dict()`` gives it
    seed: int | None
    weights_only: bool = False  # the model without optimizer, scheduler, precision or callback state


def _rank_rng(progress: FitProgress, epoch_data: EpochData) -> dict[str, Any]:
    """This rank's RNG streams (with the sharded-region stream, ``polytrain.layers.sharded_rng``);
    mid-epoch, the state the epoch's DataLoader iterator drew its workers' base seed from: a resume
    recreates that iterator and replays the consumed batches through the workers; and the generator of
    a split user sampler (``user_sampler``), which a resume sets before the epoch draws again."""
    state = capture_rng_state()
    mid_epoch = not progress.at_epoch_end and progress.batch_in_epoch > 0
    if mid_epoch and epoch_data.loader_rng is not None:
        state["loader_iter"] = epoch_data.loader_rng
    sampler = user_sampler_state(epoch_data.train_loader, mid_epoch)
    if sampler is not None:
        state["user_sampler"] = sampler
    return state


def _rank_data(progress: FitProgress, epoch_data: EpochData, strategy: Any) -> dict[str, Any] | None:
    """This rank's stateful training data (``data/stateful.py``), or None. Mid-epoch from iterable-style
    data: the snapshot taken after the last consumed batch (the loop has fetched one batch ahead)."""
    stream = epoch_data.stream
    mid_epoch = not progress.at_epoch_end and progress.batch_in_epoch > 0
    snapshot = stream.state if mid_epoch and stream is not None and stream.snapshot is not None else None
    return rank_entry(epoch_data.train_loader, strategy.dp_rank, strategy.dp_size, snapshot)


def _rank_states(sources: PayloadSources) -> tuple[list[Any], list[Any] | None]:
    """Every rank's RNG state and data state, in one gather (a checkpoint adds no collective for data)."""
    progress, epoch_data, strategy = sources.progress, sources.epoch_data, sources.strategy
    gathered = strategy.all_gather_object((_rank_rng(progress, epoch_data),
                                           _rank_data(progress, epoch_data, strategy)))
    data = [d for _, d in gathered]
    return [r for r, _ in gathered], (data if any(d is not None for d in data) else None)


def build_payload(sources: PayloadSources) -> dict[str, Any]:
    """Called on every rank (it gathers RNG states); the strategy adds model/optimizer state. Hooks in
    Lightning's order: callbacks' and the DataModule's ``state_dict``, then ``on_save_checkpoint`` of
    the callbacks and of the module (both may add keys). ``weights_only`` (Lightning's): no scheduler,
    precision or callback state and no callback hooks; the payload says so, and a fit refuses to resume
    from it."""
    strategy, module, datamodule, hooks = sources.strategy, sources.module, sources.datamodule, sources.hooks
    loop = sources.progress.state_dict()
    rng, data = _rank_states(sources)
    payload: dict[str, Any] = {
        "polytrain": {"format": FORMAT_VERSION, "version": __version__},
        # trainer.current_epoch when saved, as Lightning's: an epoch-end file names the epoch it finished
        # (``loop`` says where a resume continues)
        "epoch": sources.progress.epoch,
        "global_step": loop["global_step"],
        # The live model state, for hooks that read checkpoint["state_dict"] (Lightning code does); the
        # strategy writes the model itself (under "model", gathered or sharded), so this is not saved.
        "state_dict": module.state_dict(),
        "loop": loop,
        "sampler": {"seed": sources.seed},
        "rng": rng,
        "schedulers": [s.scheduler.state_dict() for s in sources.schedulers],
        "precision": strategy.precision.state_dict(),
        "callbacks": _callback_states(sources.callbacks),
        "config": plain(sources.config),
        "hyper_parameters": plain(dict(module.hparams)),
        **hparams_container(module),
    }
    if data is not None:
        payload["data"] = data  # per rank: {"dp_rank", "dp_size", "state"}
    pretrained = pretrained_records(module)  # what `polytrain checkpoint export --format hf` needs
    if pretrained:
        payload[RECORD_KEY] = pretrained
    if datamodule is not None:
        payload["datamodule"] = {type(datamodule).__qualname__: hooks.datamodule("state_dict")}
        payload["datamodule_hyper_parameters"] = plain(dict(datamodule.hparams))
        payload.update({f"datamodule_{k}": v for k, v in hparams_container(datamodule).items()})
    if sources.weights_only:
        for key in ("schedulers", "precision", "callbacks"):
            del payload[key]
        payload["weights_only"] = True
    with sources.metrics.refusing("on_save_checkpoint"):
        if not sources.weights_only:
            hooks.callbacks("on_save_checkpoint", payload)
        hooks.module("on_save_checkpoint", payload)
    return payload


def _callback_states(callbacks: list[Any]) -> dict[str, Any]:
    """Each callback's ``state_dict()`` under its ``state_key``. Only a mapping is a state: a logger or
    any other object that answers ``state_dict()`` with something else (a stand-in, a live object) is
    not pickled into the checkpoint, where it would fail the save or load only with its class around."""
    states = {}
    for callback in callbacks:
        state = callback.state_dict()
        if isinstance(state, Mapping):
            states[callback.state_key] = state
    return states
