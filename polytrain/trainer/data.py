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

    def skip(self, num_samples: int) -> None:
        self._skip = num_samples

    def __iter__(self) -> Iterator[int]:
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


def loader_length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
