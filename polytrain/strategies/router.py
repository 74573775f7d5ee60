"""What a strategy's step hands around: the router a wrapper (DDP, DataParallel) runs the user's step
through, the result of one micro-batch, and the marker of an evaluation batch run only for padding."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polytrain.core.errors import ConfigError


class _PaddingBatch:
    """What ``eval_step`` returns for a padding batch: one a rank ran only so that collectives in
    the forward stay matched (sharded strategies). The loops drop it: no callback sees it, no
    prediction holds it."""

    def __repr__(self) -> str:
        return "PADDING_BATCH"


PADDING_BATCH = _PaddingBatch()


@dataclass(slots=True)
class StepResult:
    """What one micro-batch's forward/backward produced: the detached loss and the user's output."""

    loss: torch.Tensor | None
    output: Any


@functools.lru_cache(maxsize=512)
def _takes_batch_idx(fn: Callable[..., Any], bound: bool) -> bool:
    """Lightning's rule: a step gets ``batch_idx`` when it names it, takes ``*args``, or has a second
    positional parameter (``def training_step(self, batch)`` gets the batch only)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    params = params[1:] if bound else params
    if any(p.name == "batch_idx" or p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2


def _takes_iterator(fn: Callable[..., Any]) -> bool:
    try:
        return "dataloader_iter" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def step_args(batch: Any, batch_idx: int, dataloader_idx: int | None) -> tuple[Any, ...]:
    """An evaluation step's arguments, as Lightning passes them: ``dataloader_idx`` only where a stage reads
    several loaders."""
    return (batch, batch_idx) if dataloader_idx is None else (batch, batch_idx, dataloader_idx)


def user_step(module: Any, name: str) -> Callable[..., Any]:
    """``module.<name>`` to be called as ``(batch, batch_idx, ...)``: the method itself, or, for a step
    declared without ``batch_idx``, a call that leaves it out."""
    method = getattr(module, name)
    func = getattr(method, "__func__", method)
    if _takes_iterator(func):
        raise ConfigError(f"{type(module).__name__}.{name}(dataloader_iter): a step that draws its batches "
                          f"from the iterator (Lightning's experimental form) is not offered; declare it as "
                          f"{name}(self, batch, batch_idx) and the loop hands it each batch")
    if _takes_batch_idx(func, func is not method):
        return method
    return functools.wraps(method)(
        lambda batch, batch_idx=None, *rest, **kwargs: method(batch, *rest, **kwargs))


class StepRouter(nn.Module):
    """Lets a wrapper (DDP, DataParallel) call ``training_step`` as its forward.

    DDP only sees gradients of the forward it ran, so the user's step must go through the
    wrapper's ``forward``; this module routes ``forward(name, *args)`` to ``module.<name>(*args)``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        # Called after the routed method returns, still inside the wrapper's forward (DDP under
        # manual optimisation: see parallel.ddp_wrapping.forward_without_reducer).
        self.__dict__["after_method"] = None
        self.__dict__["steps"] = {}

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # _modules directly: `self.module` goes through nn.Module.__getattr__ after a failed normal
        # lookup (an AttributeError built and dropped) on every step.
        steps = self.__dict__["steps"]  # name -> the step as called; resolved once, not per call
        step = steps.get(method)
        if step is None:
            step = steps[method] = user_step(self._modules["module"], method)
        result = step(*args, **kwargs)
        after = self.__dict__["after_method"]
        if after is not None:
            after()
        return result
