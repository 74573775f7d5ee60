"""Precision plugins, composed into a strategy: autocast, loss scaling, module/input casting."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as _torch_optimizer

from polytrain.core.errors import ConfigError


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, (list, tuple)):
        cast = [_cast_floats(x, dtype) for x in data]
        return type(data)(*cast) if hasattr(data, "_fields") else type(data)(cast)
    if isinstance(data, dict):
        return {k: _cast_floats(v, dtype) for k, v in data.items()}
    return data


def _has_grads(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _closure_first_optimizers() -> frozenset[type]:
    """torch's own optimizers whose ``step(closure)`` calls the closure exactly once, first, with
    gradients enabled, and then updates: every one but LBFGS (which calls it again per line-search
    iteration). Exact types only: a subclass may use the closure its own way."""
    classes = (getattr(torch.optim, name, None) for name in getattr(torch.optim, "__all__", ()))
    return frozenset(c for c in classes if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
                     and c not in (torch.optim.Optimizer, torch.optim.LBFGS))


_CLOSURE_FIRST = _closure_first_optimizers()


# One dict, filled in place by torch.optim.optimizer.register_optimizer_step_pre_hook. Without it (a
# torch that renamed it) nothing can tell whether such a hook exists, so every optimizer gets the closure.
_GLOBAL_STEP_PRE_HOOKS = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {None: None})


def calls_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether running the closure before ``optimizer.step()`` is what ``optimizer.step(closure)`` does: one
    of torch's own optimizers but LBFGS, with no step pre-hook (its own or global) that would see the
    order change (Lightning runs such a hook before training_step). The training step then needs no
    closure for it. Asked when a fit starts: a hook registered during the fit runs after backward, as in a
    hand-written loop."""
    return (type(optimizer) in _CLOSURE_FIRST and not getattr(optimizer, "_optimizer_step_pre_hooks", True)
            and not _GLOBAL_STEP_PRE_HOOKS)


class Precision:
    """``32`` / ``16-mixed`` / ``bf16-mixed`` / ``bf16-true`` for one device type.

    ``16-mixed`` keeps a ``GradScaler``: the loss is scaled before backward, gradients are
    unscaled before clipping, and a step whose gradients hold inf/NaN is skipped by the scaler.
    Strategies that shard gradients (FSDP) pass their own scaler factory.
    """

    def __init__(self, name: str, device_type: str, scaler: Any | None = None) -> None:
        self.name = name
        self.device_type = device_type
        self.scaler = scaler
        if name == "16-mixed" and scaler is None:
            self.scaler = torch.amp.GradScaler(device_type)
        self._autocast_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(name)
        self.casts_input = name == "bf16-true"  # convert_input does something (read on every batch)
        self._unscaled: set[int] = set()  # optimizers unscaled since the last update()
        self._stepped = False

    @classmethod
    def for_accelerator(cls, name: str, accelerator: str) -> Precision:
        """The precision ``name`` on ``accelerator`` (``cpu`` | ``cuda`` | ``gpu``): what the registry
        hands a strategy it builds."""
        return cls(name, "cuda" if accelerator in ("cuda", "gpu") else "cpu")

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16-true" else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self._autocast_dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(torch.bfloat16) if self.name == "bf16-true" else module

    def convert_input(self, batch: Any) -> Any:
        return _cast_floats(batch, torch.bfloat16) if self.name == "bf16-true" else batch

    def forward_context(self) -> contextlib.AbstractContextManager:
        # A plain nullcontext for 32/bf16-true: entered every step, a generator-based context
        # manager costs several times as much.
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self._autocast_dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def check_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Refuse what a GradScaler gets wrong. torch's fused SGD on CPU (2.11 and 2.15) fills its momentum
        buffer from the gradients of a step the scaler skips for overflow, so the first finite step after an
        overflow adds those huge values (measured: buffer 1e10 after one skipped step; plain PyTorch with the
        documented recipe diverges the same way). Other implementations never run a skipped step."""
        if self.scaler is None or self.device_type != "cpu":
            return
        for index, optimizer in enumerate(optimizers):
            fused_momentum = [g for g in optimizer.param_groups if g.get("fused") and g.get("momentum", 0)]
            if isinstance(optimizer, torch.optim.SGD) and fused_momentum:
                raise ConfigError(
                    f"optimizer {index} is SGD(fused=True, momentum={fused_momentum[0]['momentum']}) under "
                    f"precision '{self.name}' on CPU: torch's fused SGD fills its momentum buffer from the "
                    f"overflowed gradients of a step the GradScaler skips, and training diverges. Use "
                    f"SGD(foreach=True) or the default implementation, or precision 'bf16-mixed'")

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: clip thresholds are meant for true gradients, not scaled ones. Once per
        optimizer and iteration (clipping by hand and then stepping must not unscale twice)."""
        if self.scaler is not None and id(optimizer) not in self._unscaled and _has_grads(optimizer):
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """The update, its gradients final and unscaled: ``optimizer.step()``, or under a GradScaler its
        ``step``, which skips the update when ``unscale_`` found inf/NaN (``update()`` then lowers the
        scale). ``kwargs``: what a manual ``opt.step(**kwargs)`` passed on, for the optimizer's own
        ``step``."""
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if not _has_grads(optimizer):
            # Every training_step of the window returned None: no backward ran, and the scaler refuses to
            # step an optimizer it saw no gradients for (as Lightning, skip it).
            return None
        result = self.scaler.step(optimizer, **kwargs)
        self._stepped = True
        return result

    def update(self) -> None:
        """Once per training iteration, after every optimizer stepped (PyTorch's multi-optimizer AMP
        recipe): a scale that backs off must not back off once per optimizer."""
        if self.scaler is not None:
            if self._stepped:
                self.scaler.update()
            self._stepped = False
            self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
