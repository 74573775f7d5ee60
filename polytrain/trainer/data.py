"""Data plumbing: sampler injection over the data-parallel group, resumable positions, devices."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)


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


def seed_worker(worker_id: int) -> None:
    """DataLoader workers: torch seeds itself per worker; give ``random``/numpy matching seeds."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def _chain_worker_init(user_fn: Callable | None) -> Callable:
    if user_fn is None:
        return seed_worker

    def init(worker_id: int) -> None:
        seed_worker(worker_id)
        user_fn(worker_id)

    return init


class SamplerError(ValueError):
    pass


def _is_default_sampling(loader: DataLoader) -> bool:
    return (type(loader.sampler) in (SequentialSampler, RandomSampler)
            and type(loader.batch_sampler) in (BatchSampler, type(None)))


def _rebuild(loader: DataLoader, sampler: Sampler) -> DataLoader:
    batch_size = loader.batch_size
    drop_last = loader.drop_last
    if batch_size is None and loader.batch_sampler is not None:
        batch_size, drop_last = loader.batch_sampler.batch_size, loader.batch_sampler.drop_last
    kwargs: dict[str, Any] = dict(
        batch_size=batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=drop_last,
        timeout=loader.timeout,
        worker_init_fn=_chain_worker_init(loader.worker_init_fn),
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


def distribute_dataloader(loader: Any, num_replicas: int, rank: int, seed: int, stage: str,
                          use_sampler: bool = True) -> Any:
    """Give ``loader`` a sampler over the data-parallel group, keeping everything else the user set."""
    if not use_sampler or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if not _is_default_sampling(loader):
        if num_replicas > 1:
            raise SamplerError(
                f"the {stage} DataLoader uses a custom sampler ({type(loader.sampler).__name__}/"
                f"{type(loader.batch_sampler).__name__}); polytrain cannot split it over {num_replicas} "
                f"data-parallel ranks. Shard it per rank yourself and set trainer.use_distributed_sampler=false"
            )
        return loader
    if stage == "train":
        sampler: Sampler = ResumableDistributedSampler(
            loader.dataset, num_replicas=num_replicas, rank=rank,
            shuffle=isinstance(loader.sampler, RandomSampler), seed=seed,
        )
        return _rebuild(loader, sampler)
    if num_replicas == 1:
        return loader
    return _rebuild(loader, EvenlySplitSampler(len(loader.dataset), num_replicas, rank))


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch  # what .to() returns here, without its argument parsing (every batch, every step)
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(x, device) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


def set_epoch(loader: Any, epoch: int) -> None:
    for obj in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None and hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return


def skip_batches(loader: Any, num_batches: int) -> int:
    """Arrange for the next pass to start ``num_batches`` in; returns how many the loop must skip itself."""
    sampler = getattr(loader, "sampler", None)
    if num_batches and isinstance(sampler, ResumableDistributedSampler) and loader.batch_size:
        sampler.skip(num_batches * loader.batch_size)
        return 0
    return num_batches


def resume_position(loader: Any, start: int, num_batches: int, dp_size: int, saved: dict[str, Any] | None
                    ) -> tuple[int, int, tuple[int, int]]:
    """Where this epoch's pass starts after a resume: ``(first batch index, batches the loop must
    skip itself, (global sample offset, batch index) it counts positions from)``.

    ``saved`` is the checkpoint's loop record (``sample_offset``: global sample positions consumed in
    the epoch; ``dp_size``). Same data-parallel size and position: the batch-skip path (unchanged
    order). Otherwise polytrain's sampler continues from the global offset, re-split over this run's
    ranks, and the loop starts at the batch index that leaves exactly the remaining batches. A
    loader whose position cannot be re-split raises instead of drifting silently.
    """
    if start == 0 or saved is None:
        return start, skip_batches(loader, start), (0, 0)
    sampler, batch_size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
    offset, old_dp = saved.get("sample_offset"), saved.get("dp_size")
    if offset is not None and batch_size and offset == start * batch_size * dp_size:
        return start, skip_batches(loader, start), (0, 0)  # the position this run's ranks would be at
    if offset is None or not batch_size:
        if old_dp in (None, dp_size):
            return start, skip_batches(loader, start), (0, 0)
    elif isinstance(sampler, ResumableDistributedSampler):
        sampler.resume_from(offset)
        left = sampler.samples_left(offset)
        batches = left // batch_size if loader.drop_last else -(-left // batch_size)
        first = max(0, num_batches - batches)
        return first, 0, (offset, first)
    raise SamplerError(
        f"the checkpoint was taken {start} batches into an epoch with {old_dp} data-parallel rank(s) and this run "
        f"has {dp_size}; the training DataLoader ({type(sampler).__name__}, batch_size={batch_size}) does not use "
        f"polytrain's sampler, so its position cannot be re-split over the new ranks. Resume with {old_dp} "
        f"data-parallel ranks, or from a checkpoint taken at an epoch boundary"
    )


def loader_length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
