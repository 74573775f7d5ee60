"""Reading a whole checkpoint into one process as full CPU tensors, with no process group: a
replicated ``.ckpt`` file, a bare ``state_dict`` written by a plain loop, a Lightning checkpoint (its
weights and hyperparameters), or a sharded (DCP) directory. Used by replicated strategies (every rank
reads the whole file), by sharded ones loading a replicated file, and by ``polytrain checkpoint
consolidate``. Every checkpoint is verified against its checksums first (``integrity``).
"""

from __future__ import annotations

import contextvars
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from polytrain.checkpoint.integrity import verify_directory, verify_file
from polytrain.checkpoint.unpickler import METADATA_FILE, safe_load_planner, safe_reader
from polytrain.core import lazy
from polytrain.core.errors import CheckpointError

META_FILE = "meta.pt"

# Set for the duration of a Trainer method called with ``weights_only=False``: the user vouched for the
# checkpoints it reads (a Lightning file whose hyperparameters are pickled objects). A context variable
# rather than an argument because the read happens several layers down, in whichever checkpoint format the
# strategy uses, and none of those layers has any other reason to know about it.
_TRUST_PICKLED = contextvars.ContextVar("polytrain_trust_pickled_checkpoints", default=False)


@contextmanager
def trusting_pickled_objects(trusted: bool) -> Iterator[None]:
    """Inside: ``read_checkpoint`` unpickles whatever a file holds when ``trusted`` (Lightning's
    ``trainer.fit(..., weights_only=False)``); outside, and with ``trusted=False``, only tensors and plain
    values load."""
    token = _TRUST_PICKLED.set(trusted)
    try:
        yield
    finally:
        _TRUST_PICKLED.reset(token)



def strip_wrapper_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Accept weights saved from a DDP/DataParallel wrapper (``module.`` keys) by a plain loop."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def read_checkpoint(path: str, weights_only: bool | None = None) -> dict[str, Any]:
    """A whole checkpoint as full CPU tensors: a file, or a sharded (DCP) directory read without
    any process group. Never unpickles without restriction unless ``weights_only=False`` is asked for
    (here, or by the Trainer method running: ``trusting_pickled_objects``)."""
    if weights_only is None:
        weights_only = not _TRUST_PICKLED.get()
    if os.path.isdir(path):
        return read_sharded(path)
    verify_file(path)
    try:
        if weights_only:
            data = torch.load(path, map_location="cpu", weights_only=True)
        else:  # the caller's explicit choice (load_from_checkpoint(weights_only=False), a trusted Lightning
            # file holding pickled objects): it runs whatever code the file names
            data = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as err:  # an unpickling refusal or a torn file
        raise CheckpointError(f"checkpoint {path} cannot be loaded safely: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(data).__name__}, not a state dict")
    if "polytrain" not in data and "pytorch-lightning_version" in data and "state_dict" in data:
        # A Lightning checkpoint: its weights and hyperparameters (load_from_checkpoint), no loop state.
        # (Older Lightning files keep the hyperparameters under "hparams" or "module_arguments".)
        hparams = next((data[k] for k in ("hyper_parameters", "hparams", "module_arguments")
                        if data.get(k) is not None), {})
        data = {"model": data["state_dict"], "hyper_parameters": hparams,
                "datamodule_hyper_parameters": data.get("datamodule_hyper_parameters", {}),
                **{k: data[k] for k in ("hparams_name", "hparams_type") if k in data}}
    elif "polytrain" not in data:
        # A bare state_dict written by a plain PyTorch loop: weights only, no loop state.
        data = {"model": strip_wrapper_prefix(data)}
    return data


def check_complete(path: str) -> None:
    """Both files present, and ``.metadata`` passes the allow-list before DCP ever reads it. The
    manifest's checksums are checked separately (``integrity.verify_directory``): over every file when
    one process reads the directory, split over the ranks when each reads its shards."""
    missing = [n for n in (METADATA_FILE, META_FILE) if not os.path.exists(os.path.join(path, n))]
    if missing:
        raise CheckpointError(f"sharded checkpoint {path} is incomplete: {', '.join(missing)} missing "
                              f"(a save that crashed?). "
                              f"Pick an older checkpoint, or resume with 'last' to skip torn ones")
    try:
        safe_reader(path).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise CheckpointError(f"{os.path.join(path, METADATA_FILE)} cannot be loaded safely: {err}") from None


def read_meta(path: str) -> dict[str, Any]:
    try:
        meta = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=True)
    except Exception as err:  # an unpickling refusal or a torn file
        raise CheckpointError(f"{os.path.join(path, META_FILE)} cannot be loaded safely: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{os.path.join(path, META_FILE)} holds a {type(meta).__name__}, not a dict")
    return meta


def read_sharded(path: str) -> dict[str, Any]:
    """The whole checkpoint as full (unsharded) CPU tensors; needs no process group."""
    check_complete(path)
    verify_directory(path)
    state: dict[str, Any] = {}
    try:
        # Not dcp.load: it loads into a copy holding only the keys passed in, so an empty dict
        # (filled by the empty planner) comes back empty. The inner loader fills `state` itself.
        with quiet_single_process():
            lazy.dcp().state_dict_loader._load_state_dict(state, storage_reader=safe_reader(path),
                                                          planner=safe_load_planner(empty=True),
                                                          no_dist=True)
    except (Exception, lazy.dcp().CheckpointException) as err:  # noqa: BLE001 - refusals, torn shards
        reason = dcp_reason(err)
        raise CheckpointError(f"sharded checkpoint {path} cannot be loaded safely: {reason}") from None
    return {**read_meta(path), **state}


def dcp_reason(err: BaseException) -> str:
    """One line for a DCP failure: its first rank's error (DCP's own text is a traceback per rank)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = min(failures.items())
        text = str(inner).strip().splitlines()
        return f"{type(inner).__name__} on rank {rank}: {text[0] if text else '(no message)'}"
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


@contextmanager
def quiet_single_process() -> Iterator[None]:
    # DCP warns that it "assumes the intent is to load in a single process": that is our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable")
        yield
