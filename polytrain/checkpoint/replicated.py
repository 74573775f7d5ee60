"""Checkpoint files: global rank 0 writes one file atomically, every rank reads it whole. Also the two
pieces every checkpoint write shares: ``atomic_save`` and ``agree_on_error``.

A write failure on rank 0 (full disk, read-only directory) is agreed on by all ranks, so each
one raises the same clear error instead of some waiting at a barrier forever.

File format: ``model`` is a plain ``state_dict`` (``torch.load(path)["model"]`` loads into a plain
``nn.Module``); ``optimizer`` is every optimizer's state flattened and keyed by parameter name
(``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``), the form sharded checkpoints use
too, so a sharded strategy can load this file and a replicated one can load a sharded directory
(``polytrain.checkpoint.sharded``). Files from before that change hold ``optimizers``, a list
of index-keyed ``Optimizer.state_dict()`` s, and still load.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch

from polytrain.checkpoint.reading import read_checkpoint
from polytrain.checkpoint.state import Loaded
from polytrain.core import collectives as C
from polytrain.core.errors import CheckpointError


def atomic_save(obj: Any, path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".ckpt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def agree_on_error(error: str | None, device: torch.device | None = None) -> None:
    """Every rank raises if any rank failed; the first failing rank's message is shown by all. ``device``:
    where the agreement's tensor lives (default: what the default group's backend takes)."""
    failed = C.any_rank(error is not None, device if device is not None else C.default_device())
    if failed:
        messages = C.all_gather_object(error)
        first = next((i, m) for i, m in enumerate(messages) if m is not None)
        raise CheckpointError(f"checkpoint failed on rank {first[0]}: {first[1]}")


def save_file(state: dict[str, Any], path: str) -> None:
    """Global rank 0 writes ``state`` (whole on that rank) to ``path`` atomically; every rank calls."""
    error = None
    if C.rank() == 0:
        try:
            atomic_save(state, path)
        except OSError as err:
            error = (f"cannot write {path}: {err.strerror or err}. Point trainer.run_dir at a writable "
                     f"directory with free space")
    agree_on_error(error)


def load_file(path: str) -> Loaded:
    """Every rank reads the whole checkpoint (a file, or a sharded directory read whole)."""
    error, state = None, {}
    try:
        state = read_checkpoint(path)
    except CheckpointError as err:
        error = str(err)
    agree_on_error(error)  # a file one node cannot see must not leave the others waiting
    return Loaded.from_full(state)
