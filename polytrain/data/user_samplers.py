"""A user's own sampler or batch sampler, split over the data-parallel ranks.

``SplitSampler`` wraps what the user gave the DataLoader (a ``Sampler`` of indices, e.g.
``WeightedRandomSampler``, or a batch sampler yielding lists of indices, e.g. a bucketing one). Every
rank draws the user's whole epoch, identically, and keeps every N-th draw, interleaved as
``DistributedSampler`` does: rank r takes draws r, r+N, r+2N, ... So over an epoch the ranks together
consume exactly what the sampler yields in one process, each draw once. In training a sampler of
indices is split as Lightning splits it (``DistributedSampler(shuffle=True)`` over the draws): the
draws are put in an order seeded by ``seed + epoch`` first, so a ddp run takes Lightning's batches, and
the global batch k (the ranks' k-th batches together) is batch k of size B x N of one process reading
that order (``use_distributed_sampler: always``). A batch sampler's batches keep their order.

Every rank must draw the same sequence, but training steps run on per-rank RNG streams
(docs/reproducibility.md), so a sampler drawing from the global RNG would draw differently on each rank
(items duplicated, others missed). The user's sampler is therefore iterated with the global torch
(CPU), Python and numpy RNGs seeded from ``seed + epoch`` (the trainer's seed, 0 if unset:
``DistributedSampler``'s rule), and those streams are put back afterwards, so the draws leave no trace
in the training streams. A sampler with
its own ``generator`` draws from it as it would in one process; the generator was built before
training, where every rank sees the same stream, and every rank advances it identically.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from polytrain.core.rng import isolate_rng, np


class SplitSampler(Sampler):
    """Rank ``rank``'s share of ``sampler``'s draws (indices, or whole batches for a batch sampler).

    ``pad`` (training): every rank gets as many draws as the others, the tail padded with draws from the
    epoch's start as ``DistributedSampler`` pads; with ``drop_tail`` the tail is dropped instead. Without
    ``pad`` (evaluation) nothing is repeated: ranks may hold one draw fewer, and metrics are reduced as
    (sum, count) so none is counted twice.
    """

    def __init__(self, sampler: Any, num_replicas: int, rank: int, seed: int, pad: bool,
                 drop_tail: bool = False, shuffle: bool = False) -> None:
        self.sampler = sampler
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.pad = pad
        self.drop_tail = drop_tail
        self.epoch = 0
        self._skip = 0
        self.drawn_from: torch.Tensor | None = None  # the user's generator's state when this epoch was drawn

    def set_epoch(self, epoch: int) -> None:
        """Reseeds the draws and is forwarded to the user's sampler when it has ``set_epoch``."""
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def skip(self, num_draws: int) -> None:
        """Next pass only: leave out this rank's first ``num_draws`` draws (a resumed epoch)."""
        self._skip = num_draws

    @property
    def generator(self) -> torch.Generator | None:
        """The user's sampler's own generator, if any: its state goes on from epoch to epoch, so a
        checkpoint saves it (``drawn_from`` mid-epoch) and a resume restores it before drawing."""
        gen = getattr(self.sampler, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def draws(self) -> list[Any]:
        """The user's sampler's whole epoch, drawn the same way on every rank."""
        gen = self.generator
        self.drawn_from = gen.get_state() if gen is not None else None
        seed = self.seed + self.epoch
        with isolate_rng():
            # CPU only: a queued CUDA reseed would outlive the block
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            if np is not None:
                np.random.seed(seed % 2**32)
            return list(self.sampler)

    def share(self, draws: list[Any]) -> list[Any]:
        n = self.num_replicas
        if self.shuffle:
            # Training, as DistributedSampler over the draws (Lightning's wrapper does the same): the epoch's
            # draws in an order seeded by seed + epoch, so a Lightning run's batches are these batches.
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            draws = [draws[i] for i in torch.randperm(len(draws), generator=g).tolist()]
        if self.pad and self.drop_tail:
            draws = draws[: len(draws) - len(draws) % n]
        elif self.pad and draws and len(draws) % n:
            missing = n - len(draws) % n
            draws = draws + (draws * -(-missing // len(draws)))[:missing]
        return draws[self.rank::n]

    def __iter__(self) -> Iterator[Any]:
        mine = self.share(self.draws())
        skip, self._skip = self._skip, 0
        return iter(mine[skip:])

    def __len__(self) -> int:
        total, n = len(self.sampler), self.num_replicas  # a sampler without __len__: a loader without length
        if not self.pad:
            return len(range(self.rank, total, n))
        return total // n if self.drop_tail else -(-total // n)
