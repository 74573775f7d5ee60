"""Training data that keeps its own position: a DataLoader or dataset with ``state_dict()`` and
``load_state_dict()`` (torchdata's ``StatefulDataLoader`` protocol, which Lightning and torchtitan save).

Checkpoints hold one entry per rank (each data-parallel rank's stream is at its own position); a resume
loads this data-parallel rank's entry into the source *instead of* replaying the consumed batches, so a
resume costs the same at any position. Where the state lives:

- the DataLoader, when it has the methods (``StatefulDataLoader``: sampler position, workers, dataset);
- else its dataset, when the loader has no workers (with workers the main process's copy of the dataset
  never advances: its state would be stale, so the loop replays as for any loader, and says so once).
  An ``IterableDataset`` owns its position; a map-style dataset's state is restored but the position is
  still the sampler's (skipped without loading, or replayed through workers).

A state saved at one data-parallel size is not loaded at another: each rank's stream position only means
something for the split it was taken under. Such a resume is refused (``SamplerError``).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import IterableDataset

from polytrain.core.errors import SamplerError


def has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


_WARNED_WORKERS: set[str] = set()


def state_source(loader: Any) -> tuple[Any, bool] | None:
    """``(object holding the data state, whether it owns the epoch's position)``, or None."""
    if loader is None:
        return None
    if has_state(loader):
        return loader, True
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not has_state(dataset):
        return None
    if getattr(loader, "num_workers", 0):
        name = type(dataset).__qualname__
        if name not in _WARNED_WORKERS:
            _WARNED_WORKERS.add(name)
            warnings.warn(
                f"{type(dataset).__name__} has state_dict()/load_state_dict(), "
                f"but the training DataLoader runs "
                f"{loader.num_workers} workers, each advancing its own copy of the dataset: "
                f"polytrain cannot read "
                f"their state, so a mid-epoch resume replays the consumed batches instead. Use torchdata's "
                f"StatefulDataLoader (it collects the workers' dataset states), or num_workers=0",
                UserWarning, stacklevel=2)
        return None
    return dataset, isinstance(dataset, IterableDataset)


def rank_entry(loader: Any, dp_rank: int, dp_size: int, state: Any = None) -> dict[str, Any] | None:
    """This rank's checkpoint entry (None: the loader keeps no state). ``state``: a snapshot the loop
    took after the last consumed batch (a source it fetched ahead of is past it); else read now."""
    found = state_source(loader)
    if found is None:
        return None
    return {"dp_rank": dp_rank, "dp_size": dp_size,
            "state": found[0].state_dict() if state is None else state}


def select_rank_state(entries: list[Any] | None, dp_rank: int) -> dict[str, Any] | None:
    """From a checkpoint's per-rank entries: the data-parallel size they were saved at and this
    data-parallel rank's state (tensor- and pipeline-parallel peers hold the same one)."""
    saved = [e for e in entries or [] if e is not None]
    if not saved:
        return None
    mine = next((e["state"] for e in saved if e["dp_rank"] == dp_rank), None)
    return {"dp_size": int(saved[0]["dp_size"]), "state": mine}


def restore_state(loader: Any, saved: dict[str, Any] | None, dp_size: int) -> bool:
    """Load the saved state into the loader's source; True when the source now continues the epoch
    by itself (no batch may be skipped or replayed)."""
    found = state_source(loader)
    if found is None or saved is None:
        return False
    source, owns_position = found
    if saved["dp_size"] != dp_size or saved["state"] is None:
        raise SamplerError(
            f"the checkpoint holds the state of {type(source).__name__} for {saved['dp_size']} data-parallel "
            f"rank(s) and this run has {dp_size}: "
            f"each rank's position belongs to the split it was taken under, "
            f"so it cannot be loaded here. Resume with {saved['dp_size']} data-parallel ranks (devices x "
            f"num_nodes / tp / pp), or start a new fit from the checkpoint's weights"
        )
    source.load_state_dict(saved["state"])
    return owns_position
