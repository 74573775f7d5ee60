"""One training batch, automatic or manual optimisation, in Lightning's order. Which of the two runs is
chosen once per fit.

Automatic: the strategy's executor runs the step (``strategies/train_step.py``: forward, backward, the
hooks, clipping, ``optimizer.step()``), bound once per fit to a ``StepPlan`` built here from the Trainer's
hook funnel: the hooks someone overrides (callbacks', then the module's), clipping, the non-finite guard.
A module's ``optimizer_step`` hook receives each optimizer wrapped as a ``StepOptimizer``: its
``optimizer.step(closure)`` comes back to the executor's update. Several optimizers (a polytrain
extension: Lightning needs manual optimisation for that) share one forward/backward and step in turn. A
step the non-finite guard vetoes (``nan_policy: skip``) is not taken, and the step says so.

Manual: ``training_step`` alone; the module drives ``self.optimizers()`` (``StepOptimizer`` s, whose
``step()`` goes through the executor's update: precision, ``on_before_optimizer_step``) and
``self.manual_backward``; every step counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from polytrain.strategies.train_step import StepPlan
from polytrain.trainer.api.hooks import Hooks
from polytrain.trainer.loops.guards import NonFiniteGuard

Phase = Callable[..., contextlib.AbstractContextManager]  # the profiler's: phase(row, excluding=None)


def _no_phase(row: str, excluding: str | None = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class StepOptimizer:
    """A torch optimizer whose ``step`` goes through the fit's optimisation (``step(optimizer, closure)``):
    precision (unscaling, skipped overflow steps), hooks, step counting. It is also an instance of the
    wrapped optimizer's class; ``.optimizer`` is the raw one.

    Every other attribute is the raw optimizer's, read and written through to it, not copied (what the
    wrapper defines, such as ``step``, stays its own when set: an LR scheduler built on it wraps its
    ``step``, not the raw one the update calls, which would come back here): loading a
    state dict (a resume, or a checkpoint of an optimizer without state) gives the raw optimizer new
    ``param_groups``, and a learning rate set through the wrapper (a hand-written warmup) must reach the
    groups the update and the schedulers use."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> None:
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_step", step)

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper itself lacks
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in StepOptimizer.__dict__:  # the wrapper's own (an LR scheduler built on it patches `step`)
            object.__setattr__(self, name, value)
        else:
            setattr(self._optimizer, name, value)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """The update, through the fit's optimisation; ``closure`` and ``kwargs`` reach the optimizer's own
        ``step`` (an LBFGS calls the closure again), as Lightning hands them on."""
        return self._step(self._optimizer, closure, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"StepOptimizer({self._optimizer!r})"


def wrap_optimizer(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> StepOptimizer:
    cls = type(f"Step{type(optimizer).__name__}", (StepOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    StepOptimizer.__init__(wrapped, optimizer, step)
    return wrapped


def clip_gradients(strategy: Any, guard: NonFiniteGuard | None, optimizer: torch.optim.Optimizer,
                   value: float, algorithm: str) -> None:
    """``TrainModule.clip_gradients``: the strategy clips (unscaled first); a non-finite norm is the guard's
    to judge (under ``nan_policy: skip`` it vetoes the step)."""
    norm = strategy.clip_gradients(optimizer, value, algorithm)
    if guard is not None:
        guard.check_grad_norm(norm)


class AutomaticOptimization:
    """A fit's training batch under automatic optimisation: ``run`` is the strategy's executor's
    ``train_step``, bound to this fit's ``StepPlan`` (see the module's docstring)."""

    def __init__(self, strategy: Any, module: Any, hooks: Hooks, guard: NonFiniteGuard, config: Any,
                 phase: Phase = _no_phase) -> None:
        self.optimizers = list(strategy.optimizers)
        self.wrapped = [wrap_optimizer(opt, strategy.optimizer_step) for opt in self.optimizers]
        clip_hook = hooks.module_hook("configure_gradient_clipping")
        if clip_hook is None and hooks.overrides("clip_gradients"):  # the default calls the override
            clip_hook = hooks.plan("configure_gradient_clipping")[2]
        plan = StepPlan(
            self.optimizers, guard, accumulate=config.accumulate_grad_batches, wrapped=self.wrapped,
            before_zero_grad=hooks.batch_plan("on_before_zero_grad"),
            zero_grad_hook=hooks.module_hook("optimizer_zero_grad"),
            before_backward=hooks.batch_plan("on_before_backward"),
            after_backward=hooks.batch_plan("on_after_backward"),
            module_backward=hooks.module_hook("backward"),
            before_optimizer_step=hooks.batch_plan("on_before_optimizer_step"),
            clip_hook=clip_hook, clip_val=config.gradient_clip_val,
            clip_algorithm=config.gradient_clip_algorithm,
            optimizer_step_hook=hooks.module_hook("optimizer_step"), votes_on_skip=guard.policy == "skip",
            wait_staged=strategy.checkpoint_io.wait_staged, phase=phase)
        # run(batch, batch_idx, epoch, end_of_window) -> (the step's result, stepped)
        self.run: Callable[[Any, int, int, bool], tuple[Any, bool]] = strategy.bind_step(plan)


class ManualOptimization:
    """A fit's training batch under manual optimisation: the module steps; each step counts."""

    def __init__(self, strategy: Any, hooks: Hooks, guard: NonFiniteGuard, count_step: Callable[[], None],
                 phase: Phase = _no_phase) -> None:
        self.strategy, self.guard = strategy, guard
        self.count_step = count_step  # the loop's step count (FitProgress.count_optimizer_step)
        self.optimizers = list(strategy.optimizers)
        self.forward_backward_phase = phase("forward+backward")
        self.update_phase = phase("optimizer update")
        self.wrapped = [wrap_optimizer(opt, self._step_optimizer) for opt in self.optimizers]
        # The executor's update and the module's manual_backward read the hooks from the plan.
        strategy.bind_step(StepPlan(
            self.optimizers, guard, wrapped=self.wrapped,
            before_backward=hooks.batch_plan("on_before_backward"),
            after_backward=hooks.batch_plan("on_after_backward"),
            module_backward=hooks.module_hook("backward"),
            before_optimizer_step=hooks.batch_plan("on_before_optimizer_step"),
            wait_staged=strategy.checkpoint_io.wait_staged, phase=phase))
        self.accumulating = False  # this batch is not the last of its window (manual_backward skips the sync)

    def run(self, batch: Any, batch_idx: int, epoch: int, end_of_window: bool) -> tuple[Any, bool]:
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
            result = self.strategy.optimizer_step(optimizer, closure, **kwargs)
        self.count_step()  # manual optimisation counts every optimizer.step(), as Lightning
        return result
