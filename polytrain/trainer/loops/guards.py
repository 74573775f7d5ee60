"""Checks that stop bad runs early and identically on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import collectives as C
from polytrain.core.errors import EmptyDataError, NonFiniteError
from polytrain.data.loaders import is_iterable_style, loader_length

if TYPE_CHECKING:
    from polytrain.trainer.loops.progress import FitProgress


def _describe(loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else "?"
    return (f"dataset of {size} samples, batch_size={getattr(loader, 'batch_size', '?')}, "
            f"drop_last={getattr(loader, 'drop_last', '?')}")


def check_batches(strategy: Any, loader: Any, stage: str, count: int | None) -> tuple[int | None, bool]:
    """``(batches per epoch, agreed)``, the same on every rank and settled before any training happens.
    ``count`` is this rank's loader length after the limits (None: unknown).

    Sized (map-style) loaders: the count. A rank with zero batches, or ranks with different counts,
    would otherwise train zero steps and report success, or leave the others waiting in a gradient
    all-reduce. Iterable-style loaders (``agreed``): no rank knows how many batches its stream holds,
    so the ranks agree before each batch whether every one still has one (``AgreedBatches``); the
    count is then an upper bound (the limit, or the smallest ``__len__``), or None (until the streams end).
    """
    dataset = getattr(loader, "dataset", None)
    samples = loader_length(dataset) if dataset is not None else None  # a stream's __len__ may refuse
    # Gathered before anyone raises: every rank must reach the same verdict, or some would wait. A tensor
    # gather (-1: unknown), not an object one: one collective instead of two plus pickling.
    local = torch.tensor([-1 if count is None else count, -1 if samples is None else samples,
                          int(is_iterable_style(loader))],
                         dtype=torch.long, device=strategy.collective_device)
    gathered = [(None if c < 0 else c, None if n < 0 else n, bool(i))
                for c, n, i in strategy.all_gather(local, strategy.dp_group).tolist()]
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
            f"{[r for r, (c, _, _) in enumerate(gathered) if c == 0]} "
            f"(per-rank batches: {[c for c, _, _ in gathered]}; "
            f"this rank: {_describe(loader)}). Provide more samples than ranks x batch_size, "
            f"lower the batch size, or set drop_last=False"
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

    ``nan_policy: error`` keeps the losses on the device (no per-step sync) and checks them on
    logging steps, before every checkpoint and at the end, so a checkpoint never holds the damage.
    ``nan_policy: skip`` agrees on every step (one small all-reduce + host sync) and all ranks skip
    the optimizer step together, leaving parameters unchanged.
    """

    FOLD_EVERY = 256  # slots per buffer; kept losses (error policy) stacked at most this many at a time

    def __init__(self, policy: str, strategy: Any, module: Any, progress: FitProgress) -> None:
        self.policy = policy
        self.strategy, self.module, self.progress = strategy, module, progress
        self.device = strategy.collective_device
        self._gathers = C.active()  # several processes: verdicts are gathered (asked once per fit)
        # Error policy: no host read per step. Each scalar loss is added, as ``0 * loss``, into its own slot
        # of a zeroed buffer on its device, its step kept as a host int: a slot stays 0 while its loss is
        # finite and turns NaN for an inf or NaN one, exactly (never for a large finite value). A check reads
        # the buffer once, and the losses are dropped as their step ends: keeping them until the check instead
        # (stacked, reduced, then freed there, out of the cache by then) costs a logging step many times more
        # than one in-place add per step (docs/performance.md). A loss that cannot go into a slot (not a plain
        # scalar tensor, complex, on another device) is kept and stacked at the check. The steps are looked
        # up only when some rank found a bad value (the error path: ranks agree on entering it, so its gather
        # stays matched).
        self.step = progress.global_step  # this guard's own count of windows (see resume_at)
        self._slots: torch.Tensor | None = None  # FOLD_EVERY zeros, made at the first loss
        self._views: list[torch.Tensor] = []  # each slot as a tensor of its own
        self._slot_steps: list[int] = []  # the step of each filled slot
        self._slotted = True  # False from the first loss that did not fit a slot
        self._pending: list[torch.Tensor] = []  # losses kept whole, with their steps
        self._pending_steps: list[int] = []
        self._folded: list[tuple[torch.Tensor, list[int]]] = []  # (values, the step of each value)
        self._bad_now: torch.Tensor | None = None
        self._window_bad: torch.Tensor | None = None
        self.skipped_steps = 0
        self.skip_step = False  # nan_policy skip: this window's optimizer step is vetoed (reset by the loop)
        # Gradient norms (only known when clipping by norm): the first step whose norm was non-finite.
        self.first_bad_norm_step = torch.full((), -1, dtype=torch.long, device=self.device)
        self._norms_seen = False
        # (windows observed, global step) at the last check that passed with the parameters. A check with
        # nothing new since (the fit's last one right after an epoch-end checkpoint) has nothing to test:
        # both counts are the same on every rank, so every rank skips it together.
        self._checked_all_at: tuple[int, int] | None = None

    def observe(self, loss: torch.Tensor | None, end_of_window: bool = True) -> None:
        """Called for every micro-batch: a bad loss anywhere in an accumulation window has already
        poisoned the accumulated gradients, so the window's optimizer step counts as bad."""
        if self.policy == "error":
            if loss is not None:
                loss = loss.detach() if loss.requires_grad else loss  # strategies pass it detached
                if type(loss) is not torch.Tensor and hasattr(loss, "to_local"):
                    # A DTensor: this rank's part (every rank's verdict is gathered). torch can neither add
                    # a DTensor into a plain slot (it asserts) nor read one with tolist().
                    loss = loss.to_local()
                filled = len(self._slot_steps)
                if type(loss) is not torch.Tensor:  # another tensor subclass: kept whole
                    self._keep(loss)
                elif filled < len(self._views):  # the common step: one in-place add into a slot
                    # made beforehand
                    try:
                        self._views[filled].add_(loss, alpha=0)
                        self._slot_steps.append(self.step)
                    except RuntimeError:
                        self._keep(loss)
                elif not (self._slotted and self._into_new_slot(loss)):
                    self._keep(loss)
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

    def _keep(self, loss: torch.Tensor) -> None:
        """A loss that fits no slot (not a plain scalar tensor, complex, on another device): kept whole,
        and from now on every loss is (one exception per step would cost more than keeping them)."""
        self._slotted, self._views = False, []
        self._pending.append(loss)
        self._pending_steps.append(self.step)

    def _into_new_slot(self, loss: torch.Tensor) -> bool:
        """The first loss, or more losses than slots since the last check: a new buffer (the full one set
        aside with its steps), and ``loss`` into its first slot. False if ``loss`` cannot go there."""
        if self._slots is not None:
            self._folded.append((self._slots, self._slot_steps))
            self._slot_steps = []
        self._slots = torch.zeros(self.FOLD_EVERY, dtype=torch.float32, device=loss.device)
        try:
            self._slots[0].add_(loss, alpha=0)
        except RuntimeError:
            return False
        self._views = list(self._slots.unbind())  # one view per slot, made once: no select per step
        self._slot_steps.append(self.step)
        return True

    def _fold(self) -> None:
        """The pending losses into one tensor (one op for scalar losses), each value with its step."""
        if not self._pending:
            return
        losses, steps = self._pending, self._pending_steps
        self._pending, self._pending_steps = [], []
        if all(t.dim() == 0 for t in losses):
            values = torch.stack(losses)
        else:  # non-scalar losses: every element carries its step
            steps = [s for t, s in zip(losses, steps) for _ in range(t.numel())]
            values = torch.cat([t.reshape(-1) for t in losses])
        self._folded.append((values, steps))

    def _first_bad_loss_step(self) -> int:
        """The earliest step with a non-finite loss since the last check, or -1 (a host sync: error path)."""
        self._fold()
        filled = [(self._slots[:len(self._slot_steps)], self._slot_steps)] if self._slot_steps else []
        firsts = []  # slots and kept losses are two sequences of steps: the first bad one of each
        for values, steps in (*self._folded, *filled):
            bad = [step for finite, step in zip(torch.isfinite(values).tolist(), steps) if not finite]
            firsts += bad[:1]
        return min(firsts, default=-1)

    def resume_at(self, step: int) -> None:
        """Count windows from ``step`` (the restored global step), so errors name the steps a user sees."""
        self.step = step

    def vote_on_skip(self) -> None:
        """``nan_policy: skip``: the ranks agree whether this window saw a non-finite loss; if any did, the
        window's optimizer step is vetoed (``skip_step``) on every rank."""
        if self.policy != "skip":
            return
        bad_here = bool(self._bad_now) if self._bad_now is not None else False
        skip = self.strategy.reduce_boolean_decision(bad_here)
        self.skipped_steps += int(skip)
        self.skip_step = self.skip_step or skip

    def check_grad_norm(self, norm: torch.Tensor | None) -> None:
        """After clipping by norm (the total norm is then known): a NaN/inf norm marks the step bad even
        when the loss was finite. Under ``nan_policy: skip`` the ranks agree and the step is vetoed
        (``skip_step``). With a GradScaler (16-mixed) the scaler already skips inf/NaN gradients, so its
        overflow steps are not errors."""
        if norm is None or getattr(self.strategy.precision, "scaler", None) is not None:
            return
        bad = ~torch.isfinite(norm.detach()).all()
        if self.policy == "skip":
            skip = self.strategy.reduce_boolean_decision(bool(bad))
            self.skipped_steps += int(skip)
            self.skip_step = self.skip_step or skip
            return
        # `self.step` already counts this window (observe ran first): the step is self.step - 1.
        self._norms_seen = True
        self.first_bad_norm_step = torch.where(bad.to(self.device) & (self.first_bad_norm_step < 0),
                                               self.step - 1, self.first_bad_norm_step)

    def _param_extremes(self) -> list[torch.Tensor]:
        """Each floating parameter's min and max on this rank, on the collective device: NaN propagates
        into both and an inf is an extreme, so they are finite exactly when every element is (a NaN
        gradient from a finite loss lands here when no clipping norm was there to catch it).
        ``isfinite().all()`` makes several passes and temporaries (slower: docs/performance.md)."""
        extremes: list[torch.Tensor] = []
        device = self.device
        for p in self.module.parameters():
            local = (p.to_local() if hasattr(p, "to_local") else p).detach()  # a DTensor shard
            if local.is_complex():
                local = torch.view_as_real(local)
            if local.numel() and local.is_floating_point():  # integer/bool values are always finite
                low, high = torch.aminmax(local)
                if low.device != device:  # layers placed on several devices
                    low, high = low.to(device), high.to(device)
                extremes += (low, high)
        return extremes

    def _params_bad(self) -> bool:
        extremes = self._param_extremes()
        return bool(extremes) and not bool(torch.isfinite(torch.stack(extremes)).all())

    def check(self, votes: tuple[bool, ...] = (), parameters: bool = True) -> list[bool]:
        """Collective: every rank calls it at the same points, whatever the policy. The losses since
        the last check are tested (one read of the slot buffer), and with ``parameters`` the
        parameters too (before a checkpoint and at the end: skipping steps cannot repair them; on a
        logging step a parameter made non-finite shows in the next loss). Then one gather of each
        rank's verdict when there are several. ``votes`` ride on that gather (a logging step's stop
        request and time limit): returned, each True when any rank voted True."""
        at = (self.step, self.progress.global_step)
        if parameters and not votes and at == self._checked_all_at:
            return []
        finite = True
        if self._slot_steps:
            # A host read at a check, never per step. A finite loss leaves its slot exactly 0, so any
            # nonzero slot (NaN is truthy) is a bad one. Read as a list, not reduced on the device: a
            # reduction run once per logging step finds its code out of the cache.
            finite = not any(self._slots.tolist())
        self._fold()
        verdicts = [torch.isfinite(v.to(self.device)).all() for v, _ in self._folded]  # device booleans
        if parameters:
            extremes = self._param_extremes()
            if extremes:
                verdicts.append(torch.isfinite(torch.stack(extremes)).all())
        if self._norms_seen:
            verdicts.append(self.first_bad_norm_step < 0)
        if verdicts and finite:
            finite = bool(torch.stack(verdicts).all()) if len(verdicts) > 1 else bool(verdicts[0])
        row = [int(finite), *(int(v) for v in votes)]
        rows = (C.all_gather(torch.tensor(row, dtype=torch.long, device=self.device)).tolist()
                if self._gathers else [row])
        if not all(r[0] for r in rows):
            self._raise_non_finite()
        self._folded.clear()  # every value was finite: the slots are all 0 again
        self._slot_steps = []
        if parameters:
            self._checked_all_at = at
        return [any(r[1 + k] for r in rows) for k in range(len(votes))]

    def _raise_non_finite(self) -> None:
        """Some rank found a non-finite value, and every rank is here: gather who found what, and raise
        the same error everywhere, naming the earliest step."""
        local = torch.tensor([self._first_bad_loss_step(), int(self.first_bad_norm_step),
                              int(self._params_bad())],
                             dtype=torch.long, device=self.device)
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
                f"non-finite parameters on rank(s) {params} after step {self.progress.global_step} "
                f"although every checked loss was finite: a NaN/inf gradient from a finite loss was "
                f"applied. Only the loss is checked per step unless gradient clipping by norm is on "
                f"(trainer.gradient_clip_val): set it to catch the exact step. Training stopped before any "
                f"later checkpoint was written"
            )
        # The first gather said some rank saw a non-finite value; its details must name one of the above.
        raise NonFiniteError(
            f"a non-finite value was found after step {self.progress.global_step} "
            f"(per-rank [first bad loss step, first bad gradient-norm step, parameters bad]: {gathered}); "
            f"training stopped before any later checkpoint was written"
        )
