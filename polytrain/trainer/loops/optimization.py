"""One training batch, automatic or manual optimisation, in Lightning's order. Which of the two runs is
chosen once per fit; each is one ``run(batch, batch_idx, end_of_window, epoch) -> (output, stepped)``.

Automatic (per micro-batch): ``training_step`` runs inside a closure that ``optimizer.step`` calls
(so LBFGS-style optimizers work), then ``on_before_zero_grad``/``optimizer_zero_grad`` on the first
micro-batch of a window, then the backward hooks around ``backward``; after the closure,
``on_before_optimizer_step`` and ``configure_gradient_clipping`` see unscaled gradients; then the
update. A module's ``optimizer_step`` hook sits between the loop and the same update
(``step_optimizer``): its ``optimizer.step(closure)`` comes back there. Micro-batches that do not end a
window run the closure directly, without the gradient sync. Several optimizers (a polytrain extension:
Lightning needs manual optimisation for that) share one forward/backward and step in turn; the
GradScaler is updated once per iteration, after every optimizer stepped (PyTorch's multi-optimizer AMP
recipe). A step the non-finite guard vetoes (``nan_policy: skip``) is not taken, and ``run`` says so.

A *plain* fit (one of torch's optimizers stepped on every batch, nothing between backward and the
update) needs no closure: its batch is a branch of ``run`` that calls training_step and backward, then
the strategy's ``optimizer_step`` without a closure (the precision's fast path: ``optimizer.step()``),
as a hand loop does; the loop releases the gradients (``release_gradients``) just before it fetches
the next batch, where a hand loop's ``zero_grad`` lands. Whether a fit is plain is decided once; the
branch still checks, per batch, that no step pre-hook was registered since (it would see the order).

Every path reaches ``optimizer.step`` in one place, ``Precision.optimizer_step``, through the
strategy's ``optimizer_step``. The profiler's rows are ``with`` blocks here: ``forward+backward`` and
``optimizer update`` (the latter less the forward and backward a closure runs inside it).

Manual: ``training_step`` alone; the module drives ``self.optimizers()`` (``StepOptimizer`` s, whose
``step()`` goes through precision, ``on_before_optimizer_step`` and step counting) and
``self.manual_backward``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from polytrain.core import heartbeat
from polytrain.core.precision import runs_closure_itself
from polytrain.trainer.api.hooks import Hooks
from polytrain.trainer.loops.guards import NonFiniteGuard

Phase = Callable[..., contextlib.AbstractContextManager]  # the profiler's: phase(row, excluding=None)


def _no_closure() -> None:
    return None


def _no_phase(row: str, excluding: str | None = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class StepOptimizer:
    """A torch optimizer whose ``step`` goes through the fit's optimisation (``step(optimizer, closure)``):
    precision (unscaling, skipped overflow steps), hooks, step counting. It is also an instance of the
    wrapped optimizer's class and shares its state; ``.optimizer`` is the raw one."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> None:
        self.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")})
        self._optimizer = optimizer
        self._step = step

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """The update, through the fit's optimisation; ``closure`` and ``kwargs`` reach the optimizer's own
        ``step`` (an LBFGS calls the closure again), as Lightning hands them on."""
        return self._step(self._optimizer, closure, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"StepOptimizer({self._optimizer!r})"


def wrap_optimizer(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> StepOptimizer:
    cls = type(f"Step{type(optimizer).__name__}", (StepOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    StepOptimizer.__init__(wrapped, optimizer, step)
    return wrapped


def clip_gradients(strategy: Any, guard: NonFiniteGuard | None, optimizer: torch.optim.Optimizer,
                   value: float, algorithm: str) -> None:
    """Clip ``optimizer``'s gradients, unscaled first; a non-finite norm is the guard's to judge (under
    ``nan_policy: skip`` it vetoes the step)."""
    if algorithm not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm={algorithm!r}; valid: norm, value")
    strategy.precision.unscale_gradients(optimizer)
    norm = strategy.clip_gradients(optimizer, value, algorithm)
    if guard is not None:
        guard.check_grad_norm(norm)


class Closure:
    """The automatic step's forward/zero-grad/backward for one micro-batch, callable by ``optimizer.step``."""

    __slots__ = ("runner", "batch", "batch_idx", "zero_grad", "result", "ran")

    def __init__(self, runner: AutomaticOptimization) -> None:
        self.runner = runner
        self.batch: Any = None
        self.batch_idx = 0
        self.zero_grad: Callable[[], None] | None = None
        self.result: Any = None
        self.ran = False

    def __call__(self) -> torch.Tensor | None:
        # The loop's heartbeat already marked this batch "training_step"; the strategy marks "backward".
        runner = self.runner
        with runner.forward_backward_phase:
            result = self.result = runner.strategy.forward_backward(self.batch, self.batch_idx,
                                                                    runner.accumulate, self.zero_grad)
        self.ran = True
        runner.guard.observe(result.loss, runner.end_of_window)
        return result.loss


class AutomaticOptimization:
    """A fit's training batch under automatic optimisation (see the module's docstring)."""

    def __init__(self, strategy: Any, module: Any, hooks: Hooks, guard: NonFiniteGuard, config: Any,
                 phase: Phase = _no_phase) -> None:
        self.strategy, self.module, self.guard = strategy, module, guard
        self.optimizers = list(strategy.optimizers)
        # The profiler's blocks, one object each for the fit (a context manager that does nothing when off).
        self.forward_backward_phase = phase("forward+backward")
        self.update_phase = phase("optimizer update", excluding="forward+backward")
        self.wrapped = [wrap_optimizer(opt, self._step_optimizer) for opt in self.optimizers]
        self.accumulate = config.accumulate_grad_batches
        self.clip_val, self.clip_algorithm = config.gradient_clip_val, config.gradient_clip_algorithm
        self.before_zero_grad = hooks.batch_plan("on_before_zero_grad")
        self.before_optimizer_step = hooks.batch_plan("on_before_optimizer_step")
        self.optimizer_step_hook = hooks.module_hook("optimizer_step")
        self.zero_grad_hook = hooks.module_hook("optimizer_zero_grad")
        self.clip_hook = hooks.module_hook("configure_gradient_clipping")
        if self.clip_hook is None and hooks.overrides("clip_gradients"):  # the default calls the override
            self.clip_hook = hooks.plan("configure_gradient_clipping")[2]
        self.closure = Closure(self)
        self.step_closures = [self.closure] + [_rerun_guard(self.closure) for _ in self.optimizers[1:]]
        self._after = {id(opt): functools.partial(self.after_closure, opt) for opt in self.optimizers}
        self.end_of_window, self.epoch, self.batch_idx = True, 0, 0
        # Fixed for the fit: the heartbeat's position mark when one runs, the scaler's update under 16-mixed.
        self.mark_position = heartbeat.marker()
        self.update_scaler = strategy.precision.update if strategy.precision.scaler is not None else None
        self.votes_on_skip = guard.policy == "skip"  # nan_policy skip: the ranks agree on every window
        # An async checkpoint may still be copying what the update changes (checkpoint_io.wait_staged).
        self.wait_staged = strategy.checkpoint_io.wait_staged
        self.plain = self._is_plain()
        # A plain fit's zero_grad, which the loop calls before it fetches each batch; None when the closure
        # zeroes the gradients (Lightning's order). The optimizer's own method: nothing in between.
        self.release_gradients: Callable[[], None] | None = (
            functools.partial(self.optimizers[0].zero_grad, set_to_none=True) if self.plain else None)

    def _is_plain(self) -> bool:
        """One optimizer stepped on every batch with nothing between backward and the update: no hook
        around zero_grad or the step, no clipping, no skip vote, no scaler, a strategy that adds nothing
        to the step. Lightning's order needs no closure then, and the batch runs as a hand loop does."""
        return (len(self.optimizers) == 1 and self.accumulate == 1 and self.strategy.steps_plainly
                and self.optimizer_step_hook is None and self.zero_grad_hook is None
                and self.clip_hook is None and self.clip_val is None
                and not self.before_zero_grad and not self.before_optimizer_step
                and not self.votes_on_skip and self.update_scaler is None)

    def run(self, batch: Any, batch_idx: int, end_of_window: bool, epoch: int) -> tuple[Any, bool]:
        """Forward/backward, and at a window's end the optimizers' steps: ``(the step's result, stepped)``."""
        if self.plain and runs_closure_itself(self.optimizers[0]):
            with self.forward_backward_phase:  # the gradients were released before the fetch
                result = self.strategy.forward_backward(batch, batch_idx, 1, None)
            self.guard.observe(result.loss, True)
            if self.mark_position is not None:
                self.mark_position("optimizer_step")
            self.wait_staged()
            with self.update_phase:
                self.strategy.optimizer_step(self.optimizers[0], None, None)  # the precision's fast path
            return result, True
        closure = self.closure
        closure.batch, closure.batch_idx, closure.ran = batch, batch_idx, False
        closure.zero_grad = self._zero_grad if batch_idx % self.accumulate == 0 else None
        self.end_of_window, self.epoch, self.batch_idx = end_of_window, epoch, batch_idx
        if not end_of_window:
            with self.strategy.no_backward_sync(True):
                closure()
            return closure.result, False
        self.guard.skip_step = False
        if self.optimizer_step_hook is None:
            for optimizer, step_closure in zip(self.optimizers, self.step_closures):
                with self.update_phase:  # what _step_optimizer does, called here: one hop less
                    self.strategy.optimizer_step(optimizer, step_closure, self._after[id(optimizer)])
        else:
            for wrapped, step_closure in zip(self.wrapped, self.step_closures):
                self.optimizer_step_hook(epoch, batch_idx, wrapped, step_closure)
                if not closure.ran:
                    raise RuntimeError(
                        f"{type(self.module).__name__}.optimizer_step did not run the closure it was given: "
                        f"call optimizer.step(closure=optimizer_closure) (or optimizer_closure()) in it, or "
                        f"training_step and backward never happen")
        if self.update_scaler is not None:
            self.update_scaler()
        return closure.result, not self.guard.skip_step

    def _step_optimizer(self, optimizer: torch.optim.Optimizer,
                        closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One optimizer's step through the strategy (precision, the after-closure hooks and clipping)."""
        with self.update_phase:
            return self.strategy.optimizer_step(optimizer, closure or _no_closure, self._after[id(optimizer)],
                                                **kwargs)

    def _zero_grad(self) -> None:
        for k, opt in enumerate(self.optimizers):
            for fn in self.before_zero_grad:
                fn(opt)
            if self.zero_grad_hook is not None:
                self.zero_grad_hook(self.epoch, self.batch_idx, self.wrapped[k])
            else:
                opt.zero_grad(set_to_none=True)

    def after_closure(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are final and unscaled: hooks, clipping, and the non-finite guard's veto."""
        if self.mark_position is not None:
            self.mark_position("optimizer_step")
        for fn in self.before_optimizer_step:
            fn(optimizer)
        if self.clip_hook is not None:
            self.clip_hook(optimizer, gradient_clip_val=self.clip_val,
                           gradient_clip_algorithm=self.clip_algorithm)
        elif self.clip_val is not None:
            clip_gradients(self.strategy, self.guard, optimizer, self.clip_val, self.clip_algorithm or "norm")
        if self.votes_on_skip and optimizer is self.optimizers[0]:
            self.guard.vote_on_skip()
        if self.guard.skip_step:
            optimizer.zero_grad(set_to_none=True)  # no gradient, no update (and no optimizer state change)
        self.wait_staged()


def _rerun_guard(closure: Closure) -> Callable[[], Any]:
    """For the 2nd, 3rd... optimizer: the forward/backward already ran; its loss again."""

    def again() -> Any:
        return closure.result.loss if closure.result is not None else None

    return again


class ManualOptimization:
    """A fit's training batch under manual optimisation: the module steps; each step counts."""

    def __init__(self, strategy: Any, hooks: Hooks, guard: NonFiniteGuard, count_step: Callable[[], None],
                 phase: Phase = _no_phase) -> None:
        self.strategy, self.hooks, self.guard = strategy, hooks, guard
        self.count_step = count_step  # the loop's step count (FitProgress.count_optimizer_step)
        self.optimizers = list(strategy.optimizers)
        self.forward_backward_phase = phase("forward+backward")
        self.update_phase = phase("optimizer update")
        self.wrapped = [wrap_optimizer(opt, self._step_optimizer) for opt in self.optimizers]
        self.release_gradients: Callable[[], None] | None = None  # the module zeroes its gradients itself
        self.accumulating = False  # this batch is not the last of its window (manual_backward skips the sync)

    def run(self, batch: Any, batch_idx: int, end_of_window: bool, epoch: int) -> tuple[Any, bool]:
        self.accumulating = not end_of_window
        try:
            with self.strategy.no_backward_sync(not end_of_window), self.forward_backward_phase:
                output = self.strategy.training_step(batch, batch_idx)
        finally:
            self.accumulating = False
        self.strategy.precision.update()  # one scaler update per iteration, whatever the module stepped
        # Manual optimisation may return anything; a tensor or a dict's "loss" is watched for NaN.
        loss = output.get("loss") if isinstance(output, dict) else output
        self.guard.observe(loss.detach() if isinstance(loss, torch.Tensor) else None, end_of_window=True)
        return output, False  # steps were counted as the module took them

    def _step_optimizer(self, optimizer: torch.optim.Optimizer,
                        closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        with self.update_phase:
            result = self.strategy.optimizer_step(optimizer, closure or _no_closure,
                                                  functools.partial(self._before_update, optimizer), **kwargs)
        self.count_step()  # manual optimisation counts every optimizer.step(), as Lightning
        return result

    def _before_update(self, optimizer: torch.optim.Optimizer) -> None:
        self.hooks("on_before_optimizer_step", optimizer)
        self.strategy.checkpoint_io.wait_staged()  # an async checkpoint may still be copying the weights
