"""Batches: moving them to a device and reading their size, for any nesting of tensors in
lists, tuples, named tuples and dicts. Both run on every batch of every step: keep them lean."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch  # what .to() returns here, without its argument parsing (every batch, every step)
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        for x in batch:  # the common (inputs, targets) already there (CPU training): no call per element
            if type(x) is not torch.Tensor or x.device != device:
                break
        else:
            return batch
        moved = [move_to_device(x, device) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the first tensor found (1 for a scalar or a batch without tensors)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, Mapping) and batch:  # a dict, or a mapping class (Hugging Face's BatchEncoding)
        return batch_size_of(next(iter(batch.values())))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        tensors = tensors_in(batch)
        return batch_size_of(tensors[0]) if tensors else 1
    return 1


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it, its structure kept: lists, tuples, named
    tuples, mappings (a dict, or a mapping class such as Hugging Face's ``BatchEncoding``, copied and
    filled), dataclasses (their ``init`` fields); anything else as it is. For the planner, not the step."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        if isinstance(batch, MutableMapping):
            # a copy keeps its class (and a defaultdict's factory, a BatchEncoding's extras)
            mapped = copy.copy(batch)
            for key in list(mapped):
                mapped[key] = map_tensors(batch[key], fn)
            return mapped
        return {key: map_tensors(value, fn) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [map_tensors(x, fn) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: map_tensors(getattr(batch, f.name), fn)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch``, in the order ``map_tensors`` visits them."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        children: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        children = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = [getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init]
    else:
        return []
    return [t for child in children for t in tensors_in(child)]
