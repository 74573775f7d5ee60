"""Checks that stop bad runs early and identically on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import collectives as C
from polytrain.core.errors import EmptyDataError, NonFiniteError
from polytrain.data.loaders import is_iterable_style

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer


def _describe(loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else "?"
    return (f"dataset of {size} samples, batch_size={getattr(loader, 'batch_size', '?')}, "
            f"drop_last={getattr(loader, 'drop_last', '?')}")


def check_batches(trainer: Trainer, loader: Any, stage: str, count: int | None) -> tuple[int | None, bool]:
    """``(batches per epoch, agreed)``, the same on every rank and settled before any training happens.
    ``count`` is this rank's loader length after the limits (None: unknown).

    Sized (map-style) loaders: the count. A rank with zero batches, or ranks with different counts,
    would otherwise train zero steps and report success, or leave the others waiting in a gradient
    all-reduce. Iterable-style loaders (``agreed``): no rank knows how many batches its stream holds,
    so the ranks agree before each batch whether every one still has one (``AgreedBatches``); the
    count is then an upper bound (the limit, or the smallest ``__len__``), or None (until the streams end).
    """
    strategy = trainer.strategy
    dataset = getattr(loader, "dataset", None)
    samples = len(dataset) if hasattr(dataset, "__len__") else None
    # Gathered before anyone raises: every rank must reach the same verdict, or some would wait.
    gathered = strategy.all_gather_object((count, samples, is_iterable_style(loader)), strategy.dp_group)
    agreed = any(iterable for _, _, iterable in gathered)
    counts = [int(c) for c, _, _ in gathered if c is not None]
    sampler = getattr(loader, "sampler", None)
    if samples is not None and samples < strategy.dp_size and hasattr(sampler, "num_replicas"):
        raise EmptyDataError(
            f"the {stage} dataset has {samples} sample(s) for {strategy.dp_size} data-parallel ranks: some "
            f"ranks would only see padding copies of other ranks' samples. Use at least {strategy.dp_size} "
            f"samples or fewer processes"
        )
    if counts and min(counts) == 0:
        raise EmptyDataError(
            f"the {stage} DataLoader yields 0 batches on data-parallel rank(s) "
            f"{[r for r, (c, _, _) in enumerate(gathered) if c == 0]} (per-rank batches: {[c for c, _, _ in gathered]}; "
            f"this rank: {_describe(loader)}). Provide more samples than ranks x batch_size, lower the batch size, "
            f"or set drop_last=False"
        )
    if agreed:
        # An iterable's ranks end the epoch together, at the shortest stream (or this bound).
        return (min(counts) if len(counts) == len(gathered) else None), True
    if len(set(counts)) > 1:
        raise ValueError(
            f"data-parallel ranks have different numbers of {stage} batches per epoch: {counts}. Every "
            f"rank must take the same number of optimizer steps; use polytrain's sampler "
            f"(trainer.use_distributed_sampler=true) or make your sampler split evenly"
        )
    return count, False


class NonFiniteGuard:
    """Watches the loss for inf/NaN.

    ``nan_policy: error`` keeps the first bad step on the device (no per-step sync) and checks it
    on logging steps, before every checkpoint and at the end, so a checkpoint never holds the
    damage. ``nan_policy: skip`` agrees on every step (one small all-reduce + host sync) and all
    ranks skip the optimizer step together, leaving parameters unchanged.
    """

    FOLD_EVERY = 256  # pending losses (error policy) checked together at most this many at a time

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.policy = trainer.config.nan_policy
        self.device = trainer.strategy.collective_device
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=self.device)
        # Error policy: losses wait on the device with their step (a host int) and are checked
        # together by _fold at the next check() or every FOLD_EVERY losses -- a few tensor ops per
        # fold instead of five per step (measured: benchmarks/overhead.py), still no host sync.
        self.step = trainer.global_step
        self._pending: list[torch.Tensor] = []
        self._pending_steps: list[int] = []
        self._bad_now: torch.Tensor | None = None
        self._window_bad: torch.Tensor | None = None
        self.skipped_steps = 0
        # Gradient norms (only known when clipping by norm): the first step whose norm was non-finite.
        self.first_bad_norm_step = torch.full((), -1, dtype=torch.long, device=self.device)

    def observe(self, loss: torch.Tensor | None, end_of_window: bool = True) -> None:
        """Called for every micro-batch: a bad loss anywhere in an accumulation window has already
        poisoned the accumulated gradients, so the window's optimizer step counts as bad."""
        if self.policy == "error":
            if loss is not None:
                self._pending.append(loss.detach() if loss.requires_grad else loss)  # strategies pass it detached
                self._pending_steps.append(self.step)
            if end_of_window:
                self.step += 1  # every window, loss or not, so the step named matches trainer.global_step
                if len(self._pending) >= self.FOLD_EVERY:
                    self._fold()
            return
        if loss is not None:
            bad = ~torch.isfinite(loss.detach()).all()
            self._window_bad = bad if self._window_bad is None else self._window_bad | bad
        if not end_of_window:
            return
        self._bad_now, self._window_bad = self._window_bad, None

    def _fold(self) -> None:
        """The earliest step among the pending losses with a non-finite value, into
        ``first_bad_step``; on the device, no host sync (the step numbers go from pinned memory)."""
        if not self._pending:
            return
        losses, steps = self._pending, self._pending_steps
        self._pending, self._pending_steps = [], []
        if all(t.dim() == 0 for t in losses):
            values = torch.stack(losses)
        else:  # non-scalar losses: every element carries its step
            steps = [s for t, s in zip(losses, steps) for _ in range(t.numel())]
            values = torch.cat([t.reshape(-1) for t in losses])
        index = torch.tensor(steps, dtype=torch.long)
        pinned = values.device.type == "cuda"
        index = (index.pin_memory() if pinned else index).to(values.device, non_blocking=pinned)
        none = torch.iinfo(torch.long).max
        first = torch.where(torch.isfinite(values), none, index).min().to(self.device)
        self.first_bad_step = torch.where((self.first_bad_step < 0) & (first < none), first, self.first_bad_step)

    def should_skip_step(self) -> bool:
        if self.policy != "skip":
            return False
        bad_here = bool(self._bad_now) if self._bad_now is not None else False
        skip = self.trainer.strategy.reduce_boolean_decision(bad_here)
        self.skipped_steps += int(skip)
        return skip

    def check_grad_norm(self, norm: torch.Tensor | None) -> bool:
        """The strategy's hook after clipping by norm (the total norm is then known): a NaN/inf
        norm marks the step bad even when the loss was finite. Returns True when the optimizer step
        must be skipped (``nan_policy: skip``, agreed by every rank). With a GradScaler (16-mixed)
        the scaler already skips inf/NaN gradients, so its overflow steps are not errors."""
        if norm is None or getattr(self.trainer.strategy.precision, "scaler", None) is not None:
            return False
        bad = ~torch.isfinite(norm.detach()).all()
        if self.policy == "skip":
            skip = self.trainer.strategy.reduce_boolean_decision(bool(bad))
            self.skipped_steps += int(skip)
            return skip
        # `self.step` already counts this window (observe ran first): the step is self.step - 1.
        self.first_bad_norm_step = torch.where(bad.to(self.device) & (self.first_bad_norm_step < 0),
                                               self.step - 1, self.first_bad_norm_step)
        return False

    def _params_bad(self) -> torch.Tensor:
        """1 if any parameter this rank holds is NaN/inf (a NaN gradient from a finite loss lands
        here when no clipping norm was there to catch it). A pass over the parameters: only at checks."""
        # Each parameter's min and max in one pass: NaN propagates into both and an inf is an
        # extreme, so they are finite exactly when every element is (isfinite().all() makes
        # several passes and temporaries: ~5x slower on CPU, see docs/performance.md).
        extremes = []
        for p in self.trainer.module.parameters():
            local = (p.to_local() if hasattr(p, "to_local") else p).detach()  # a DTensor shard
            if local.is_complex():
                local = torch.view_as_real(local)
            if local.numel() and local.is_floating_point():  # integer/bool values are always finite
                extremes.extend(e.to(self.device) for e in torch.aminmax(local))
        if not extremes:
            return torch.zeros((), dtype=torch.long, device=self.device)
        return (~torch.isfinite(torch.stack(extremes)).all()).long()

    def check(self) -> None:
        """Collective: every rank calls it at the same points, whatever the policy (parameters
        are checked under both: skipping steps cannot repair them)."""
        if self.policy == "error":
            self._fold()
        local = torch.stack([self.first_bad_step, self.first_bad_norm_step, self._params_bad()])
        gathered = C.all_gather(local).tolist()
        bad = [(int(s), r) for r, (s, _, _) in enumerate(gathered) if s >= 0]
        bad_norm = [(int(n), r) for r, (_, n, _) in enumerate(gathered) if n >= 0]
        if bad_norm and (not bad or min(bad_norm)[0] < min(bad)[0]):
            step = min(s for s, _ in bad_norm)
            ranks = [r for s, r in bad_norm if s == step]
            raise NonFiniteError(
                f"non-finite gradient norm at step {step} on rank(s) {ranks} (the loss was finite); training "
                f"stopped before any later checkpoint was written. Look for an op with an unstable backward, "
                f"lower the learning rate, or set trainer.nan_policy=skip to skip such steps"
            )
        if bad:
            step = min(s for s, _ in bad)
            ranks = [r for s, r in bad if s == step]
            raise NonFiniteError(
                f"non-finite loss at step {step} on rank(s) {ranks}; training stopped before any later "
                f"checkpoint was written. Lower the learning rate, enable gradient clipping, or set "
                f"trainer.nan_policy=skip to skip such steps"
            )
        params = [r for r, (_, _, p) in enumerate(gathered) if p]
        if params:
            raise NonFiniteError(
                f"non-finite parameters on rank(s) {params} after step {self.trainer.global_step} although every "
                f"checked loss was finite: a NaN/inf gradient from a finite loss was applied. Only the loss is "
                f"checked per step unless gradient clipping by norm is on (trainer.gradient_clip_val): set it to "
                f"catch the exact step. Training stopped before any later checkpoint was written"
            )
