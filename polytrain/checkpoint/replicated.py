"""Checkpoint files: global rank 0 writes one file atomically, every rank reads it whole (after checking
every record against its CRC-32: ``integrity.verify_file``). Also ``atomic_save``, the write every
checkpoint file shares.

A write failure on rank 0 (full disk, file-size limit, read-only directory) is agreed on by all ranks,
so each one raises the same one-line ``CheckpointError`` naming the cause (``failures``) instead of some
waiting at a barrier forever.

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
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from polytrain.checkpoint.failures import FILE, agree_on_error, describe_write_failure, payload_bytes
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.checkpoint.state import Loaded
from polytrain.core import collectives as C
from polytrain.core.errors import CheckpointError
from polytrain.core.files import replacing


def atomic_save(obj: Any, path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``. Every record
    carries its CRC-32 (torch's default, kept on here: loads verify them)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # A hidden .tmp-* name: never a resume candidate, whatever a crash leaves behind.
    temporary = os.path.join(directory, f".tmp-{uuid.uuid4().hex[:12]}.ckpt")
    with replacing(path, binary=True, durable=True, temporary=temporary) as fh, _checksummed():
        torch.save(obj, fh)


@contextlib.contextmanager
def _checksummed() -> Iterator[None]:
    """torch.save with CRC-32s even where the user switched them off (``set_crc32_options``)."""
    if torch.serialization.get_crc32_options():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


def with_weights_under_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its weights also under ``state_dict``, where Lightning code reading a checkpoint with
    ``torch.load`` looks for them. The same dict object under both keys: pickle writes it, and every tensor
    in it, once."""
    if "model" not in state or "state_dict" in state:
        return state
    return {**state, "state_dict": state["model"]}


def save_file(state: dict[str, Any], path: str) -> None:
    """Global rank 0 writes ``state`` (whole on that rank) to ``path`` atomically; every rank calls."""
    error = None
    if C.rank() == 0:
        try:
            atomic_save(with_weights_under_state_dict(state), path)
        except Exception as err:  # noqa: BLE001 - a full disk reaches here as a RuntimeError: agreed on below
            error = describe_write_failure(err, path, FILE, payload_bytes(state))
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
