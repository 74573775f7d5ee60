"""Checkpoint files for replicated strategies: rank 0 writes one file atomically, every rank reads.
Also the two pieces every checkpoint write shares: ``atomic_save`` and ``agree_on_error``.

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
from polytrain.checkpoint.state import full_optimizer_state, load_full_state
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


def agree_on_error(strategy: Any, error: str | None) -> None:
    """Every rank raises if any rank failed; the first failing rank's message is shown by all."""
    failed = C.any_rank(error is not None, strategy.collective_device)
    if failed:
        messages = C.all_gather_object(error)
        first = next((i, m) for i, m in enumerate(messages) if m is not None)
        raise CheckpointError(f"checkpoint failed on rank {first[0]}: {first[1]}")


def save_replicated(strategy: Any, payload: dict[str, Any], path: str) -> None:
    payload = dict(payload)
    # A payload built from the live module may carry its state_dict already (what hooks saw).
    model = payload.pop("state_dict", None)
    payload["model"] = model if model is not None and strategy.state_dict_is_module_state else strategy.module_state_dict()
    payload["optimizer"] = full_optimizer_state(strategy)
    error = None
    if strategy.is_global_zero:
        try:
            atomic_save(payload, path)
        except OSError as err:
            error = (f"cannot write {path}: {err.strerror or err}. Point trainer.run_dir at a writable "
                     f"directory with free space")
    agree_on_error(strategy, error)


def load_replicated(strategy: Any, path: str) -> dict[str, Any]:
    """Every rank reads the whole checkpoint (a file or a sharded directory) and loads it."""
    error, payload = None, {}
    try:
        payload = read_checkpoint(path)
    except CheckpointError as err:
        error = str(err)
    agree_on_error(strategy, error)  # a file one node cannot see must not leave the others waiting
    load_full_state(strategy, payload, path)
    return payload
