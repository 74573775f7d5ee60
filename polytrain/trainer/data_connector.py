"""Where loaders come from and how many batches of each run: the explicit loaders given to
``fit``/``validate``/..., else the DataModule's, else the module's ``*_dataloader``; then the
strategy's sampler injection; ``limit_*_batches`` (a count or a fraction), ``overfit_batches``,
``fast_dev_run``; and the iterator a training epoch starts with after a resume."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from polytrain.core.errors import ConfigError
from polytrain.core.rng import restore_rng_state
from polytrain.data.loaders import loader_length, record_pin_memory_choice, resume_position, set_epoch

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

log = logging.getLogger("polytrain")

LOADER_METHOD = {"train": "train_dataloader", "val": "val_dataloader", "test": "test_dataloader",
                 "predict": "predict_dataloader"}
LIMIT_OPTION = {"train": "limit_train_batches", "val": "limit_val_batches", "test": "limit_test_batches",
                "predict": "limit_predict_batches"}


def request_loader(trainer: Trainer, stage: str) -> Any:
    """The processed loader for ``stage`` (``train``/``val``/``test``/``predict``), or None."""
    name = LOADER_METHOD[stage]
    loader = trainer.given_loaders.get(stage)
    if loader is None:
        datamodule = trainer.datamodule
        source = datamodule if datamodule is not None and callable(getattr(datamodule, name, None)) \
            else trainer.module
        with record_pin_memory_choice():  # an explicit pin_memory=False is kept on CUDA
            loader = getattr(source, name)()
    if loader is None:
        return None
    if isinstance(loader, (list, tuple)):
        if len(loader) != 1:
            raise ConfigError(f"{name}() returned {len(loader)} DataLoaders; polytrain runs one per stage: "
                              f"concatenate the datasets or evaluate them in separate calls")
        loader = loader[0]
    if trainer.config.overfit_batches and isinstance(loader, DataLoader) and stage == "train" \
            and not isinstance(loader.dataset, IterableDataset) and not isinstance(loader.sampler, SequentialSampler):
        warnings.warn("overfit_batches: the training DataLoader is read in order (shuffling off), the same "
                      "batches every epoch", stacklevel=2)
        loader = DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False,
                            num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                            pin_memory=loader.pin_memory, drop_last=loader.drop_last)
    strategy, cfg = trainer.strategy, trainer.config
    seed = cfg.seed if cfg.seed is not None else 0
    return strategy.process_dataloader(loader, stage, seed, cfg.use_distributed_sampler)


def batch_limit(trainer: Trainer, stage: str, loader: Any) -> int | None:
    """How many batches of ``loader`` a pass of ``stage`` runs (None: until the iterator ends)."""
    cfg = trainer.config
    length = loader_length(loader)
    if cfg.fast_dev_run:
        limit: Any = 1 if cfg.fast_dev_run is True else int(cfg.fast_dev_run)
    elif cfg.overfit_batches and stage in ("train", "val"):
        limit = cfg.overfit_batches
    else:
        limit = getattr(cfg, LIMIT_OPTION[stage])
    if limit is None:
        return length
    if isinstance(limit, float) and limit <= 1.0:  # a fraction of the epoch (1.0: all of it)
        if length is None:
            raise ConfigError(f"trainer.{LIMIT_OPTION[stage]}={limit} is a fraction, but the {stage} loader has no "
                              f"length (an IterableDataset?); give a number of batches")
        count = int(length * limit)
        if count == 0 and limit > 0:
            raise ConfigError(f"trainer.{LIMIT_OPTION[stage]}={limit} x {length} {stage} batches = 0 batches; "
                              f"use at least {1 / length:.4g} or a number of batches")
        return count
    if isinstance(limit, float) and not limit.is_integer():
        raise ConfigError(f"trainer.{LIMIT_OPTION[stage]}={limit}: give a fraction in [0, 1] or a whole number "
                          f"of batches")
    return int(limit) if length is None else min(length, int(limit))


def epoch_iterator(trainer: Trainer, loader: Any, epoch: int) -> tuple[Any, int]:
    """The training iterator for ``epoch`` and the batch index it starts at (after a resume)."""
    start = trainer.batch_in_epoch
    set_epoch(loader, epoch)
    saved, trainer.resumed_loop = trainer.resumed_loop, None
    # After a resume the position may come from another data-parallel size: re-split it.
    start, manual_skip, trainer.sample_base = resume_position(loader, start, trainer.num_training_batches,
                                                              trainer.strategy.dp_size, saved)
    if trainer.pending_rng is not None and not trainer.resumed_mid_epoch:
        # Saved at an epoch boundary: the original run drew from the RNG when this epoch's
        # iterator was created, so restore before creating it.
        restore_rng_state(trainer.pending_rng)
        trainer.pending_rng = None
    iterator = iter(loader)
    for _ in range(manual_skip):
        next(iterator)
    if trainer.pending_rng is not None:
        # Saved mid-epoch: that run created its iterator before the checkpoint, so restore after.
        restore_rng_state(trainer.pending_rng)
        trainer.pending_rng = None
    trainer.resumed_mid_epoch = False
    return iterator, start
