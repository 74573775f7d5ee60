"""Where checkpoints live and which one a run resumes from.

``<run_dir>/checkpoints/`` holds ``.ckpt`` files (replicated strategies) and DCP directories
(sharded ones); a ``latest`` file names the newest one written. ``resume: last`` takes the newest
*complete* checkpoint: a file that loads, or a directory whose metadata was committed last. A
torn newer one is skipped with a warning, never loaded.
"""

from __future__ import annotations

import logging
import os

import torch

from polytrain.checkpoint.reading import META_FILE
from polytrain.checkpoint.unpickler import METADATA_FILE

log = logging.getLogger("polytrain")

LATEST_POINTER = "latest"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def is_complete(path: str) -> bool:
    """A file that loads, or a sharded directory whose metadata was committed last."""
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, METADATA_FILE)) and os.path.exists(os.path.join(path, META_FILE))
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
