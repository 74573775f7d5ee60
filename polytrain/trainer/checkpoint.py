"""The checkpoint payload (DESIGN §4): what the Trainer adds to the model and optimizer state.

A payload holds everything needed to continue exactly: model and optimizer state (added by the
strategy, which knows whether they are sharded), schedulers, grad scaler, loop position
(epoch, global step, batches consumed in the epoch), sampler seed, every rank's RNG state, the
config and the library version. Only plain types and tensors, so ``weights_only=True`` loads it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from polytrain.checkpoint.replicated import agree_on_error
from polytrain.core.rng import capture_rng_state
from polytrain.core.version import __version__
from polytrain.trainer.hparams import plain

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

log = logging.getLogger("polytrain")

FORMAT_VERSION = 1


def _sample_offset(trainer: Trainer, epoch_done: bool) -> int | None:
    if epoch_done or trainer.batch_in_epoch == 0:
        return 0
    batch_size = getattr(trainer, "train_batch_size", None)
    if not batch_size:
        return None
    base_offset, base_batch = getattr(trainer, "sample_base", (0, 0))  # set when a resume re-split the data
    return base_offset + (trainer.batch_in_epoch - base_batch) * batch_size * trainer.strategy.dp_size


def _rank_rng(trainer: Trainer, epoch_done: bool) -> dict[str, Any]:
    """This rank's RNG streams (with the sharded-region stream, ``polytrain.layers.sharded_rng``) and,
    mid-epoch, the state the epoch's DataLoader iterator drew its workers' base seed from: a resume
    recreates that iterator and replays the consumed batches through the workers."""
    state = capture_rng_state()
    if not epoch_done and trainer.batch_in_epoch > 0 and trainer.loader_rng is not None:
        state["loader_iter"] = trainer.loader_rng
    return state


def build_payload(trainer: Trainer, epoch_done: bool) -> dict[str, Any]:
    """Called on every rank (it gathers RNG states); the strategy adds model/optimizer state. Hooks in
    Lightning's order: callbacks' and the DataModule's ``state_dict``, then ``on_save_checkpoint`` of
    the callbacks and of the module (both may add keys)."""
    strategy, module, datamodule = trainer.strategy, trainer.module, trainer.datamodule
    # The live model state, for hooks that read checkpoint["state_dict"] (Lightning code does); the
    # strategy writes the model itself (under "model", gathered or sharded), so this is not saved.
    state_dict = module.state_dict()
    loop = {
        "epoch": trainer.current_epoch + (1 if epoch_done else 0),
        "global_step": trainer.global_step,
        "batch_in_epoch": 0 if epoch_done else trainer.batch_in_epoch,
        "batches_stepped": trainer.batches_stepped,
        "world_size": strategy.world_size,
        "dp_size": strategy.dp_size,
        # Global sample positions of this epoch's permutation already consumed (any dp size resumes from it).
        "sample_offset": _sample_offset(trainer, epoch_done),
    }
    payload: dict[str, Any] = {
        "polytrain": {"format": FORMAT_VERSION, "version": __version__},
        "epoch": loop["epoch"],
        "global_step": trainer.global_step,
        "state_dict": state_dict,
        "loop": loop,
        "sampler": {"seed": trainer.config.seed},
        "rng": strategy.all_gather_object(_rank_rng(trainer, epoch_done)),
        "schedulers": [s.scheduler.state_dict() for s in trainer.lr_scheduler_configs],
        "precision": strategy.precision.state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "config": plain(trainer.config_dict()),
        "hyper_parameters": plain(dict(module.hparams)),
    }
    if datamodule is not None:
        payload["datamodule"] = {type(datamodule).__qualname__: datamodule.state_dict()}
        payload["datamodule_hyper_parameters"] = plain(dict(datamodule.hparams))
    with trainer.metrics.refusing("on_save_checkpoint"):
        trainer.hooks.callbacks_only("on_save_checkpoint", payload)
        module.on_save_checkpoint(payload)
    return payload


def restore_payload(trainer: Trainer, payload: dict[str, Any]) -> None:
    """Everything but model/optimizer state (the strategy restored those), in Lightning's order: the
    module's ``on_load_checkpoint``, the DataModule's state, the callbacks' ``on_load_checkpoint``
    and ``load_state_dict``; then schedulers, grad scaler, loop position and RNG."""
    if "state_dict" not in payload:  # what Lightning code reads: the weights just loaded
        payload["state_dict"] = payload.get("model") or trainer.module.state_dict()
    trainer.module.on_load_checkpoint(payload)
    datamodule = trainer.datamodule
    if datamodule is not None:
        state = payload.get("datamodule", {}).get(type(datamodule).__qualname__)
        if state is not None:
            datamodule.load_state_dict(state)
    trainer.hooks.callbacks_only("on_load_checkpoint", payload)
    states = payload.get("callbacks", {})
    for cb in trainer.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
    for sched, state in zip(trainer.lr_scheduler_configs, payload.get("schedulers", [])):
        sched.scheduler.load_state_dict(state)
    if payload.get("precision"):
        trainer.strategy.precision.load_state_dict(payload["precision"])
    loop = payload.get("loop")
    if loop is not None:
        trainer.restore_loop(loop)
        rng = payload.get("rng") or []
        if len(rng) == trainer.strategy.world_size:
            trainer.pending_rng = rng[trainer.strategy.global_rank]
        elif rng:
            log.warning("checkpoint was written by %d ranks and this job has %d: RNG streams restart from "
                        "the seed, so random ops (dropout, augmentation) will differ from the original run",
                        len(rng), trainer.strategy.world_size)


def ensure_run_dir(trainer: Trainer) -> None:
    """Create ``run_dir`` before the first step: an unwritable path then fails at once, with one
    clear error on every rank, instead of after an epoch inside a logger on one rank only."""
    if (not trainer.loggers and trainer.checkpoint_callback is None) or trainer.config.fast_dev_run:
        return  # nothing will write there
    error = None
    if trainer.is_global_zero or trainer.is_logging_rank:
        try:
            os.makedirs(trainer.run_dir, exist_ok=True)
            if not os.access(trainer.run_dir, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as err:
            error = (f"cannot write trainer.run_dir={trainer.run_dir}: {err.strerror or err}. Point "
                     f"trainer.run_dir at a writable directory")
    agree_on_error(trainer.strategy, error)
