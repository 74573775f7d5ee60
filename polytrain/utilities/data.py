"""``polytrain.utilities.data``: where Lightning keeps its questions about a DataLoader (does it have a
length, on every rank; is it fed by an ``IterableDataset``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import IterableDataset

from polytrain.core.rank_zero import rank_zero_warn
from polytrain.data.loaders import iterable_with_len_warning, loader_length

__all__ = ["has_iterable_dataset", "has_len", "has_len_all_ranks"]


def has_iterable_dataset(dataloader: Any) -> bool:
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def has_len(dataloader: Any) -> bool:
    """Whether ``len(dataloader)`` answers (a ``__len__`` that raises NotImplementedError does not)."""
    return loader_length(dataloader) is not None


def has_len_all_ranks(dataloader: Any, strategy: Any,
                      allow_zero_length_dataloader_with_multiple_devices: bool = False) -> bool:
    """Whether ``dataloader`` has a length here. The lengths of all ranks are summed through ``strategy``
    (every rank must call it; ``strategy`` None, as before a fit has built one: this process alone). A
    loader empty on every rank is warned about; one empty on this rank only raises, since this rank would
    take no steps while the others wait for it, unless ``allow_zero_length_dataloader_with_multiple_devices``
    lets it pass with a warning."""
    length = loader_length(dataloader)
    if length is None:
        return False
    total = length
    if strategy is not None:
        total = int(strategy.reduce(torch.tensor(length, device=strategy.root_device), "sum"))
    name = type(dataloader).__name__
    if total == 0:
        rank_zero_warn(f"`{name}` has length 0 on every rank: the stage it feeds runs no steps. Give its "
                       f"dataset samples if that is not what you meant")
    elif length == 0:
        message = (f"`{name}` has length 0 on this rank but {total} batches across all ranks: this rank "
                   f"would take no steps while the others wait for it. Give every rank at least one batch")
        if not allow_zero_length_dataloader_with_multiple_devices:
            raise RuntimeError(message)
        rank_zero_warn(message)
    if has_iterable_dataset(dataloader):
        rank_zero_warn(iterable_with_len_warning())
    return True

