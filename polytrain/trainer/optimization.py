"""One training batch, automatic or manual optimisation, in Lightning's order.

Automatic (per micro-batch): ``training_step`` runs inside a closure that ``optimizer.step`` calls
(so LBFGS-style optimizers work), then ``on_before_zero_grad``/``optimizer_zero_grad`` on the first
micro-batch of a window, then the backward hooks around ``backward``; after the closure,
``on_before_optimizer_step`` and ``configure_gradient_clipping`` see unscaled gradients; then the
update. Micro-batches that do not end a window run the closure directly, without the gradient sync. A
plain batch (``_run_plain``) has no closure; its gradients are released just before the next fetch.
Several optimizers (a polytrain extension: Lightning needs manual optimisation for that) share one
forward/backward and step in turn. The GradScaler is updated once per iteration, after every
optimizer stepped, as PyTorch's multi-optimizer AMP recipe does.

Manual: ``training_step`` alone; the module drives ``self.optimizers()`` (``StepOptimizer`` s, so
``step()`` goes through precision, hooks and step counting) and ``self.manual_backward``.

The plans (which hooks anyone overrides) are fixed when a fit starts, so the common batch costs a
handful of attribute reads beyond the work itself (benchmarks/overhead.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import heartbeat
from polytrain.core.precision import runs_closure_itself

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer


class StepOptimizer:
    """A torch optimizer whose ``step`` goes through the Trainer: precision (unscaling, skipped
    overflow steps), ``on_before_optimizer_step``, step counting. It is also an instance of the wrapped
    optimizer's class and shares its state; ``.optimizer`` is the raw one."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer) -> None:
        self.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")})
        self._optimizer = optimizer
        self._trainer = trainer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        return self._trainer._optimizer_step(self._optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"StepOptimizer({self._optimizer!r})"


def wrap_optimizer(optimizer: torch.optim.Optimizer, trainer: Trainer) -> StepOptimizer:
    cls = type(f"Step{type(optimizer).__name__}", (StepOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    StepOptimizer.__init__(wrapped, optimizer, trainer)
    return wrapped


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
        result = self.result = runner.strategy.forward_backward(self.batch, self.batch_idx, runner.accumulate,
                                                                self.zero_grad)
        self.ran = True
        runner.guard.observe(result.loss, runner.end_of_window)
        return result.loss


class AutomaticOptimization:
    """Per-fit plan of a training batch under automatic optimisation."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.strategy = trainer.strategy
        self.module = trainer.module
        self.guard = trainer.guard
        hooks = trainer.hooks
        self.optimizers = list(self.strategy.optimizers)
        self.wrapped = trainer.optimizers
        self.accumulate = trainer.config.accumulate_grad_batches
        self.clip_val = trainer.config.gradient_clip_val
        self.clip_algorithm = trainer.config.gradient_clip_algorithm
        self.before_zero_grad = hooks.batch_plan("on_before_zero_grad")
        self.before_optimizer_step = hooks.batch_plan("on_before_optimizer_step")
        self.optimizer_step_hook = self.module.optimizer_step if hooks.module_overrides("optimizer_step") else None
        self.zero_grad_hook = self.module.optimizer_zero_grad if hooks.module_overrides("optimizer_zero_grad") \
            else None
        self.clip_hook = self.module.configure_gradient_clipping \
            if hooks.module_overrides("configure_gradient_clipping") or hooks.module_overrides("clip_gradients") \
            else None
        self.closure = Closure(self)
        self.end_of_window = True
        self.epoch = 0
        self.batch_idx = 0
        # Fixed for the fit, so the common batch calls only what it needs: the heartbeat's position mark
        # when one runs, the skip vote under nan_policy "skip", the scaler's update under 16-mixed, and
        # each optimizer's step bound once (strategy verb, closure, after-closure) instead of per batch.
        self.mark_position = heartbeat.marker()
        self.votes_on_skip = self.guard.policy == "skip"
        self.update_scaler = self.strategy.precision.update if self.strategy.precision.scaler is not None else None
        self.step_closures = [self.closure] + [_rerun_guard(self.closure) for _ in self.optimizers[1:]]
        self.steps = [functools.partial(self.strategy.optimizer_step, opt, closure,
                                        functools.partial(self.after_closure, opt))
                      for opt, closure in zip(self.optimizers, self.step_closures)]
        trainer.skip_this_step = False  # only the general path's hooks, clipping and skip vote set it
        # Called by the loop before it fetches each batch; None unless the plan is plain (below).
        self.release_gradients: Callable[[], None] | None = None
        if self._is_plain():
            self.release_gradients = functools.partial(self.optimizers[0].zero_grad, set_to_none=True)
            self.run = self._run_plain  # type: ignore[method-assign]

    def _is_plain(self) -> bool:
        """One optimizer stepped on every batch with nothing between backward and the update: no hook
        around zero_grad or the step, no clipping, no skip vote, no scaler, a strategy that adds nothing
        to the step. Lightning's order needs no closure then, and the batch runs as a hand loop does."""
        return (len(self.optimizers) == 1 and self.accumulate == 1 and self.strategy.steps_plainly
                and self.optimizer_step_hook is None and self.zero_grad_hook is None and self.clip_hook is None
                and self.clip_val is None and not self.before_zero_grad and not self.before_optimizer_step
                and not self.votes_on_skip and self.update_scaler is None)

    def _zero_grad(self) -> None:
        for k, opt in enumerate(self.optimizers):
            for fn in self.before_zero_grad:
                fn(opt)
            if self.zero_grad_hook is not None:
                self.zero_grad_hook(self.epoch, self.batch_idx, self.wrapped[k])
            else:
                opt.zero_grad(set_to_none=True)

    def after_closure(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are final and unscaled: hooks, clipping, and the NaN guard's skip decision."""
        if self.mark_position is not None:
            self.mark_position("optimizer_step")
        for fn in self.before_optimizer_step:
            fn(optimizer)
        if self.clip_hook is not None:
            self.clip_hook(optimizer, gradient_clip_val=self.clip_val, gradient_clip_algorithm=self.clip_algorithm)
        elif self.clip_val is not None:
            self.trainer.clip_gradients(optimizer, self.clip_val, self.clip_algorithm or "norm")
        if self.votes_on_skip and optimizer is self.optimizers[0] and self.guard.should_skip_step():
            self.trainer.skip_this_step = True
        if self.trainer.skip_this_step:
            optimizer.zero_grad(set_to_none=True)  # no gradient, no update (and no optimizer state change)

    def _run_plain(self, batch: Any, batch_idx: int, end_of_window: bool, epoch: int) -> Any:
        """``run`` for a plain plan (``_is_plain``): training_step, backward, the update, with no closure and
        no call in between that would do nothing (with the cheaper guard check of the same pass,
        benchmarks/loop_cost.py: 39 -> 25 us added per step). The loop calls ``release_gradients`` before
        it fetches each batch: where a hand loop's zero_grad after the step lands, so the fetch reuses
        the freed memory while it is hot. Releasing them after the forward instead, as Lightning's
        closure does, cost ~10 us a step on the default benchmarks/overhead.py model (old 1.064/1.062,
        new 1.056/1.052/1.051, 21 pairs each, same hour); hooks after the step still see the gradients."""
        optimizer = self.optimizers[0]
        if not runs_closure_itself(optimizer):  # e.g. a step pre-hook registered mid-fit sees the old order
            return AutomaticOptimization.run(self, batch, batch_idx, end_of_window, epoch)
        result = self.strategy.forward_backward(batch, batch_idx, 1, None)  # released before the fetch
        self.guard.observe(result.loss, True)
        if self.mark_position is not None:
            self.mark_position("optimizer_step")
        optimizer.step()
        return result

    def run(self, batch: Any, batch_idx: int, end_of_window: bool, epoch: int) -> Any:
        """Forward/backward (and the optimizer steps when ``end_of_window``); returns the closure's result."""
        closure = self.closure
        closure.batch, closure.batch_idx, closure.ran = batch, batch_idx, False
        closure.zero_grad = self._zero_grad if batch_idx % self.accumulate == 0 else None
        self.end_of_window, self.epoch, self.batch_idx = end_of_window, epoch, batch_idx
        if not end_of_window:
            with self.strategy.no_backward_sync(True):
                closure()
            return closure.result
        self.trainer.skip_this_step = False
        if self.optimizer_step_hook is None:
            for step in self.steps:
                step()
        else:
            for k in range(len(self.steps)):
                self.optimizer_step_hook(epoch, batch_idx, self.wrapped[k], self.step_closures[k])
                if not closure.ran:
                    raise RuntimeError(
                        f"{type(self.module).__name__}.optimizer_step did not run the closure it was given: call "
                        f"optimizer.step(closure=optimizer_closure) (or optimizer_closure()) in it, or training_step "
                        f"and backward never happen")
        if self.update_scaler is not None:
            self.update_scaler()
        return closure.result


def _rerun_guard(closure: Closure) -> Callable[[], Any]:
    """For the 2nd, 3rd... optimizer: the forward/backward already ran; its loss again."""

    def again() -> Any:
        return closure.result.loss if closure.result is not None else None

    return again


class ManualOptimization:
    """Per-fit plan of a training batch under manual optimisation."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.strategy = trainer.strategy
        self.accumulate = trainer.config.accumulate_grad_batches
        self.release_gradients: Callable[[], None] | None = None  # the module zeroes its gradients itself

    def run(self, batch: Any, batch_idx: int, end_of_window: bool, epoch: int) -> Any:
        trainer = self.trainer
        trainer.accumulating = not end_of_window
        with self.strategy.no_backward_sync(not end_of_window):
            output = self.strategy.training_step(batch, batch_idx)
        self.strategy.precision.update()  # one scaler update per iteration, whatever the module stepped
        trainer.accumulating = False
        # Manual optimisation may return anything; a tensor or a dict's "loss" is watched for NaN.
        loss = output.get("loss") if isinstance(output, dict) else output
        trainer.guard.observe(loss.detach() if isinstance(loss, torch.Tensor) else None, end_of_window=True)
        return output
