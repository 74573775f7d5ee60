"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) directories any strategy can load.

``save_sharded(state, path)`` and ``load_sharded(path, into)`` are collectives: every rank calls them,
in the same order. ``state`` holds ``model`` and ``optimizer``: this rank's slices of the model and its
optimizers' state (``checkpoint.state.live_state``), keyed by the names the full, unwrapped model has on
one device (``TrainModule.state_dict()`` keys), which is what makes a checkpoint portable. Values may be
plain tensors or ``DTensor`` s of any mesh/placements (FSDP, HSDP, tensor parallel); a rank may hold a
subset of the model (pipeline) as long as every key of the checkpoint is held by some rank. Everything
else in ``state`` is the payload.

Layout of a checkpoint directory ``path``::

    path/.metadata        DCP's index (written last by DCP; read through a restricted unpickler)
    path/__<r>_<i>.distcp each rank's shards
    path/meta.pt          the payload (loop, rng, schedulers, precision, callbacks, config, version):
                          plain types, ``torch.load(weights_only=True)``
    path/manifest.json    every other file's size and CRC-32, written last (``integrity``)

DCP keys are ``model.<fqn>`` and the optimizer state flattened by parameter name,
``optimizer.state.<fqn>.<name>`` / ``optimizer.param_groups.<fqn>.<hyperparameter>``, so any number
of optimizers on any partition of the model can find their entries. A directory is written under a
hidden temporary name next to ``path`` by global rank 0's choice and renamed into place only once
complete and checksummed, so a torn save is never picked by ``resume: last``, and a shard damaged later
is found by its checksum (``polytrain.checkpoint.layout.is_complete``). A write that fails on any rank
raises the same one-line ``CheckpointError`` on every rank, naming that rank and the cause
(``failures``), and leaves nothing under ``path``.

Loading reads such a directory into ``into`` (the live state, filled in place: each rank reads only its
shards), or reads a single ``.ckpt`` file whole (``replicated``); a directory can also be read whole
without any process group (``reading.read_sharded``: used by ``polytrain checkpoint consolidate``).
Nothing in a checkpoint is unpickled without restriction (``unpickler``).
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from typing import Any

from polytrain.checkpoint.failures import (
    SHARDED,
    Failure,
    agree_on_error,
    checkpoint_error,
    describe_write_failure,
    first_failure,
    own_error,
    payload_bytes,
)
from polytrain.checkpoint.integrity import checksums, files_written_by, verify_directory, write_manifest
from polytrain.checkpoint.reading import (
    META_FILE,
    check_complete,
    dcp_reason,
    quiet_single_process,
    read_checkpoint,
    read_meta,
)
from polytrain.checkpoint.replicated import atomic_save
from polytrain.checkpoint.state import TENSOR_KEYS, Loaded
from polytrain.checkpoint.unpickler import safe_load_planner, safe_reader
from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import CheckpointError


def _temporary_dir(path: str) -> str:
    """Rank 0: a fresh hidden sibling of ``path`` (hidden names are never resume candidates)."""
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, f".{glob.escape(base)}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that crashed
    tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    return tmp


def commit_dir(tmp: str, path: str) -> None:
    """Rank 0: move the finished directory into place; an older one under the name goes last."""
    old = None
    if os.path.lexists(path):
        parent, base = os.path.split(path)
        old = os.path.join(parent, f".{base}.old-{uuid.uuid4().hex[:12]}")
        os.rename(path, old)
    os.rename(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)


def temporary_dir_for(path: str) -> str:
    """Global rank 0 makes the hidden directory ``path`` is written under; every rank gets its name
    (and raises if rank 0 could not make it). Every rank calls it."""
    tmp, error = None, None
    if C.rank() == 0:
        try:
            tmp = _temporary_dir(path)
        except OSError as err:
            error = describe_write_failure(err, path, SHARDED)
    tmp, error = C.broadcast_object((tmp, error))
    if error is not None:
        raise checkpoint_error(Failure(0, error))
    return tmp


def dcp_failure(err: BaseException, path: str, tensors: dict[str, Any]) -> str | None:
    """This rank's own part of a failed DCP save, in one line (None: only other ranks failed)."""
    own = own_error(err, C.rank())
    return None if own is None else describe_write_failure(own, path, SHARDED, payload_bytes(tensors))


def complete_directory(tmp: str, path: str, payload: dict[str, Any] | None, own: str | None,
                       background_group: Any = None) -> Failure | None:
    """Every rank, once DCP's save has returned on it: global rank 0 writes the payload (``payload``: on
    rank 0 only), every rank checksums the files it wrote, and, only if no rank failed, rank 0 writes the
    manifest last and moves the directory into place. ``own``: this rank's failure so far;
    ``background_group``: the writer thread's group (None: the training thread, on the default group).
    Returns the first failing rank's failure (the same on every rank), or, on rank 0, its own failure to
    commit."""
    sums: dict[str, dict[str, int]] = {}
    if own is None:
        try:
            if payload is not None:
                atomic_save(payload, os.path.join(tmp, META_FILE))
            sums = checksums(tmp, files_written_by(tmp, C.rank(), C.world_size(background_group)))
        except Exception as err:  # noqa: BLE001 - gathered below, so every rank knows
            own = describe_write_failure(err, path, SHARDED, payload_bytes(payload))
    # Also: once it returns every rank's shards are on disk.
    reports = C.all_gather_object((own, sums), background_group, background=background_group is not None)
    failure = first_failure([report[0] for report in reports])
    if failure is None and C.rank() == 0:
        try:
            write_manifest(tmp, {name: entry for _, part in reports for name, entry in part.items()})
            commit_dir(tmp, path)
        except Exception as err:  # noqa: BLE001 - agreed on by the caller
            failure = Failure(0, describe_write_failure(err, path, SHARDED))
    return failure


def save_sharded(state: dict[str, Any], path: str) -> None:
    """Write ``state`` as a DCP directory at ``path``, atomically. Every rank calls it."""
    dcp = lazy.dcp()

    path = os.path.abspath(path)
    tmp, own = temporary_dir_for(path), None
    try:
        tensors = {k: state.get(k, {}) for k in ("model", "optimizer")}
        try:
            with quiet_single_process():
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not C.active())
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - gathered: every rank raises it
            own = dcp_failure(err, path, tensors)
        payload = {k: v for k, v in state.items() if k not in TENSOR_KEYS} if C.rank() == 0 else None
        agree_on_error(complete_directory(tmp, path, payload, own))
    finally:
        if C.rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # only left behind when something failed


def load_sharded(path: str, into: dict[str, Any] | None) -> Loaded:
    """A DCP directory read into ``into`` (the live state: each rank reads its shards), or a file read
    whole. Every rank calls it; a failure on any rank raises on all of them. A directory's files are
    checked against its manifest first, each rank reading its share of them."""
    error, state = None, {}
    try:
        if os.path.isdir(path):
            check_complete(path)
            verify_directory(path, part=(C.rank(), C.world_size()))
            state = read_meta(path)
        else:
            state = read_checkpoint(path)
    except CheckpointError as err:
        error = str(err)
    agree_on_error(error)
    if not os.path.isdir(path):
        return Loaded.from_full(state)
    if into is None:
        raise CheckpointError(f"{path} is a sharded checkpoint: "
                              "reading it in place needs the live state to read into")
    return _read_dcp_into(path, into, {k: v for k, v in state.items() if k not in TENSOR_KEYS})


def _read_dcp_into(path: str, into: dict[str, Any], payload: dict[str, Any]) -> Loaded:
    dcp = lazy.dcp()
    try:
        # Tensors are filled in place (each rank reads only its shards); other values are replaced.
        with quiet_single_process():
            dcp.load(into, storage_reader=safe_reader(path), planner=safe_load_planner(empty=False),
                     no_dist=not C.active())
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - the same error on every rank
        raise CheckpointError(f"sharded checkpoint {path} cannot be loaded: {dcp_reason(err)}") from None
    saved = {k[len("model."):] for k in safe_reader(path).read_metadata().state_dict_metadata
             if k.startswith("model.")}
    return Loaded(payload, into["model"], into.get("optimizer"), None, saved, in_place=True)
