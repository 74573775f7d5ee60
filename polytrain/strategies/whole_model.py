"""The executor of a composed strategy without a pipeline: every rank runs every layer.

``ParallelStrategy`` chooses its executor once, when it sets up its environment: this one, or the
``PipelineRunner`` (``strategies/pipeline_runner.py``) when ``pp > 1``. Both answer the same questions
(where the model is cut and what is parallelised, which rank logs, how a micro-batch's forward and
backward, an evaluation step, a micro-batch without gradient sync, clipping by norm and the model's
state dict run), so the strategy itself keeps options and composition and asks its executor the rest.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from polytrain.checkpoint.state import full_model_state
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.strategies.base import Strategy
from polytrain.strategies.router import StepResult, step_args
from polytrain.strategies.sharded_eval import padded_eval_step

if TYPE_CHECKING:
    from polytrain.strategies.parallel import ParallelStrategy


class WholeModel:
    """No pipeline: the model is one piece (the step router is what gets parallelised), its loss is on
    every rank, and what runs per step is the data-parallel backend's, chosen in ``build``."""

    is_last_stage = True

    def __init__(self, strategy: ParallelStrategy) -> None:
        self.strategy = strategy
        self.clip_norm: Callable[[torch.optim.Optimizer, float], torch.Tensor | None] | None = None
        self.eval_step: Callable[..., Any] = functools.partial(Strategy.eval_step, strategy)
        self.no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.prepare_evaluation: Callable[[], None] = _nothing

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
        """The step verbs, fixed once the model is wrapped: the backend's no-sync context and evaluation
        preparation, the evaluation step, and clipping by norm."""
        s = self.strategy
        backend = s.backend
        self.no_sync = functools.partial(backend.no_sync, s.model)
        self.prepare_evaluation = functools.partial(backend.prepare_evaluation, s.model)
        if backend.padding is not None:
            # Through the sharded root (its forward gathers parameters): every rank runs as many
            # evaluation forwards as the others (process_dataloader's EvalBatches).
            self.eval_step = functools.partial(padded_eval_step, s, backend.padding)
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

    def forward_backward(self, batch: Any, batch_idx: int, accumulate: int,
                         zero_grad: Callable[[], None] | None) -> StepResult:
        return Strategy.forward_backward(self.strategy, batch, batch_idx, accumulate, zero_grad)

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
