"""Checks that stop bad runs early and identically on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from polytrain.strategies import collectives as C
from polytrain.trainer.data import loader_length

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer


class EmptyDataError(ValueError):
    pass


def _describe(loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else "?"
    return (f"dataset of {size} samples, batch_size={getattr(loader, 'batch_size', '?')}, "
            f"drop_last={getattr(loader, 'drop_last', '?')}")


def check_batches(trainer: Trainer, loader: Any, stage: str) -> int:
    """Number of batches this epoch, agreed by all ranks before any training happens.

    A rank with zero batches, or ranks with different counts, would otherwise train zero steps
    and report success, or leave the others waiting in a gradient all-reduce.
    """
    strategy = trainer.strategy
    length = loader_length(loader)
    limit = trainer.config.limit_train_batches
    if length is None and limit is None:
        raise EmptyDataError(f"the {stage} DataLoader has no length (an IterableDataset?); set "
                             f"trainer.limit_train_batches to the number of batches per epoch")
    if limit is None:
        count = length
    else:
        count = limit if length is None else min(length, limit)
    dataset = getattr(loader, "dataset", None)
    samples = len(dataset) if hasattr(dataset, "__len__") else None
    # Gathered before anyone raises: every rank must reach the same verdict, or some would wait.
    gathered = strategy.all_gather_object((count, samples), strategy.dp_group)
    counts = [int(c) for c, _ in gathered]
    sampler = getattr(loader, "sampler", None)
    if samples is not None and samples < strategy.dp_size and hasattr(sampler, "num_replicas"):
        raise EmptyDataError(
            f"the {stage} dataset has {samples} sample(s) for {strategy.dp_size} data-parallel ranks: some "
            f"ranks would only see padding copies of other ranks' samples. Use at least {strategy.dp_size} "
            f"samples or fewer processes"
        )
    if min(counts) == 0:
        raise EmptyDataError(
            f"the {stage} DataLoader yields 0 batches on data-parallel rank(s) "
            f"{[r for r, c in enumerate(counts) if c == 0]} (per-rank batches: {counts}; this rank: "
            f"{_describe(loader)}). Provide more samples than ranks x batch_size, lower the batch size, "
            f"or set drop_last=False"
        )
    if len(set(counts)) > 1:
        raise ValueError(
            f"data-parallel ranks have different numbers of {stage} batches per epoch: {counts}. Every "
            f"rank must take the same number of optimizer steps; use polytrain's sampler "
            f"(trainer.use_distributed_sampler=true) or make your sampler split evenly"
        )
    return count


class NonFiniteError(FloatingPointError):
    pass


class NonFiniteGuard:
    """Watches the loss for inf/NaN.

    ``nan_policy: error`` keeps the first bad step on the device (no per-step sync) and checks it
    on logging steps, before every checkpoint and at the end, so a checkpoint never holds the
    damage. ``nan_policy: skip`` agrees on every step (one small all-reduce + host sync) and all
    ranks skip the optimizer step together, leaving parameters unchanged.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.policy = trainer.config.nan_policy
        self.device = trainer.strategy.collective_device
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=self.device)
        # Counted on the device: building a tensor from the host's step number every step would
        # be a host-to-device copy, which waits for the stream on CUDA.
        self.step = torch.full((), trainer.global_step, dtype=torch.long, device=self.device)
        self._bad_now: torch.Tensor | None = None
        self._window_bad: torch.Tensor | None = None
        self.skipped_steps = 0

    def observe(self, loss: torch.Tensor | None, end_of_window: bool = True) -> None:
        """Called for every micro-batch: a bad loss anywhere in an accumulation window has already
        poisoned the accumulated gradients, so the window's optimizer step counts as bad."""
        if loss is not None:
            bad = ~torch.isfinite(loss.detach()).all()
            self._window_bad = bad if self._window_bad is None else self._window_bad | bad
        if not end_of_window:
            return
        self._bad_now, self._window_bad = self._window_bad, None
        if self.policy == "error":
            if self._bad_now is not None:
                self.first_bad_step = torch.where(self._bad_now.to(self.device) & (self.first_bad_step < 0),
                                                  self.step, self.first_bad_step)
            self.step += 1  # every window, loss or not, so the step named matches trainer.global_step

    def should_skip_step(self) -> bool:
        if self.policy != "skip":
            return False
        bad_here = bool(self._bad_now) if self._bad_now is not None else False
        skip = self.trainer.strategy.reduce_boolean_decision(bad_here)
        self.skipped_steps += int(skip)
        return skip

    def check(self) -> None:
        """Collective: every rank calls it at the same points."""
        if self.policy != "error":
            return
        steps = C.all_gather(self.first_bad_step)
        bad = [(int(s), r) for r, s in enumerate(steps.tolist()) if s >= 0]
        if bad:
            step = min(s for s, _ in bad)
            ranks = [r for s, r in bad if s == step]
            raise NonFiniteError(
                f"non-finite loss at step {step} on rank(s) {ranks}; training stopped before any later "
                f"checkpoint was written. Lower the learning rate, enable gradient clipping, or set "
                f"trainer.nan_policy=skip to skip such steps"
            )
