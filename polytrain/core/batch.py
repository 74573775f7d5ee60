"""Batches: moving them to a device and reading their size, for any nesting of tensors in
lists, tuples, named tuples and dicts. Both run on every batch of every step: keep them lean."""

from __future__ import annotations

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
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1
