"""Evaluation loaders that give every data-parallel rank the same number of batches.

Needed where every evaluation forward runs collectives over the data-parallel group (FSDP gathers
parameters; 2-D tensor parallel too): a rank that ran out of batches early would leave the others
waiting in the forward's all-gather.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from polytrain.core import collectives as C
from polytrain.data.samplers import EvenlySplitSampler


class PaddingState:
    """Set while the evaluation loader hands out a padding batch (see ``EvalBatches``)."""

    active = False


_END = object()


class EvalBatches:
    """An evaluation loader on which every rank yields the same number of batches.

    Ranks' shares differ by up to one batch (no padded samples: metrics must equal one process's),
    but under FSDP every forward all-gathers, so a rank that stopped early would leave the others
    waiting. Before each batch the ranks agree whether any still has data; one that ran out
    re-runs its last batch flagged as padding (``state.active``): the strategy's ``eval_step`` runs it
    with its logs muted and returns ``PADDING_BATCH``, which the loops drop.
    """

    def __init__(self, loader: Any, state: PaddingState, device: torch.device) -> None:
        self.loader = loader
        self.state = state
        self.device = device

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        sampler, size = getattr(self.loader, "sampler", None), getattr(self.loader, "batch_size", None)
        if isinstance(sampler, EvenlySplitSampler) and size:
            most = len(range(0, sampler.dataset_len, sampler.num_replicas))  # rank 0's share is the largest
            return most // size if self.loader.drop_last else -(-most // size)
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        iterator, last = iter(self.loader), _END
        try:
            while True:
                batch = next(iterator, _END)
                if not C.any_rank(batch is not _END, self.device):
                    return
                if batch is not _END:
                    last = batch
                elif last is _END:
                    last = self._borrowed_batch()
                self.state.active = batch is _END
                yield last
        finally:
            self.state.active = False

    def _borrowed_batch(self) -> Any:
        """A rank with no share at all (fewer samples than ranks) pads with the dataset's first batch."""
        dataset = getattr(self.loader, "dataset", None)
        if dataset is None or not len(dataset):
            raise RuntimeError("this rank has no evaluation batches and its loader has no dataset to borrow "
                               "a padding batch from; give every rank at least one batch")
        return next(iter(DataLoader(dataset, batch_size=getattr(self.loader, "batch_size", None) or 1,
                                    collate_fn=getattr(self.loader, "collate_fn", None))))
