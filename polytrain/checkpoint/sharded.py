"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) directories any strategy can load.

Contract for strategies (``fsdp``, ``model_parallel``, ``pipeline`` and any later one)
-------------------------------------------------------------------------------------
``save_sharded(strategy, payload, path)`` and ``load_sharded(strategy, path) -> payload`` are
collectives: every rank calls them, in the same order, from ``save_checkpoint`` /
``load_checkpoint``. They need from ``strategy`` only:

- the model: ``strategy.state_dict_module()`` if the strategy defines it, else ``strategy.module``.
  It returns one ``nn.Module`` or a list of them ("parts", e.g. the stages a pipeline rank
  holds). Parameter and buffer names *relative to each part* must be the names the full,
  unwrapped model has on one device (``TrainModule.state_dict()`` keys): that is what makes a
  checkpoint portable. Parameters may be plain tensors or ``DTensor`` s of any mesh/placements
  (FSDP, HSDP, tensor parallel); a rank may hold a subset of the model (pipeline) as long as
  every key of the checkpoint is held by some rank. Parts must not share parameters.
- ``strategy.optimizers``: each optimizer's parameters must all belong to one part.
- ``strategy.is_global_zero`` and ``strategy.collective_device``; collectives use the world group.

Layout of a checkpoint directory ``path``::

    path/.metadata        DCP's index (written last by DCP; read through a restricted unpickler)
    path/__<r>_<i>.distcp each rank's shards
    path/meta.pt          everything else in the payload (loop, rng, schedulers, precision,
                          callbacks, config, version): plain types, ``torch.load(weights_only=True)``

DCP keys are ``model.<fqn>`` and the optimizer state flattened by parameter name,
``optimizer.state.<fqn>.<name>`` / ``optimizer.param_groups.<fqn>.<hyperparameter>``, so any number
of optimizers on any partition of the model can find their entries. A directory is written under a
hidden temporary name next to ``path`` and renamed into place only once complete, so a torn save is
never picked by ``resume: last`` (``polytrain.checkpoint.layout.is_complete`` checks both files).

Loading accepts such a directory or a replicated single ``.ckpt`` file (``replicated``); a
directory can also be read whole without any process group (``reading.read_sharded``: used by
``load_replicated`` and ``polytrain checkpoint consolidate``). Nothing in a checkpoint is unpickled
without restriction (``unpickler``).
"""

from __future__ import annotations

import glob
import os
import pickle
import shutil
import uuid
from typing import Any

from polytrain.checkpoint.reading import (
    META_FILE,
    check_complete,
    quiet_single_process,
    read_checkpoint,
    read_meta,
)
from polytrain.checkpoint.replicated import agree_on_error, atomic_save
from polytrain.checkpoint.state import (
    agree_on_load,
    load_full_state,
    part_state,
    set_part_state,
    state_dict_parts,
)
from polytrain.checkpoint.unpickler import safe_load_planner, safe_reader
from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import CheckpointError

TENSOR_KEYS = ("model", "optimizer", "optimizers")  # what DCP holds; everything else goes to meta.pt


def _temporary_dir(path: str) -> str:
    """Rank 0: a fresh hidden sibling of ``path`` (hidden names are never resume candidates)."""
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, f".{glob.escape(base)}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that crashed
    tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    return tmp


def _commit(tmp: str, path: str) -> None:
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


def _write_error(path: str, err: BaseException) -> str:
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return (f"cannot write sharded checkpoint {path}: {reason}. Point trainer.run_dir at a writable directory "
            f"with free space (every rank must see the same file system)")


def save_sharded(strategy: Any, payload: dict[str, Any], path: str) -> None:
    """Write ``payload`` as a DCP directory at ``path``, atomically. Every rank calls it."""
    dcp = lazy.dcp()

    path = os.path.abspath(path)
    payload = {k: v for k, v in payload.items() if k != "state_dict"}  # the hooks' view of the live model
    tmp, error = None, None
    if strategy.is_global_zero:
        try:
            tmp = _temporary_dir(path)
        except OSError as err:
            error = _write_error(path, err)
    tmp, error = C.broadcast_object((tmp, error))
    if error is not None:
        raise CheckpointError(f"checkpoint failed on rank 0: {error}")
    try:
        parts = [part_state(part, optimizers) for part, optimizers in state_dict_parts(strategy)]
        state = {"model": {k: v for m, _ in parts for k, v in m.items()},
                 "optimizer": {k: v for _, o in parts for k, v in o.items()}}
        try:
            with quiet_single_process():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not C.active())
            if strategy.is_global_zero:
                atomic_save({k: v for k, v in payload.items() if k not in TENSOR_KEYS}, os.path.join(tmp, META_FILE))
        except Exception as err:  # noqa: BLE001 - agreed on below, so every rank raises it
            error = _write_error(path, err)
        agree_on_error(strategy, error)  # also: every rank's shards are on disk before the rename
        if strategy.is_global_zero:
            try:
                _commit(tmp, path)
            except OSError as err:
                error = _write_error(path, err)
        agree_on_error(strategy, error)
    finally:
        if strategy.is_global_zero and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # only left behind when something failed


def load_sharded(strategy: Any, path: str) -> dict[str, Any]:
    """Restore model and optimizer state from a DCP directory or a replicated file; return the rest
    of the payload. Every rank calls it; a failure on any rank raises on all of them."""
    error, payload = None, {}
    try:
        if os.path.isdir(path):
            check_complete(path)
            payload = read_meta(path)
        else:
            payload = read_checkpoint(path)
    except CheckpointError as err:
        error = str(err)
    agree_on_error(strategy, error)
    if os.path.isdir(path):
        _load_dcp_into(strategy, path)
    else:
        load_full_state(strategy, payload, path)
    return {k: v for k, v in payload.items() if k not in TENSOR_KEYS}


def _load_dcp_into(strategy: Any, path: str) -> None:
    dcp = lazy.dcp()

    parts = [(part, optimizers, *part_state(part, optimizers)) for part, optimizers in state_dict_parts(strategy)]
    state = {"model": {k: v for p in parts for k, v in p[2].items()},
             "optimizer": {k: v for p in parts for k, v in p[3].items()}}
    if not state["optimizer"]:
        del state["optimizer"]  # evaluation: weights only
    try:
        # Tensors are filled in place (each rank reads only its shards); other values are replaced.
        with quiet_single_process():
            dcp.load(state, storage_reader=safe_reader(path), planner=safe_load_planner(empty=False), no_dist=not C.active())
    except Exception as err:  # noqa: BLE001 - DCP raises the same aggregated error on every rank
        raise CheckpointError(f"sharded checkpoint {path} cannot be loaded: {err}") from None
    error = None
    try:
        loaded_optim = state.get("optimizer", {})
        for part, optimizers, model, optim in parts:
            set_part_state(part, optimizers, {k: state["model"][k] for k in model},
                           {k: loaded_optim[k] for k in optim})
        saved = {k[len("model."):] for k in safe_reader(path).read_metadata().state_dict_metadata
                 if k.startswith("model.")}
    except (KeyError, RuntimeError, ValueError, OSError, pickle.UnpicklingError) as err:
        error, saved = f"{path} does not fit this model: {err!r}", set()
    agree_on_load(strategy, error, saved, set(state["model"]), path)
