"""How a composed strategy's gradients meet across data-parallel ranks: one small object, chosen once
(``backend_for``) from the layout's ``data_parallel`` mode, answering the verbs that differ.

- ``NoDataParallel``: one replica (or ``single`` started several times): nothing meets.
- ``DDPBackend``: DDP's wrapper around the step's router; its reducer all-reduces during backward.
- ``FSDPBackend``: FSDP2/HSDP (``parallel.apply`` shards the parameters): every forward gathers them,
  so evaluation pads ranks to equal batch counts, and clipping by norm reduces sharded norms.
- ``AllReduceBackend``: pipeline stages outside any wrapper: the pipeline runner averages the
  gradients itself after each step (and holds them back inside an accumulation window).

Verbs: ``wrap`` (the model the step runs through), ``no_sync`` (a micro-batch that does not end a
window), ``clip_norm`` (None: the strategy's plain clipping applies), ``manual_step`` /
``prepare_manual_backward`` (manual optimisation), ``padding`` (evaluation padding state, or None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from polytrain.data.padding import PaddingState
from polytrain.parallel.ddp_wrapping import (
    ddp_kwargs,
    forward_without_reducer,
    naming_unused_parameters,
    prepare_manual_backward,
    sync_buffers_for_evaluation,
)
from polytrain.parallel.fully_shard import clip_sharded_grad_norm, no_gradient_sync


class NoDataParallel:
    name = "none"
    shards = False  # parameters are DTensors sharded over the data-parallel ranks
    broadcasts_weights = True  # rank 0's initial weights are sent to the others by the strategy (DDP: by DDP)
    padding: PaddingState | None = None  # evaluation forwards gather over the data ranks: pad to equal counts

    def wrap(self, router: nn.Module, device: torch.device) -> nn.Module:
        return router

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def clip_norm(self, optimizer: torch.optim.Optimizer, value: float) -> torch.Tensor | None:
        return None

    def manual_step(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prepare_manual_backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        return None

    def prepare_evaluation(self, model: nn.Module) -> None:
        return None

    def checked_step(self, step: Callable[..., Any], model: nn.Module) -> Callable[..., Any]:
        """The training step as the backend runs it (its errors explained where the backend can)."""
        return step


class DDPBackend(NoDataParallel):
    name = "ddp"
    broadcasts_weights = False

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def wrap(self, router: nn.Module, device: torch.device) -> nn.Module:
        return DistributedDataParallel(router, **ddp_kwargs(self.options, device))

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()

    def manual_step(self, model: nn.Module) -> contextlib.AbstractContextManager:
        # Manual optimisation: DDP's reducer is readied before each manual_backward, never by its forward.
        return forward_without_reducer(model)

    def prepare_manual_backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        prepare_manual_backward(model, loss)

    def prepare_evaluation(self, model: nn.Module) -> None:
        sync_buffers_for_evaluation(model)

    def checked_step(self, step: Callable[..., Any], model: nn.Module) -> Callable[..., Any]:
        return naming_unused_parameters(step, model)


class FSDPBackend(NoDataParallel):
    name = "fsdp"
    shards = True

    def __init__(self) -> None:
        self.padding = PaddingState()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return no_gradient_sync(model)

    def clip_norm(self, optimizer: torch.optim.Optimizer, value: float) -> torch.Tensor | None:
        return clip_sharded_grad_norm(optimizer, value)


class AllReduceBackend(NoDataParallel):
    name = "all_reduce"


def backend_for(mode: str, ddp_options: dict[str, Any]) -> NoDataParallel:
    """The backend of ``parallel.apply.data_parallel_mode``'s answer."""
    if mode == "ddp":
        return DDPBackend(ddp_options)
    if mode == "fsdp":
        return FSDPBackend()
    return AllReduceBackend() if mode == "all_reduce" else NoDataParallel()
