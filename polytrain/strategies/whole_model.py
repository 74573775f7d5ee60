"""The executor of a strategy without a pipeline: every rank runs every layer.

Every strategy starts with this one; the composed strategy (``ParallelStrategy``) swaps in the
``PipelineRunner`` (``strategies/pipeline_runner.py``) when it sets up its environment with ``pp > 1``.
Both are ``StepExecutor``s (``strategies/train_step.py``: the one ``train_step``) and answer the same
questions (where the model is cut and what is parallelised, which rank logs, a micro-batch's forward and
backward, an evaluation step, a micro-batch without gradient sync, clipping by norm, the model's state
dict), so the strategy itself keeps options and composition and asks its executor the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polytrain.checkpoint.state import full_model_state
from polytrain.core.protocol import extract_loss
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.strategies.router import StepResult, step_args
from polytrain.strategies.sharded_eval import padded_eval_step
from polytrain.strategies.train_step import StepExecutor, StepPlan


class WholeModel(StepExecutor):
    """No pipeline: the model is one piece (the step router is what gets parallelised), its loss is on
    every rank. What the data-parallel backend changes (the no-sync context, clipping by norm, the
    evaluation step) is fixed in ``build`` once the composed strategy has wrapped the model."""

    is_last_stage = True

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.built = False
        self.eval_step: Callable[..., Any] | None = None  # None: the strategy's own
        self.prepare_evaluation: Callable[[], None] = _nothing
        self.user_step: Callable[[Any, int], Any] | None = None

    def is_logging_rank(self) -> bool:
        return self.strategy.is_global_zero

    # ------------------------------------------------------------------ the model
    def check_module(self, module: nn.Module) -> None:
        """Any module: nothing is cut."""

    def cut_model(self, module: nn.Module, plan: dict[str, Any] | None, is_global_zero: bool
            ) -> tuple[dict[str, Any] | None, Any]:
        """``(the tensor-parallel plan, the activation-checkpointed blocks)``: the plan as the module
        gives it, and the blocks chosen later, on what is parallelised."""
        return plan, None

    def roots(self, router: nn.Module) -> list[nn.Module]:
        """What ``parallel.apply`` parallelises: the router around the whole module."""
        return [router]

    def build(self, module: nn.Module, device: torch.device) -> None:
        """The composed strategy's verbs, fixed once the model is wrapped: the backend's no-sync context
        and evaluation preparation, the evaluation step, and clipping by norm."""
        s = self.strategy
        backend, model = s.backend, s.model
        self.built = True
        self.no_sync = lambda: backend.no_sync(model)
        self.prepare_evaluation = lambda: backend.prepare_evaluation(model)
        if backend.padding is not None:
            # Through the sharded root (its forward gathers parameters): every rank runs as many
            # evaluation forwards as the others (process_dataloader's EvalBatches).
            padding = backend.padding
            self.eval_step = lambda *args: padded_eval_step(s, padding, *args)
        elif s.tensor_parallel:
            self.eval_step = self._routed_eval_step
        if s.tensor_parallel:
            self.clip_norm = self._clip_norm_over_tp
        elif backend.shards:
            self.clip_norm = backend.clip_norm

    def new_optimizers(self) -> None:
        """A fit configured its optimizers: nothing to check across stages."""

    # ------------------------------------------------------------------ data and step
    def check_train_loader(self, loader: Any) -> None:
        """Any batch size: a batch is not split into micro-batches."""

    def check_manual_optimisation(self) -> None:
        """Manual optimisation runs the user's step as it is."""

    def bind(self, plan: StepPlan) -> None:
        super().bind(plan)
        strategy = self.strategy
        self.user_step = strategy.training_step_function()
        if not self.built:  # a strategy of its own (dp, layers): its no-sync context
            self.no_sync = lambda: strategy.no_backward_sync(True)

    def forward_backward(self, batch: Any, batch_idx: int, epoch: int) -> StepResult:
        """One micro-batch, in Lightning's order: the user's ``training_step``, zero_grad on a window's
        first micro-batch, on_before_backward, backward of the loss divided by the window's length,
        on_after_backward."""
        plan = self.plan
        with self.step_phase:
            output = self.user_step(batch, batch_idx)
        if self.mark_position is not None:
            self.mark_position("backward")  # past the user's step: a peer stuck inside it is now behind
        loss = output if type(output) is torch.Tensor else extract_loss(output)
        if batch_idx % plan.accumulate == 0:
            self.zero_grad(epoch, batch_idx)
        if loss is None:
            return self.batch_skipped(batch_idx, output)
        if plan.accumulate != 1:
            loss = loss / plan.accumulate  # a division, as a hand loop writes it (bitwise the same)
        for hook in plan.before_backward:
            hook(loss)
        with self.backward_phase:
            self.backward(loss)
        for hook in plan.after_backward:
            hook()
        return StepResult(loss.detach(), output)

    def run_user_step(self, batch: Any, batch_idx: int) -> Any:
        """Manual optimisation's step: the user's ``training_step`` alone."""
        with self.step_phase:
            return self.user_step(batch, batch_idx)

    def _routed_eval_step(self, stage: str, batch: Any, batch_idx: int,
                          dataloader_idx: int | None = None) -> Any:
        # Tensor parallel: through the router (no collectives of its own): its hook makes the replicated
        # parameters local views for the whole step, as in training.
        s = self.strategy
        with s.precision.forward_context():
            return s.model(f"{stage}_step", *step_args(batch, batch_idx, dataloader_idx))

    def _clip_norm_over_tp(self, optimizer: torch.optim.Optimizer, value: float) -> torch.Tensor:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        tp_fn.reduce_partial_grads(params)  # idempotent: clipping by hand under manual optimisation
        return tp_fn.clip_grad_norm(params, value)

    # ------------------------------------------------------------------ checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        """The full model on rank 0 when parameters are DTensors (a collective), else the module's own."""
        s = self.strategy
        return full_model_state(s.module) if s.gathers_state else s.module.state_dict()


def _nothing() -> None:
    return None

