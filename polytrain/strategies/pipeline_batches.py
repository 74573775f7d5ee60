"""A batch as the pipeline cuts it: its size (dimension 0 of its first tensor), rows of it for one
micro-batch, its shape signature (one schedule per shape), and the ``(inputs, targets)`` pair the
``pipeline`` preset's ``pipeline_loss`` step takes."""

from __future__ import annotations

from typing import Any

import torch


def leading_size(batch: Any) -> int:
    """The batch size: dimension 0 of the first tensor in the batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = leading_size(value)
        if size >= 0:
            return size
    return -1


def batch_rows(batch: Any, start: int, stop: int, size: int) -> Any:
    """Rows ``start:stop`` of every tensor in ``batch`` whose dimension 0 is the batch size."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.ndim and batch.shape[0] == size else batch
    if isinstance(batch, (list, tuple)):
        picked = [batch_rows(x, start, stop, size) for x in batch]
        return type(batch)(*picked) if hasattr(batch, "_fields") else type(batch)(picked)
    if isinstance(batch, dict):
        return {k: batch_rows(v, start, stop, size) for k, v in batch.items()}
    return batch


def signature(batch: Any) -> tuple:
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), batch.dtype)
    if isinstance(batch, dict):
        return tuple((k, signature(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return tuple(signature(x) for x in batch)
    return ()


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        kind = (f"{type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple))
                else type(batch).__name__)
        raise TypeError(f"the pipeline strategy needs batches of (inputs, targets); got a {kind}. Return "
                        f"pairs from the dataset/collate_fn")
    return batch[0], batch[1]
