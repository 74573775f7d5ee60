"""The checkpoint payload (DESIGN §4) and finding the checkpoint to resume from.

A payload holds everything needed to continue exactly: model and optimizer state (added by the
strategy, which knows whether they are sharded), schedulers, grad scaler, loop position
(epoch, global step, batches consumed in the epoch), sampler seed, every rank's RNG state, the
config and the library version. Only plain types and tensors, so ``weights_only=True`` loads it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from polytrain.trainer.seed import capture_rng_state

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

log = logging.getLogger("polytrain")

FORMAT_VERSION = 1
LATEST_POINTER = "latest"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _plain(value: Any) -> Any:
    """Keep what ``weights_only`` can load; describe anything else by its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _sample_offset(trainer: Trainer, epoch_done: bool) -> int | None:
    if epoch_done or trainer.batch_in_epoch == 0:
        return 0
    batch_size = getattr(trainer, "train_batch_size", None)
    if not batch_size:
        return None
    base_offset, base_batch = getattr(trainer, "sample_base", (0, 0))  # set when a resume re-split the data
    return base_offset + (trainer.batch_in_epoch - base_batch) * batch_size * trainer.strategy.dp_size


def build_payload(trainer: Trainer, epoch_done: bool) -> dict[str, Any]:
    """Called on every rank (it gathers RNG states); the strategy adds model/optimizer state."""
    from polytrain import __version__

    strategy = trainer.strategy
    loop = {
        "epoch": trainer.current_epoch + (1 if epoch_done else 0),
        "global_step": trainer.global_step,
        "batch_in_epoch": 0 if epoch_done else trainer.batch_in_epoch,
        "world_size": strategy.world_size,
        "dp_size": strategy.dp_size,
        # Global sample positions of this epoch's permutation already consumed (any dp size resumes from it).
        "sample_offset": _sample_offset(trainer, epoch_done),
    }
    payload: dict[str, Any] = {
        "polytrain": {"format": FORMAT_VERSION, "version": __version__},
        "loop": loop,
        "sampler": {"seed": trainer.config.seed},
        "rng": strategy.all_gather_object(capture_rng_state()),
        "schedulers": [s["scheduler"].state_dict() for s in trainer.schedulers],
        "precision": strategy.precision.state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "config": _plain(trainer.config_dict()),
    }
    trainer.module.on_save_checkpoint(payload)
    return payload


def restore_payload(trainer: Trainer, payload: dict[str, Any]) -> None:
    """Everything but model/optimizer state (the strategy restored those)."""
    for sched, state in zip(trainer.schedulers, payload.get("schedulers", [])):
        sched["scheduler"].load_state_dict(state)
    if payload.get("precision"):
        trainer.strategy.precision.load_state_dict(payload["precision"])
    states = payload.get("callbacks", {})
    for cb in trainer.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
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
    trainer.module.on_load_checkpoint(payload)


def ensure_run_dir(trainer: Trainer) -> None:
    """Create ``run_dir`` before the first step: an unwritable path then fails at once, with one
    clear error on every rank, instead of after an epoch inside a logger on one rank only."""
    from polytrain.strategies.checkpoint_io import agree_on_error

    if not trainer.loggers and trainer.checkpoint_callback is None:
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


# --------------------------------------------------------------------------- locating


def is_complete(path: str) -> bool:
    """A file that loads, or a sharded directory whose metadata was committed last."""
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, ".metadata")) and os.path.exists(os.path.join(path, "meta.pt"))
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return True
    except Exception:  # noqa: BLE001 - torn, truncated or refused: not a resume candidate
        return False


def candidates(ckpt_dir: str) -> list[str]:
    """Checkpoints in ``ckpt_dir``, the one named by the ``latest`` pointer first, then newest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    entries = [os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir)
               if not n.startswith(".") and n != LATEST_POINTER and (n.endswith(".ckpt") or
                                                                       os.path.isdir(os.path.join(ckpt_dir, n)))]
    entries.sort(key=lambda p: os.path.getmtime(p), reverse=True)
    pointer = os.path.join(ckpt_dir, LATEST_POINTER)
    if os.path.exists(pointer):
        with open(pointer, encoding="utf-8") as fh:
            named = os.path.join(ckpt_dir, fh.read().strip())
        if named in entries:
            entries.remove(named)
            entries.insert(0, named)
    return entries


def find_resumable(ckpt_dir: str) -> str | None:
    """The newest complete checkpoint; a torn newer one is skipped with a warning."""
    for i, path in enumerate(candidates(ckpt_dir)):
        if is_complete(path):
            if i:
                log.warning("resuming from %s: %d newer checkpoint(s) in %s are incomplete or corrupt",
                            path, i, ckpt_dir)
            return path
        log.warning("checkpoint %s is incomplete or corrupt; trying an older one", path)
    return None


def write_latest_pointer(ckpt_dir: str, path: str) -> None:
    tmp = os.path.join(ckpt_dir, f".{LATEST_POINTER}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(os.path.basename(path))
    os.replace(tmp, os.path.join(ckpt_dir, LATEST_POINTER))


def resolve_resume(resume: str | None, run_dir: str) -> str | None:
    """``None`` | ``"last"`` | ``"auto"`` | a path -> the checkpoint to load (or None)."""
    if resume is None:
        return None
    if resume in ("last", "auto"):
        path = find_resumable(checkpoint_dir(run_dir))
        if path is None and resume == "last":
            log.warning("resume='last' but %s holds no complete checkpoint; starting from scratch",
                        checkpoint_dir(run_dir))
        return path
    if not os.path.exists(resume):
        raise FileNotFoundError(f"checkpoint to resume from does not exist: {resume}")
    return resume
