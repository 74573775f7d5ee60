"""The training step, written once. Each executor (``WholeModel``, ``PipelineRunner``) is a ``StepExecutor``:
it brings its ``forward_backward``, and runs this class's ``train_step`` for every batch:

    train_step(batch, batch_idx, epoch, end_of_window)
        forward_backward     the executor's own: the user's training_step, zero_grad on a window's first
                             micro-batch (Lightning's place: after the step, before backward),
                             on_before_backward, backward, on_after_backward. A pipeline's runs its
                             schedule over the micro-batches instead (pipeline_runner.py says how).
        the non-finite guard sees the loss
        (a micro-batch inside an accumulation window stops here: no gradient sync, no update)
        for each optimizer: update
            finish_gradients   tensor-parallel partial gradients summed, unscaled (16-mixed),
                               on_before_optimizer_step, clipping, the nan_policy skip vote
            optimizer.step()   (GradScaler.step under 16-mixed: Precision.step)
        the GradScaler's update, once for every optimizer (PyTorch's multi-optimizer AMP recipe)

What the Trainer contributes (the hooks that someone overrides, clipping, the guard) comes as a
``StepPlan`` when a fit starts, fixed for the fit: a hook nobody overrides is absent from its list, so the
common step loops over nothing. The scheduler steps, batch fetching and moving stay with the epoch loop.

A closure exists only where something needs one, decided once per fit (``closure_needed``): an optimizer
that is not one of torch's closure-first ones (LBFGS calls the closure again for each line-search step; a
user's SAM calls it twice), or a module overriding ``optimizer_step`` (its ``optimizer.step(closure=...)``
comes back to ``update`` through the ``StepOptimizer`` the hook receives). The closure runs the same
``forward_backward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from polytrain.core import heartbeat
from polytrain.core.precision import calls_closure_first
from polytrain.core.rank_zero import rank_zero_warn
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.strategies.router import StepResult


def _no_phase(row: str, excluding: str | None = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _nothing() -> None:
    return None


@dataclass(slots=True)
class StepPlan:
    """A fit's step as the Trainer fixes it: the optimizers, the hooks someone overrides (callbacks', then
    the module's; each list empty when nobody does), clipping and the non-finite guard."""

    optimizers: list[torch.optim.Optimizer]
    guard: Any  # the non-finite guard: observe(loss, end_of_window), vote_on_skip(), check_grad_norm(norm)
    accumulate: int = 1
    # what hooks that take an optimizer receive (each optimizer wrapped: its step() comes back to update)
    wrapped: list[Any] = field(default_factory=list)
    before_zero_grad: list[Callable[[Any], None]] = field(default_factory=list)
    # the module's optimizer_zero_grad(epoch, batch_idx, optimizer), if overridden
    zero_grad_hook: Callable[[int, int, Any], None] | None = None
    before_backward: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    after_backward: list[Callable[[], None]] = field(default_factory=list)
    module_backward: Callable[..., None] | None = None  # the module's own backward(loss), if overridden
    before_optimizer_step: list[Callable[[Any], None]] = field(default_factory=list)
    clip_hook: Callable[..., None] | None = None  # configure_gradient_clipping(opt, gradient_clip_val=, ...)
    clip_val: float | None = None
    clip_algorithm: str | None = None
    optimizer_step_hook: Callable[..., None] | None = None  # optimizer_step(epoch, batch_idx, opt, closure)
    votes_on_skip: bool = False  # nan_policy skip: the ranks agree on every window whether to step
    wait_staged: Callable[[], None] = _nothing  # an async checkpoint may still be copying the weights
    phase: Callable[..., contextlib.AbstractContextManager] = _no_phase  # the profiler's blocks


class Closure:
    """``forward_backward`` of one batch for an optimizer's ``step(closure)``: the first optimizer's runs it
    on each call (LBFGS re-evaluates); a later optimizer's gives the loss already computed (several
    optimizers share one forward and backward)."""

    __slots__ = ("executor", "batch", "batch_idx", "epoch", "result", "ran")

    def __init__(self, executor: StepExecutor, batch: Any, batch_idx: int, epoch: int) -> None:
        self.executor, self.batch, self.batch_idx, self.epoch = executor, batch, batch_idx, epoch
        self.result: StepResult | None = None
        self.ran = False

    def __call__(self) -> torch.Tensor | None:
        executor = self.executor
        with executor.forward_backward_phase:
            result = self.result = executor.forward_backward(self.batch, self.batch_idx, self.epoch)
        self.ran = True
        executor.plan.guard.observe(result.loss, True)
        return result.loss

    def again(self) -> torch.Tensor | None:
        return self.result.loss if self.result is not None else None


class StepExecutor:
    """``train_step`` and what it shares between executors; a subclass writes ``forward_backward``."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.plan = StepPlan([], None)
        self.said_batch_skipped = False  # a training_step returned None: said once, then such batches skip

    def bind(self, plan: StepPlan) -> None:
        """Fix the fit's step (the model is wrapped by now): the plan, and what follows from it once."""
        self.plan = plan
        precision = self.strategy.precision
        self.precision = precision
        self.closure_needed = (plan.optimizer_step_hook is not None
                               or not all(calls_closure_first(opt) for opt in plan.optimizers))
        # loss.backward() itself when neither a GradScaler nor the module's own backward sits in between
        self.backward: Callable[[torch.Tensor], None] = (
            torch.Tensor.backward if precision.scaler is None and plan.module_backward is None
            else self.scaled_backward)
        self.update_scaler = precision.update if precision.scaler is not None else None
        self.reduces_partial_grads = bool(getattr(self.strategy, "tensor_parallel", False))
        self.mark_position = heartbeat.marker()  # the heartbeat's position marks, when one runs
        phase = plan.phase
        self.step_phase = phase("training_step")
        self.backward_phase = phase("backward")
        self.forward_backward_phase = phase("forward+backward")
        self.update_phase = phase("optimizer update", excluding="forward+backward")

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: Any, batch_idx: int, epoch: int,
                   end_of_window: bool) -> tuple[StepResult, bool]:
        """One training batch: ``(what forward_backward gave, whether the optimizers stepped)``."""
        plan = self.plan
        if not end_of_window:  # inside an accumulation window: gradients accumulate locally, no update
            with self.no_sync(), self.forward_backward_phase:
                result = self.forward_backward(batch, batch_idx, epoch)
            plan.guard.observe(result.loss, False)
            return result, False
        plan.guard.skip_step = False
        if self.closure_needed:
            return self.train_step_through_closures(batch, batch_idx, epoch)
        with self.forward_backward_phase:
            result = self.forward_backward(batch, batch_idx, epoch)
        plan.guard.observe(result.loss, True)
        with self.update_phase:
            for optimizer in plan.optimizers:
                self.update(optimizer)
        if self.update_scaler is not None:
            self.update_scaler()
        return result, not plan.guard.skip_step

    def train_step_through_closures(self, batch: Any, batch_idx: int, epoch: int) -> tuple[StepResult, bool]:
        """``train_step``'s end of a window when an optimizer or the module's ``optimizer_step`` takes a
        closure: each optimizer's step is handed ``forward_backward`` to run."""
        plan = self.plan
        closure = Closure(self, batch, batch_idx, epoch)
        for k, optimizer in enumerate(plan.optimizers):
            step_closure = closure if k == 0 else closure.again
            with self.update_phase:
                if plan.optimizer_step_hook is None:
                    self.update(optimizer, step_closure)
                else:
                    plan.optimizer_step_hook(epoch, batch_idx, plan.wrapped[k], step_closure)
            if not closure.ran:
                module = type(self.strategy.module).__name__
                raise RuntimeError(
                    f"{module}.optimizer_step did not run the closure it was given: call "
                    f"optimizer.step(closure=optimizer_closure) (or optimizer_closure()) in it, or "
                    f"training_step and backward never happen")
        if self.update_scaler is not None:
            self.update_scaler()
        return closure.result, not plan.guard.skip_step

    def forward_backward(self, batch: Any, batch_idx: int, epoch: int) -> StepResult:
        """One micro-batch's forward and backward with the hooks around them: the executor's own."""
        raise NotImplementedError

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A micro-batch inside an accumulation window: its gradients stay local (nothing to skip here)."""
        return contextlib.nullcontext()

    def zero_grad(self, epoch: int, batch_idx: int) -> None:
        """A window's first micro-batch: on_before_zero_grad, then the module's optimizer_zero_grad or
        ``zero_grad(set_to_none=True)``, for each optimizer."""
        plan = self.plan
        for k, optimizer in enumerate(plan.optimizers):
            for hook in plan.before_zero_grad:
                hook(optimizer)
            if plan.zero_grad_hook is not None:
                plan.zero_grad_hook(epoch, batch_idx, plan.wrapped[k])
            else:
                optimizer.zero_grad(set_to_none=True)

    def scaled_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The loss scaled (16-mixed), then the module's ``backward`` (``loss.backward()`` by default)."""
        loss = self.precision.scale_loss(loss)
        module_backward = self.plan.module_backward
        if module_backward is not None:
            module_backward(loss, *args, **kwargs)
        else:
            loss.backward(*args, **kwargs)

    def batch_skipped(self, batch_idx: int, output: Any) -> StepResult:
        """The user's step returned no loss: Lightning skips such a batch (no backward, no update). Said once
        on rank 0: a step that always returns None would otherwise train nothing unsaid."""
        if not self.said_batch_skipped:
            self.said_batch_skipped = True
            rank_zero_warn(f"training_step returned None for batch {batch_idx}: that batch is skipped (no "
                           f"backward, no optimizer step), as Lightning does; said once. Return the loss (or "
                           f"a dict with 'loss') from training_step to train on it")
        return StepResult(None, output)

    # ------------------------------------------------------------------ the update
    def update(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None,
               **kwargs: Any) -> Any:
        """One optimizer's update once its gradients are final. With a ``closure`` (see the module's
        docstring; manual optimisation's ``opt.step(closure)`` too) the optimizer runs it, and what follows
        backward runs inside it; a GradScaler cannot hand a closure on, so then it runs first. ``kwargs``
        reach the optimizer's own ``step``."""
        if closure is not None and self.precision.scaler is None:

            def closure_then_finish() -> Any:
                loss = closure()
                self.finish_gradients(optimizer)
                return loss

            return optimizer.step(closure=closure_then_finish, **kwargs)
        result = closure() if closure is not None else None
        self.finish_gradients(optimizer)
        self.precision.step(optimizer, **kwargs)
        return result

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients as the update and the hooks must see them: summed where tensor parallel left them
        partial, unscaled; then on_before_optimizer_step, clipping and the non-finite veto."""
        plan = self.plan
        if self.mark_position is not None:
            self.mark_position("optimizer_step")
        self.precision.unscale_gradients(optimizer)
        if self.reduces_partial_grads:  # sequence parallel's partial gradients, summed once before the hooks
            tp_fn.reduce_partial_grads([p for group in optimizer.param_groups for p in group["params"]])
        for hook in plan.before_optimizer_step:
            hook(optimizer)
        if plan.clip_hook is not None:
            plan.clip_hook(optimizer, gradient_clip_val=plan.clip_val,
                           gradient_clip_algorithm=plan.clip_algorithm)
        elif plan.clip_val is not None:
            norm = self.clip_gradients(optimizer, plan.clip_val, plan.clip_algorithm or "norm")
            plan.guard.check_grad_norm(norm)
        if plan.votes_on_skip and optimizer is plan.optimizers[0]:
            plan.guard.vote_on_skip()
        if plan.guard.skip_step:
            optimizer.zero_grad(set_to_none=True)  # no gradient, no update (and no optimizer state change)
        plan.wait_staged()

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float,
                       algorithm: str) -> torch.Tensor | None:
        """Clip ``optimizer``'s gradients (unscaled first): the total norm when clipping by norm. By value
        is elementwise, so shards need nothing; by norm, an executor whose gradients are spread over ranks
        reduces the norm (``clip_norm``)."""
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}; valid: norm, value")
        self.precision.unscale_gradients(optimizer)
        clip_norm = self.clip_norm
        if algorithm == "norm" and clip_norm is not None:
            return clip_norm(optimizer, value)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, value)
            return None
        return torch.nn.utils.clip_grad_norm_(params, value)

    # by norm over ranks: set by an executor whose gradients are sharded (FSDP, tensor parallel, stages)
    clip_norm: Callable[[torch.optim.Optimizer, float], torch.Tensor | None] | None = None
