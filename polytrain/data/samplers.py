"""Samplers that split a dataset over the data-parallel ranks.

``ResumableDistributedSampler`` (training) orders samples exactly as ``DistributedSampler`` does and
can start part-way into an epoch, also re-split over a different number of ranks.
``EvenlySplitSampler`` (evaluation) splits without padding so metrics equal one process's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start its next pass part-way through the epoch.

    Its order is exactly that of ``DistributedSampler(ds, num_replicas, rank, shuffle, seed)``;
    ``skip(n)`` drops the first ``n`` indices of the next ``__iter__`` only, which is how a
    resumed run continues from the batch where the checkpoint was taken.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0
        self._offset: int | None = None

    def skip(self, num_samples: int) -> None:
        self._skip = num_samples

    def resume_from(self, offset: int) -> None:
        """Next pass only: continue the epoch from global position ``offset``, re-split over this
        sampler's ranks. The epoch's permutation depends on seed and epoch, not on the number of
        ranks, and ranks consume it interleaved, so after ``b`` batches of size ``B`` on ``n`` ranks
        exactly its first ``b * B * n`` positions are used: whatever ``n`` was, the rest of the
        permutation (padded as ``DistributedSampler`` pads) is what is left."""
        self._offset = offset

    def _rest(self, offset: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            perm = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            perm = list(range(len(self.dataset)))
        rest = perm[offset:]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.num_replicas]
        pad = (-len(rest)) % self.num_replicas
        if pad and rest:
            rest += (perm * -(-pad // len(perm)))[:pad]  # as DistributedSampler pads: from the epoch's start
        return rest

    def samples_left(self, offset: int) -> int:
        """Samples this rank gets in a pass resumed at global position ``offset``."""
        return len(self._rest(offset)) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        offset, self._offset = self._offset, None
        if offset is not None:
            self._skip = 0
            return iter(self._rest(offset)[self.rank::self.num_replicas])
        indices = super().__iter__()
        skip, self._skip = self._skip, 0
        if skip:
            indices = iter(list(indices)[skip:])
        return indices


class EvenlySplitSampler(Sampler[int]):
    """Evaluation split with no padding: rank r sees samples r, r+N, r+2N, ...

    ``DistributedSampler`` pads with repeated samples so every rank has the same count; those
    duplicates would be counted twice in a validation metric. Here ranks may hold one sample
    fewer, and metrics are reduced as (sum, count) pairs so the result equals one process's.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int) -> None:
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_len, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_len, self.num_replicas))
