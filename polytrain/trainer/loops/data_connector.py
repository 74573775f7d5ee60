"""Where loaders come from and how many batches of each run: the explicit loaders given to
``fit``/``validate``/..., else the DataModule's, else the module's ``*_dataloader``; then the
strategy's sampler injection; ``limit_*_batches`` (a count or a fraction), ``overfit_batches``,
``fast_dev_run``; the iterator a training epoch starts with after a resume; and, for iterable-style
training data, the per-batch agreement that lets ranks whose streams differ in length end together."""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from polytrain.core.errors import ConfigError
from polytrain.core.rank_zero import rank_zero_warn
from polytrain.core.rng import restore_rng_state, user_seed
from polytrain.data.combined_loader import CombinedBatches, CombinedLoader, map_loaders
from polytrain.data.loaders import (
    iterable_with_len_warning,
    iterator_rng_state,
    loader_length,
    record_pin_memory_choice,
    resume_position,
    set_epoch,
    set_iterator_rng_state,
    set_user_sampler_state,
)
from polytrain.data.stateful import restore_state, state_source
from polytrain.trainer.api.datamodule import DataModule
from polytrain.trainer.api.hooks import is_overridden
from polytrain.trainer.api.module import TrainModule
from polytrain.trainer.loops.progress import Resumed

log = logging.getLogger("polytrain")

LOADER_METHOD = {"train": "train_dataloader", "val": "val_dataloader", "test": "test_dataloader",
                 "predict": "predict_dataloader"}
LIMIT_OPTION = {"train": "limit_train_batches", "val": "limit_val_batches", "test": "limit_test_batches",
                "predict": "limit_predict_batches"}


class DataConnector:
    """A stage's data: where each loader comes from, the loader as the strategy processes it, and how many
    batches of it a pass runs. Built with the stage's collaborators: the options, the strategy, the hook
    funnel (loaders defined by the module or the DataModule are called through it), and the loaders
    given to the entry point."""

    def __init__(self, config: Any, strategy: Any, hooks: Any, module: Any, datamodule: Any,
                 given_loaders: dict[str, Any]) -> None:
        self.config = config
        self.strategy = strategy
        self.hooks = hooks
        self.module = module
        self.datamodule = datamodule
        self.given_loaders = given_loaders

    def source(self, stage: str) -> Any:
        """Where ``stage``'s loader comes from: loaders given to the entry point, else the DataModule's
        method, else the module's (called through the hook funnel); None when nothing defines one (as
        Lightning, the base class's ``*_dataloader`` is never called)."""
        name = LOADER_METHOD[stage]
        if self.given_loaders.get(stage) is not None:
            return self.given_loaders[stage]
        if self.datamodule is not None and is_overridden(self.datamodule, name, DataModule):
            return functools.partial(self.hooks.datamodule, name)
        if is_overridden(self.module, name, TrainModule):
            return functools.partial(self.hooks.module, name)
        return None

    def _from_source(self, stage: str) -> Any:
        source = self.source(stage)
        if callable(source) and not isinstance(source, DataLoader):
            with record_pin_memory_choice():  # an explicit pin_memory=False is kept on CUDA
                return source()
        return source

    def request(self, stage: str, resumed_dp: int | None = None) -> Any:
        """The processed training loader, or None. A list or dict of loaders is read as Lightning reads it,
        through a ``CombinedLoader`` in ``max_size_cycle`` mode (a batch is then a list or dict of batches);
        a ``CombinedLoader`` given keeps its mode. Each loader is processed on its own (its own distributed
        sampler). ``resumed_dp``: the data-parallel size of the checkpoint a fit resumes mid-epoch from."""
        loader = self._from_source(stage)
        if loader is None:
            return None
        if isinstance(loader, (list, tuple, Mapping)) and not isinstance(loader, DataLoader):
            loader = CombinedLoader(loader, "max_size_cycle")
        if isinstance(loader, CombinedLoader):
            if loader.mode == "sequential":
                raise ConfigError(f"{LOADER_METHOD[stage]}(): CombinedLoader(mode='sequential') cannot feed "
                                  f"training (Lightning's `FitLoop` does not support it either); the "
                                  f"available modes are min_size, max_size_cycle and max_size")
            return map_loaders(loader, lambda one: self._process(stage, one, resumed_dp)).batches()
        return self._process(stage, loader, resumed_dp)

    def request_eval(self, stage: str) -> list[Any]:
        """Every loader of an evaluation stage (``val``/``test``/``predict``), processed: one, or several
        where the source gives a list, a tuple (in order), a dict (in its keys' order) or a
        ``CombinedLoader`` in ``sequential`` mode; none when nothing defines the stage's loader. A
        ``CombinedLoader`` in another mode is one loader whose batches combine its loaders'."""
        loader = self._from_source(stage)
        if loader is None:
            return []
        if isinstance(loader, CombinedLoader):
            if loader.mode == "sequential":
                return [self._process(stage, one) for one in loader.flattened]
            return [map_loaders(loader, lambda one: self._process(stage, one)).batches()]
        return [self._process(stage, one) for one in several_loaders(loader)]

    def _process(self, stage: str, loader: Any, resumed_dp: int | None = None) -> Any:
        """``loader`` as this stage reads it: overfit_batches' order, the strategy's sampler."""
        cfg, strategy = self.config, self.strategy
        per_node = max(1, strategy.world_size // max(1, strategy.num_nodes))
        check_workers(loader, f"{stage}_dataloader", per_node)
        if (cfg.overfit_batches and isinstance(loader, DataLoader) and stage == "train"
                and not isinstance(loader.dataset, IterableDataset)
                and not isinstance(loader.sampler, SequentialSampler)):
            warnings.warn("overfit_batches: the training DataLoader is read in order (shuffling off), the "
                          "same batches every epoch", stacklevel=2)
            loader = DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False,
                                num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                pin_memory=loader.pin_memory, drop_last=loader.drop_last)
        # The user's seed_everything seed when trainer.seed is unset, as Lightning seeds its
        # DistributedSampler.
        seed = cfg.seed if cfg.seed is not None else (user_seed() or 0)
        use_sampler = cfg.use_distributed_sampler
        if use_sampler is True and stage == "train" and resumed_dp not in (None, strategy.dp_size):
            use_sampler = "always"  # an N-rank epoch resumed on one rank continues in the N-rank order
        return strategy.process_dataloader(loader, stage, seed, use_sampler)

    def _limit(self, stage: str) -> Any:
        """The batch limit that applies to ``stage``: fast_dev_run's, else overfit_batches', else limit_*."""
        return stage_limit(self.config, stage)

    def disabled(self, stage: str) -> bool:
        """``limit_<stage>_batches=0``: as Lightning, that loop does not run and its loader is never
        requested."""
        limit = self._limit(stage)
        return limit is not None and limit == 0

    def batch_limit(self, stage: str, loader: Any) -> int | None:
        """How many batches of ``loader`` a pass of ``stage`` runs (None: until the iterator ends)."""
        length = loader_length(loader)
        if length is not None and isinstance(getattr(loader, "dataset", None), IterableDataset):
            rank_zero_warn(iterable_with_len_warning())
        return limited_count(self.config, stage, length)


def stage_limit(config: Any, stage: str) -> Any:
    """The batch limit that applies to ``stage``: fast_dev_run's, else overfit_batches', else limit_*."""
    if config.fast_dev_run:
        return 1 if config.fast_dev_run is True else int(config.fast_dev_run)
    if config.overfit_batches and stage in ("train", "val"):
        return config.overfit_batches
    return getattr(config, LIMIT_OPTION[stage])


def limited_count(config: Any, stage: str, length: int | None) -> int | None:
    """The batches a pass of ``stage`` over a loader of ``length`` batches runs (None: until it ends)."""
    limit = stage_limit(config, stage)
    option = LIMIT_OPTION[stage]
    if limit is None:
        return length
    if isinstance(limit, float) and limit <= 1.0:  # a fraction of the epoch (1.0: all of it)
        if length is None and limit == 1.0:
            return None  # all of a stream: until it ends
        if length is None:
            raise ConfigError(f"trainer.{option}={limit} is a fraction, but the {stage} loader has no "
                              f"length (an `IterableDataset`?): `Trainer({option})` must be `1.0` or an "
                              f"int, a number of batches")
        count = int(length * limit)
        if count == 0 and limit > 0:
            raise ConfigError(f"trainer.{option}={limit} x {length} {stage} batches = 0 batches; use at "
                              f"least {1 / length:.4g} or a number of batches")
        return count
    if isinstance(limit, float) and not limit.is_integer():
        raise ConfigError(f"trainer.{option}={limit}: give a fraction in [0, 1] or a whole number of "
                          f"batches")
    return int(limit) if length is None else min(length, int(limit))


def reported_batches(config: Any, stage: str, loaders: list[Any],
                     limits: list[int | None]) -> list[int | None]:
    """The counts Lightning's ``trainer.num_<stage>_batches`` lists: one per loader, and for a
    ``CombinedLoader`` read whole (``min_size``, ``max_size_cycle``, ``max_size``) one per loader it
    combines, each under the stage's limit, though the pass itself runs ``limits``' count."""
    counts: list[int | None] = []
    for loader, limit in zip(loaders, limits):
        if isinstance(loader, CombinedBatches):
            counts.extend(limited_count(config, stage, loader_length(one)) for one in loader.flattened)
        else:
            counts.append(limit)
    return counts


def check_workers(loader: Any, name: str, processes_per_node: int) -> None:
    """Lightning's warnings about a DataLoader's workers: too few for this machine's cores (loading then
    starves the step), or spawned workers started again every epoch."""
    if not isinstance(loader, DataLoader):
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    upper_bound = max(1, cpus // processes_per_node - 1)  # one core left to the training process
    context = loader.multiprocessing_context
    start_method = context.get_start_method() if context is not None else mp.get_start_method()
    if loader.num_workers > 0 and start_method == "spawn" and not loader.persistent_workers:
        rank_zero_warn(f"Consider setting `persistent_workers=True` in '{name}' to speed up the dataloader "
                       f"worker initialization (spawned workers start again for every epoch)")
    elif loader.num_workers < 2 and upper_bound > 1:
        rank_zero_warn(f"The '{name}' does not have many workers which may be a bottleneck. Consider "
                       f"increasing the value of the `num_workers` argument to "
                       f"`num_workers={upper_bound}` in the `DataLoader` to improve performance "
                       f"({cpus} cores for {processes_per_node} process(es) on this node)")


def several_loaders(loaders: Any) -> list[Any]:
    """A stage's loaders as a list: a list or tuple in order, a dict's values in its keys' order, or one
    loader alone."""
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    if isinstance(loaders, Mapping) and not isinstance(loaders, DataLoader):
        return list(loaders.values())
    return [loaders]


def epoch_iterator(loader: Any, epoch: int, start: int, num_batches: int | None, dp_size: int,
                   resumed: Resumed) -> tuple[Any, int, tuple[int, int], torch.Tensor]:
    """The training iterator for ``epoch``, the batch index it starts at, the ``(samples, batches)``
    position it counts from (after a resume re-split the epoch) and the RNG state it drew its workers'
    seed from (checkpointed: a mid-epoch resume recreates the iterator). Consumes what ``resumed`` holds."""
    set_epoch(loader, epoch)
    saved_loop, saved_data, resumed.data = resumed.take_loop(), resumed.data, None
    if restore_state(loader, saved_data, dp_size):
        manual_skip, sample_base = 0, (0, 0)  # stateful data continues where it was: nothing is replayed
    else:
        # After a resume the position may come from another data-parallel size: re-split it.
        start, manual_skip, sample_base = resume_position(loader, start, num_batches, dp_size, saved_loop)
    rng, resumed.rng = resumed.rng, None
    if rng is not None and "user_sampler" in rng:  # a split user sampler's own generator, as the epoch drew
        set_user_sampler_state(loader, rng["user_sampler"])
    if rng is not None and not resumed.mid_epoch:
        # Saved at an epoch boundary: the original run drew from the RNG when this epoch's
        # iterator was created, so restore before creating it.
        restore_rng_state(rng)
        rng = None
    if rng is not None and "loader_iter" in rng:
        # Saved mid-epoch: the epoch's iterator drew its workers' base seed from this state; the
        # skipped batches are replayed through the workers (skip_batches), so each stream is where it was.
        set_iterator_rng_state(loader, rng["loader_iter"])
    loader_rng = iterator_rng_state(loader)
    iterator = iter(loader)
    for _ in range(manual_skip):
        next(iterator)
    if rng is not None:
        # Saved mid-epoch: that run created its iterator before the checkpoint, so restore after.
        restore_rng_state(rng)
    resumed.mid_epoch = False
    return iterator, start, sample_base, loader_rng


NO_BATCH = object()  # AgreedBatches.take: some rank's stream has ended


class AgreedBatches:
    """Iterable-style training data: no rank knows in advance how many batches its stream holds, and
    ranks may hold different numbers. One batch is fetched ahead (as Lightning's prefetching fetcher)
    and, before each batch, the ranks agree whether every one of them has it (``any_missing``: one
    small all-reduce per batch, paid by iterable-style loaders only), so all of them end the epoch at
    the same batch, the shortest rank's end, and the loop knows which batch is the last (it closes
    its accumulation window)."""

    __slots__ = ("iterator", "any_missing", "_next", "snapshot", "state")

    def __init__(self, iterator: Iterator[Any], any_missing: Callable[[bool], bool],
                 snapshot: Callable[[], Any] | None = None) -> None:
        self.iterator = iterator
        self.any_missing = any_missing
        # Stateful data (``snapshot``: its state_dict): the batch fetched ahead moved the source past the
        # batches consumed, so its state is read before each fetch; a checkpoint saves that one.
        self.snapshot = snapshot
        self.state: Any = None
        self._next = self._fetch()

    def _fetch(self) -> Any:
        if self.snapshot is not None:
            self.state = self.snapshot()
        item = next(self.iterator, NO_BATCH)
        return NO_BATCH if self.any_missing(item is NO_BATCH) else item

    def take(self, more_wanted: bool) -> tuple[Any, bool]:
        """``(batch, is_last)``; ``batch`` is ``NO_BATCH`` when some rank has no batch left. With
        ``more_wanted`` False (the epoch's bound is reached) nothing more is fetched."""
        batch = self._next
        if batch is NO_BATCH:
            return NO_BATCH, True
        if more_wanted:
            self._next = self._fetch()
        else:
            self._next = NO_BATCH
            if self.snapshot is not None:
                self.state = self.snapshot()
        return batch, self._next is NO_BATCH


def agreed_batches(iterator: Iterator[Any], any_missing: Callable[[bool], bool],
                   loader: Any) -> AgreedBatches:
    """``AgreedBatches`` over ``loader``'s iterator, snapshotting its data state when it keeps one."""
    found = state_source(loader)
    return AgreedBatches(iterator, any_missing, found[0].state_dict if found is not None else None)

