"""DataLoaders: sampler injection over the data-parallel group, epochs, and where a resumed epoch starts."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from polytrain.core.errors import SamplerError
from polytrain.core.rng import np
from polytrain.data.samplers import EvenlySplitSampler, ResumableDistributedSampler


def seed_worker(worker_id: int) -> None:
    """DataLoader workers: torch seeds itself per worker; give ``random``/numpy matching seeds."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)


def _chain_worker_init(user_fn: Callable | None) -> Callable:
    if user_fn is None:
        return seed_worker

    def init(worker_id: int) -> None:
        seed_worker(worker_id)
        user_fn(worker_id)

    return init


PIN_CHOSEN = "_polytrain_pin_memory_chosen"  # set on DataLoaders built with an explicit pin_memory


@contextlib.contextmanager
def record_pin_memory_choice() -> Iterator[None]:
    """DataLoaders built inside remember whether ``pin_memory`` was passed explicitly (Lightning
    records constructor arguments the same way), so a rebuilt loader pins by default on CUDA but keeps
    a user's explicit ``pin_memory=False``."""
    original = DataLoader.__init__

    def init(self: DataLoader, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # pin_memory is the 8th parameter: dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
        # collate_fn, pin_memory, ...
        if "pin_memory" in kwargs or len(args) > 7:
            self.__dict__[PIN_CHOSEN] = True

    DataLoader.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DataLoader.__init__ = original  # type: ignore[method-assign]


def _is_default_sampling(loader: DataLoader) -> bool:
    return (type(loader.sampler) in (SequentialSampler, RandomSampler)
            and type(loader.batch_sampler) in (BatchSampler, type(None)))


def _rebuild(loader: DataLoader, sampler: Sampler, pin_memory: bool = False) -> DataLoader:
    """``loader`` with ``sampler``; ``pin_memory=True`` (the strategy computes on CUDA) pins unless the
    user chose ``pin_memory`` explicitly when building it."""
    batch_size = loader.batch_size
    drop_last = loader.drop_last
    if batch_size is None and loader.batch_sampler is not None:
        batch_size, drop_last = loader.batch_sampler.batch_size, loader.batch_sampler.drop_last
    kwargs: dict[str, Any] = dict(
        batch_size=batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory or (pin_memory and not loader.__dict__.get(PIN_CHOSEN, False)),
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
                          use_sampler: bool = True, pin_memory: bool = False) -> Any:
    """Give ``loader`` a sampler over the data-parallel group, keeping everything else the user set
    (``pin_memory``: pin the rebuilt loader's batches unless the user chose; see ``_rebuild``)."""
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
        return _rebuild(loader, sampler, pin_memory)
    if num_replicas == 1:
        return loader
    return _rebuild(loader, EvenlySplitSampler(len(loader.dataset), num_replicas, rank), pin_memory)


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
