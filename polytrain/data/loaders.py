"""DataLoaders: sampler injection over the data-parallel group, epochs, and where a resumed epoch starts."""

from __future__ import annotations

import contextlib
import copy
import inspect
import random
import warnings
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

from polytrain.core.errors import SamplerError
from polytrain.core.rng import np
from polytrain.data.combined_loader import CombinedIterator, component_loaders
from polytrain.data.samplers import EvenlySplitSampler, ResumableDistributedSampler
from polytrain.data.stateful import has_state
from polytrain.data.user_samplers import SplitSampler


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

    # The one method polytrain swaps, and only while the user's *_dataloader() runs: a DataLoader keeps no
    # record of which arguments it was given, and this is where the choice can still be seen.
    DataLoader.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DataLoader.__init__ = original  # type: ignore[method-assign]


def _drawing_sampler(loader: DataLoader) -> Any:
    """The sampler that draws the indices: a BatchSampler the user passed holds it (``loader.sampler`` is
    then a placeholder ``SequentialSampler``)."""
    batch_sampler = loader.batch_sampler
    return loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", None)


# torchdata's StatefulDataLoader builds its own (stateful) twins of torch's default samplers.
_DEFAULT_SAMPLERS = {(c.__module__, c.__name__) for c in (SequentialSampler, RandomSampler, BatchSampler)} | {
    ("torchdata.stateful_dataloader.sampler", name)
    for name in ("SequentialSampler", "RandomSampler", "BatchSampler")}


def _is_default(obj: Any, name: str) -> bool:
    return (type(obj).__module__, type(obj).__name__) in _DEFAULT_SAMPLERS and type(obj).__name__ == name


def _is_default_sampling(loader: DataLoader) -> bool:
    sampler, batch_sampler = _drawing_sampler(loader), loader.batch_sampler
    return ((_is_default(sampler, "SequentialSampler") or _is_default(sampler, "RandomSampler"))
            and (batch_sampler is None or _is_default(batch_sampler, "BatchSampler")))


def _rebuild(loader: DataLoader, sampler: Sampler | None, pin_memory: bool = False,
             batch_sampler: Sampler | None = None) -> DataLoader:
    """``loader`` with ``sampler`` (or ``batch_sampler``); ``pin_memory=True`` (the strategy computes on
    CUDA) pins unless the user chose ``pin_memory`` explicitly when building it."""
    batch_size = loader.batch_size
    drop_last = loader.drop_last
    if batch_sampler is not None:
        batch_size, drop_last = 1, False  # DataLoader's defaults: batch_sampler excludes both
    elif batch_size is None and loader.batch_sampler is not None:
        batch_size, drop_last = loader.batch_sampler.batch_size, loader.batch_sampler.drop_last
    kwargs: dict[str, Any] = dict(
        batch_size=batch_size,
        sampler=sampler,
        batch_sampler=batch_sampler,
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
    # A stateful loader (torchdata's StatefulDataLoader, same constructor) stays one: it holds the data
    # position checkpoints save. Any other subclass becomes a plain DataLoader, as before.
    cls = type(loader) if has_state(loader) else DataLoader
    if cls is not DataLoader and hasattr(loader, "snapshot_every_n_steps"):
        kwargs["snapshot_every_n_steps"] = loader.snapshot_every_n_steps
    return cls(loader.dataset, **kwargs)


def _pinned(loader: DataLoader, pin_memory: bool) -> DataLoader:
    """The user's loader as it is, or (``pin_memory``, unless the user chose) a shallow copy that pins:
    the same dataset, sampler, workers and RNG draws, so the batches are the very same."""
    if not pin_memory or loader.pin_memory or loader.__dict__.get(PIN_CHOSEN, False):
        return loader
    twin = copy.copy(loader)
    twin.pin_memory = True
    return twin


_WARNED_ITERABLE: set[tuple[str, str]] = set()


def warn_unsplit_iterable(loader: Any, num_replicas: int, stage: str) -> None:
    """Once per dataset class and stage: an iterable is not split across data-parallel ranks."""
    dataset = getattr(loader, "dataset", None)
    if num_replicas <= 1 or not isinstance(dataset, IterableDataset):
        return
    key = (type(dataset).__qualname__, stage)
    if key in _WARNED_ITERABLE:
        return
    _WARNED_ITERABLE.add(key)
    warnings.warn(
        f"the {stage} DataLoader wraps an IterableDataset ({type(dataset).__name__}), "
        f"which polytrain has not "
        f"split over the {num_replicas} data-parallel ranks (it has no indices to sample): unless it shards "
        f"itself, every rank iterates the whole stream and each sample is used {num_replicas} times. "
        f"Shard it in "
        f"__iter__ by data-parallel rank: keep items i with i % dp_size == dp_rank, reading dp_rank/dp_size "
        f"from module.trainer.strategy (torch.distributed.get_rank()/get_world_size() under plain ddp), and "
        f"by torch.utils.data.get_worker_info() across DataLoader workers. Ranks whose streams end at "
        f"different batches end the epoch together, at the shortest one's end",
        UserWarning, stacklevel=2,
    )


def distribute_dataloader(loader: Any, num_replicas: int, rank: int, seed: int, stage: str,
                          use_sampler: bool | str = True, pin_memory: bool = False) -> Any:
    """Give ``loader`` a sampler over the data-parallel group, keeping everything else the user set
    (``pin_memory``: the result pins its batches unless the user chose; see ``_rebuild`` and ``_pinned``).

    On one data-parallel rank the loader is left as the user built it (a ``shuffle=True`` loader then
    draws its order from the global RNG, exactly as in the user's own loop), unless ``use_sampler`` is
    ``"always"``: then one rank reads the very order that N ranks would read together (to compare a
    strategy with one device, or to resume an N-rank run on one)."""
    warn_unsplit_iterable(loader, num_replicas, stage)
    if not isinstance(loader, DataLoader):
        return loader
    if not use_sampler or isinstance(loader.dataset, IterableDataset) or (num_replicas == 1
                                                                          and use_sampler != "always"):
        return _pinned(loader, pin_memory)
    if not _is_default_sampling(loader):
        return _split_user_sampling(loader, num_replicas, rank, seed, stage, pin_memory)
    if stage == "train":
        sampler: Sampler = ResumableDistributedSampler(
            loader.dataset, num_replicas=num_replicas, rank=rank,
            shuffle=_is_default(_drawing_sampler(loader), "RandomSampler"), seed=seed,
        )
        return _rebuild(loader, sampler, pin_memory)
    if num_replicas == 1:
        return loader
    return _rebuild(loader, EvenlySplitSampler(len(loader.dataset), num_replicas, rank), pin_memory)


def _split_user_sampling(loader: DataLoader, num_replicas: int, rank: int, seed: int, stage: str,
                         pin_memory: bool) -> DataLoader:
    """The user's own sampler (or batch sampler) split over the ranks by ``SplitSampler``: a sampler of
    indices (also inside torch's ``BatchSampler``) index by index, the loader's batch size kept; another
    batch sampler whole batch by whole batch (rank r takes batches r, r+N, ...). Training pads to equal
    counts from the epoch's start (a batch sampler with ``drop_last=True`` drops the tail batches instead);
    evaluation repeats nothing. A ``DistributedSampler`` the user built is already split: left alone."""
    batch_sampler = loader.batch_sampler
    by_index = batch_sampler is None or _is_default(batch_sampler, "BatchSampler")
    user = _drawing_sampler(loader) if by_index else batch_sampler
    if isinstance(user, DistributedSampler) or isinstance(getattr(user, "sampler", None), DistributedSampler):
        return _pinned(loader, pin_memory)
    train = stage == "train"
    if by_index:
        return _rebuild(loader, SplitSampler(user, num_replicas, rank, seed, pad=train, shuffle=train),
                        pin_memory)
    split = SplitSampler(user, num_replicas, rank, seed, pad=train,
                         drop_tail=train and getattr(user, "drop_last", False) is True)
    return _rebuild(loader, None, pin_memory, batch_sampler=split)


def set_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler, batch sampler and the batch sampler's sampler, each
    that has one (once each): polytrain's samplers and the user's own (Lightning's rule); on each loader
    of a ``CombinedLoader``."""
    seen: set[int] = set()
    for one in component_loaders(loader):
        batch_sampler = getattr(one, "batch_sampler", None)
        for obj in (getattr(one, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
            if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
                seen.add(id(obj))
                obj.set_epoch(epoch)


def skip_batches(loader: Any, num_batches: int) -> int:
    """Arrange for the next pass to start ``num_batches`` in; returns how many the loop must skip itself.

    With DataLoader workers the loop replays the skipped batches (loads and drops them): a worker's
    RNG stream (random augmentations) advances with every sample it loads and batches go to workers
    round-robin, so only loading them again, from the same base seed (``iterator_rng_state``), puts
    every worker's stream where it was. That costs a partial epoch of loading, without compute."""
    if not num_batches or getattr(loader, "num_workers", 0):
        return num_batches
    sampler, batch_sampler = getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, SplitSampler):  # the user's batch sampler: one draw per batch
        batch_sampler.skip(num_batches)
        return 0
    if isinstance(sampler, ResumableDistributedSampler) and loader.batch_size:
        sampler.skip(num_batches * loader.batch_size)
        return 0
    if isinstance(sampler, SplitSampler):
        sampler.skip(num_batches * (loader.batch_size or 1))  # batch_size None: a draw is a batch
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
    batch_sampler = getattr(loader, "batch_sampler", None)
    named = batch_sampler if isinstance(batch_sampler, SplitSampler) else sampler
    if isinstance(named, SplitSampler):
        named = named.sampler  # the user's, split per rank: its draws are not re-split on resume
    raise SamplerError(
        f"the checkpoint was taken {start} batches into an epoch with {old_dp} data-parallel rank(s) "
        f"and this run has {dp_size}; "
        f"the training DataLoader ({type(named).__name__}, batch_size={batch_size}) is not sampled "
        f"by polytrain's own sampler (a user sampler or batch sampler, or the user's own sharding), so its "
        f"position cannot be re-split over the new ranks. Resume with {old_dp} data-parallel ranks, "
        f"or from a "
        f"checkpoint taken at an epoch boundary"
    )


def _split_sampler(loader: Any) -> SplitSampler | None:
    for obj in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if isinstance(obj, SplitSampler):
            return obj
    return None


def user_sampler_state(loader: Any, mid_epoch: bool) -> torch.Tensor | None:
    """The state of the generator a split user sampler draws from, for a checkpoint: mid-epoch the one
    this epoch was drawn from, else the current one (the next epoch draws from it). None: no generator."""
    split = _split_sampler(loader)
    gen = split.generator if split is not None else None
    if gen is None:
        return None
    return split.drawn_from if mid_epoch and split.drawn_from is not None else gen.get_state()


def set_user_sampler_state(loader: Any, state: torch.Tensor) -> None:
    split = _split_sampler(loader)
    if split is not None and split.generator is not None:
        split.generator.set_state(state)


def iterator_rng_state(loader: Any) -> torch.Tensor:
    """The RNG state a new iterator of ``loader`` draws its workers' base seed from: the loader's own
    generator, else the main process's default one."""
    gen = getattr(loader, "generator", None)
    return gen.get_state() if gen is not None else torch.get_rng_state()


def set_iterator_rng_state(loader: Any, state: torch.Tensor) -> None:
    gen = getattr(loader, "generator", None)
    if gen is not None:
        gen.set_state(state)
    else:
        torch.set_rng_state(state)


def is_iterable_style(loader: Any) -> bool:
    """A loader whose batch count no rank knows in advance: an ``IterableDataset`` (its ``__len__``, if
    any, is only a hint) or an object without a length."""
    return isinstance(getattr(loader, "dataset", None), IterableDataset) or loader_length(loader) is None


def loader_length(loader: Any) -> int | None:
    """``len(loader)``, or None where it has none; a ``__len__`` that raises NotImplementedError (a wrapper
    that cannot know its length) counts as none, as in Lightning."""
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def iterable_with_len_warning() -> str:
    return ("Your `IterableDataset` has `__len__` defined. With several loader workers each one iterates "
            "the whole dataset unless its `__iter__` splits the stream by "
            "`torch.utils.data.get_worker_info()`, so that length can be wrong; polytrain treats it as an "
            "upper bound and ends the epoch when the stream does")


def stop_workers(iterator: Any, loader: Any, keep_persistent: bool) -> None:
    """Stop the worker processes behind a loader's iterator now that the loop is done with it.

    An epoch that ends at its batch count (or a stop mid-epoch) never exhausts its iterator, so torch does
    not stop its workers; they live until the iterator is collected. When that is the cyclic collector
    (the loop's objects refer to each other), the iterator's queues are finalised before its ``__del__``
    runs, the stop message never reaches the workers and torch waits out a 5 s join on each of them:
    whatever code triggered the collection (the next fit, a training step) stalls. ``keep_persistent``:
    between epochs of a fit, a ``persistent_workers`` loader keeps its workers, as it asks; when the fit or
    the evaluation ends they stop too (Lightning's data fetcher tears them down likewise)."""
    if isinstance(iterator, CombinedIterator) or (iterator is None and len(component_loaders(loader)) > 1):
        # a CombinedLoader's pass: each loader's own iterator (or persistent workers)
        iterators = iterator.iterators if iterator is not None else [None] * len(component_loaders(loader))
        for one_iterator, one in zip(iterators, component_loaders(loader)):
            stop_workers(one_iterator, one, keep_persistent)
        return
    target = loader if isinstance(loader, DataLoader) else getattr(loader, "loader", None)  # EvalBatches
    persistent = None
    if isinstance(target, DataLoader) and target.persistent_workers:
        persistent = getattr(target, "_iterator", None)
    if persistent is not None and not keep_persistent:
        persistent._shutdown_workers()
        target._iterator = None  # the loader would hand the stopped iterator out again
    if iterator is not None and iterator is not persistent:
        if hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()  # a stateful loader's iterator still answers state_dict() after
        elif inspect.isgenerator(iterator):
            iterator.close()  # EvalBatches and the like: their own iterators are dropped with them
