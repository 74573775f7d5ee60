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
never picked by ``resume: last`` (``trainer.checkpoint.is_complete`` checks both files).

Loading accepts such a directory or a replicated single ``.ckpt`` file (``checkpoint_io``); a
directory can also be read whole without any process group (``read_sharded``: used by
``load_replicated`` and ``polytrain checkpoint consolidate``). Nothing in a checkpoint is unpickled
without restriction: DCP's ``.metadata`` goes through an allow-list of DCP's metadata classes, and
non-tensor entries through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import glob
import io
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from polytrain.strategies import collectives as C
from polytrain.strategies.checkpoint_io import CheckpointError, agree_on_error, atomic_save

META_FILE = "meta.pt"
METADATA_FILE = ".metadata"
_TENSOR_KEYS = ("model", "optimizer", "optimizers")


# --------------------------------------------------------------------------- safe reading


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's ``Metadata`` and nothing else: a crafted ``.metadata`` cannot run code."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's {METADATA_FILE}: "
                                     f"only DCP metadata classes are allowed")


def _safe_reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
            with open(os.path.join(path, name), "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{METADATA_FILE} holds a {type(metadata).__name__}, not DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


class _WeightsOnlyBytes:
    """Mixin for DCP load planners: non-tensor entries load with ``weights_only=True`` (DCP's own
    planner uses ``weights_only=False``). The checked object is handed on re-serialised."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, map_location="cpu", weights_only=True)
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)  # type: ignore[misc]


def _planner(empty: bool) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    base = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner
    return type("SafeLoadPlanner", (_WeightsOnlyBytes, base), {})()


def _check_complete(path: str) -> None:
    """Both files present, and ``.metadata`` passes the allow-list before DCP ever reads it."""
    missing = [n for n in (METADATA_FILE, META_FILE) if not os.path.exists(os.path.join(path, n))]
    if missing:
        raise CheckpointError(f"sharded checkpoint {path} is incomplete: {', '.join(missing)} missing (a save that "
                              f"crashed?). Pick an older checkpoint, or resume with 'last' to skip torn ones")
    try:
        _safe_reader(path).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise CheckpointError(f"{os.path.join(path, METADATA_FILE)} cannot be loaded safely: {err}") from None


def _read_meta(path: str) -> dict[str, Any]:
    try:
        meta = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=True)
    except Exception as err:  # an unpickling refusal or a torn file
        raise CheckpointError(f"{os.path.join(path, META_FILE)} cannot be loaded safely: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{os.path.join(path, META_FILE)} holds a {type(meta).__name__}, not a dict")
    return meta


def read_sharded(path: str) -> dict[str, Any]:
    """The whole checkpoint as full (unsharded) CPU tensors; needs no process group."""
    _check_complete(path)
    state: dict[str, Any] = {}
    try:
        # Not dcp.load: it loads into a copy holding only the keys passed in, so an empty dict
        # (filled by the empty planner) comes back empty. The inner loader fills `state` itself.
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        with _quiet_single_process():
            _load_state_dict(state, storage_reader=_safe_reader(path), planner=_planner(empty=True), no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP wraps refusals and torn shards alike
        raise CheckpointError(f"sharded checkpoint {path} cannot be loaded safely: {err}") from None
    return {**_read_meta(path), **state}


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it "assumes the intent is to load in a single process": that is our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable")
        yield


# --------------------------------------------------------------------------- live state


def state_dict_parts(strategy: Any) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
    """``(module, its optimizers)`` for each part of the model this rank holds (see the contract)."""
    hook = getattr(strategy, "state_dict_module", None)
    modules = hook() if callable(hook) else strategy.module
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    if len(modules) == 1:
        return [(modules[0], list(strategy.optimizers))]
    owner = {id(p): i for i, m in enumerate(modules) for p in m.parameters()}
    groups: list[list[torch.optim.Optimizer]] = [[] for _ in modules]
    for n, opt in enumerate(strategy.optimizers):
        parts = {owner.get(id(p)) for g in opt.param_groups for p in g["params"]}
        if len(parts) != 1 or None in parts:
            raise CheckpointError(f"optimizer {n} holds parameters of parts {sorted(map(str, parts))} of the "
                                  f"{len(modules)} returned by state_dict_module(); give each part its own optimizer")
        groups[parts.pop()].append(opt)
    return list(zip(modules, groups))


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded (each rank its own slices: no communication). Flattened optimizer state is keyed by
    # parameter name alone, so any partition of the model finds its entries.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _part_state(part: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = get_model_state_dict(part, options=_options())
    # torch creates missing optimizer state with a zero-lr step; a saved run must not keep it
    # (Adam's step count would be off by one), so such optimizers get their empty state back.
    fresh = [(opt, opt.state_dict()) for opt in optimizers if not opt.state]
    optim = get_optimizer_state_dict(part, optimizers, options=_options()) if optimizers else {}
    for opt, state in fresh:
        opt.load_state_dict(state)
    return model, optim


def _set_part_state(part: nn.Module, optimizers: list[torch.optim.Optimizer], model: dict, optim: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(part, model, options=_options())
    if optimizers:
        set_optimizer_state_dict(part, optimizers, optim, options=_options())


def full_optimizer_state(strategy: Any) -> dict[str, Any]:
    """Every optimizer's state as one flat, name-keyed dict of full tensors (replicated files).

    A collective when parameters are ``DTensor`` s (they are gathered); plain tensors are copied."""
    from torch.distributed.tensor import DTensor

    merged: dict[str, Any] = {}
    for part, optimizers in state_dict_parts(strategy):
        if optimizers:
            _, optim = _part_state(part, optimizers)
            merged.update({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in optim.items()})
    return merged


def _like(live: Any, saved: Any, key: str) -> Any:
    """``saved`` (a full value) shaped like ``live``: this rank's shard of it for a ``DTensor``."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(live, torch.Tensor):
        return saved
    if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(live.shape):
        got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise CheckpointError(f"checkpoint entry {key} has shape {got} but the model expects {tuple(live.shape)}; "
                              f"the checkpoint was written for a different model")
    if isinstance(live, DTensor):
        # Replicate -> the live placements is a local slice on every rank: no communication.
        full = saved.to(device=live.device, dtype=live.dtype)
        whole = DTensor.from_local(full, live.device_mesh, [Replicate()] * live.device_mesh.ndim, run_check=False)
        return whole.redistribute(live.device_mesh, live.placements)
    return saved.to(device=live.device, dtype=live.dtype)


def _fill(live: dict[str, Any], saved: dict[str, Any], what: str, path: str) -> dict[str, Any]:
    missing = [k for k in live if k not in saved]
    if missing:
        raise CheckpointError(f"{path} has no {what} entry for {len(missing)} of {len(live)} keys this model needs, "
                              f"e.g. {missing[:3]}; it was written for a different model or optimizer")
    return {k: _like(v, saved[k], f"{what} {k}") for k, v in live.items()}


def _legacy_optimizer(part: nn.Module, optimizers: list, states: list[dict]) -> dict[str, Any]:
    """Files from before name-keyed optimizer state: entries are numbered in configure_optimizers'
    parameter order, which the same module reproduces; rename them to the flat form."""
    names = {id(p): n for n, p in part.named_parameters()}
    flat: dict[str, Any] = {}
    for optimizer, state in zip(optimizers, states):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fqn = {i: names[id(p)] for i, p in enumerate(params)}
        for i, entries in state["state"].items():
            flat.update({f"state.{fqn[int(i)]}.{k}": v for k, v in entries.items()})
        for group in state["param_groups"]:
            for i in group["params"]:
                flat.update({f"param_groups.{fqn[int(i)]}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def _agree_on_load(strategy: Any, error: str | None, saved_keys: set[str], used: set[str], path: str) -> None:
    """One collective after all local work: any rank's error, or a model entry of the checkpoint
    that no rank holds (a pipeline rank holds only its part), raises the same error everywhere."""
    if C.active():
        gathered = C.all_gather_object((error, sorted(used)))
        error = next((f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e is not None), None)
        used = set().union(*(set(u) for _, u in gathered))
    if error is not None:
        raise CheckpointError(error)
    unused = sorted(saved_keys - used)
    if unused:
        raise CheckpointError(f"{path} holds {len(unused)} model entries no rank's model has, e.g. {unused[:3]}; "
                              f"it was written for a different model")


def _load_full_local(strategy: Any, payload: dict[str, Any], path: str) -> set[str]:
    from polytrain.strategies.checkpoint_io import strip_wrapper_prefix

    saved_model = strip_wrapper_prefix(payload["model"])
    used: set[str] = set()
    for part, optimizers in state_dict_parts(strategy):
        live_model, live_optim = _part_state(part, optimizers)
        used.update(live_model)
        model = _fill(live_model, saved_model, "model", path)
        optim: dict[str, Any] = {}
        if optimizers and ("optimizer" in payload or "optimizers" in payload):
            saved_optim = payload.get("optimizer")
            if saved_optim is None:
                saved_optim = _legacy_optimizer(part, optimizers, payload["optimizers"])
            optim = _fill(live_optim, saved_optim, "optimizer", path)
        elif optimizers:
            optimizers = []  # weights only (a bare state_dict): optimizers keep their fresh state
        _set_part_state(part, optimizers, model, optim)
    return used


def load_full_state(strategy: Any, payload: dict[str, Any], path: str) -> None:
    """Load full (unsharded) model/optimizer state, e.g. from a replicated file, into ``strategy``:
    each rank keeps its shard of every tensor. Every rank calls it; errors are agreed on."""
    from polytrain.strategies.checkpoint_io import strip_wrapper_prefix

    error, used = None, set()
    try:
        used = _load_full_local(strategy, payload, path)
    except (CheckpointError, KeyError, RuntimeError, ValueError) as err:
        error = str(err) if isinstance(err, CheckpointError) else f"{path} does not fit this model: {err!r}"
    _agree_on_load(strategy, error, set(strip_wrapper_prefix(payload.get("model", {}))), used, path)


# --------------------------------------------------------------------------- save / load


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
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(path)
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
        parts = [_part_state(part, optimizers) for part, optimizers in state_dict_parts(strategy)]
        state = {"model": {k: v for m, _ in parts for k, v in m.items()},
                 "optimizer": {k: v for _, o in parts for k, v in o.items()}}
        try:
            with _quiet_single_process():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not C.active())
            if strategy.is_global_zero:
                atomic_save({k: v for k, v in payload.items() if k not in _TENSOR_KEYS}, os.path.join(tmp, META_FILE))
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
    from polytrain.strategies.checkpoint_io import read_checkpoint

    error, payload = None, {}
    try:
        if os.path.isdir(path):
            _check_complete(path)
            payload = _read_meta(path)
        else:
            payload = read_checkpoint(path)
    except CheckpointError as err:
        error = str(err)
    agree_on_error(strategy, error)
    if os.path.isdir(path):
        _load_dcp_into(strategy, path)
    else:
        load_full_state(strategy, payload, path)
    return {k: v for k, v in payload.items() if k not in _TENSOR_KEYS}


def _load_dcp_into(strategy: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    parts = [(part, optimizers, *_part_state(part, optimizers)) for part, optimizers in state_dict_parts(strategy)]
    state = {"model": {k: v for p in parts for k, v in p[2].items()},
             "optimizer": {k: v for p in parts for k, v in p[3].items()}}
    if not state["optimizer"]:
        del state["optimizer"]  # evaluation: weights only
    try:
        # Tensors are filled in place (each rank reads only its shards); other values are replaced.
        with _quiet_single_process():
            dcp.load(state, storage_reader=_safe_reader(path), planner=_planner(empty=False), no_dist=not C.active())
    except Exception as err:  # noqa: BLE001 - DCP raises the same aggregated error on every rank
        raise CheckpointError(f"sharded checkpoint {path} cannot be loaded: {err}") from None
    error = None
    try:
        loaded_optim = state.get("optimizer", {})
        for part, optimizers, model, optim in parts:
            _set_part_state(part, optimizers, {k: state["model"][k] for k in model},
                            {k: loaded_optim[k] for k in optim})
        saved = {k[len("model."):] for k in _safe_reader(path).read_metadata().state_dict_metadata
                 if k.startswith("model.")}
    except (KeyError, RuntimeError, ValueError, OSError, pickle.UnpicklingError) as err:
        error, saved = f"{path} does not fit this model: {err!r}", set()
    _agree_on_load(strategy, error, saved, set(state["model"]), path)
