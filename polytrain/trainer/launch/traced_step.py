"""The user's ``training_step`` as the planner traces it: on one meta sample of the batch, with what the step
may reach for during training standing in, and nothing done that training would keep.

The planner (``parallel/planner``) costs a step by running it once on meta tensors. A step written for
training reads ``self.trainer``, logs, and under manual optimisation calls ``self.optimizers()``,
``manual_backward``, ``clip_gradients`` and ``opt.step()``. Here each of those answers as it would in a
fit, without an effect: logs are dropped, the losses handed to ``manual_backward`` are summed into the one
loss whose backward the planner measures (a GAN's generator and discriminator halves both count), and an
optimizer's ``step``/``zero_grad`` do nothing (its memory and time are the cost model's, not the trace's).
Reads of the trainer the module was attached to (``max_epochs``, ``current_epoch``...) pass through to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polytrain.core.errors import ConfigError
from polytrain.core.protocol import extract_loss, muted_logs
from polytrain.trainer.api.optimizer_config import parse_optimizers


def traced_step(attached: Any) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The planner's step for a module attached to ``attached`` (a Trainer, or None): the trace runs on
    copies of the module, which a copy leaves unattached."""
    return functools.partial(traced_training_step, attached=attached)


def traced_training_step(module: nn.Module, batch: Any, attached: Any = None) -> torch.Tensor:
    """``module``'s training step on ``batch`` (meta) as the planner traces it: its loss, or under manual
    optimisation the sum of what it passed to ``manual_backward``. ``self.trainer``'s other values are
    ``attached``'s."""
    standing_in = _TracedTrainer(module, attached)
    before = module.__dict__.get("_trainer")
    module.__dict__["_trainer"] = standing_in
    try:
        with muted_logs(module):
            out = module.training_step(batch, 0)
    finally:
        module.__dict__["_trainer"] = before
    if standing_in.losses:
        return sum(standing_in.losses[1:], standing_in.losses[0])
    loss = extract_loss(out) if getattr(module, "automatic_optimization", True) else None
    if loss is None:
        raise ConfigError(f"{type(module).__name__}.training_step returned no loss on the planner's batch "
                          f"(and called no manual_backward): there is no backward to cost. Return the "
                          f"loss, or pin the degrees instead of planning")
    return loss


class _StandInOptimizer:
    """An optimizer as ``self.optimizers()`` gives it, whose ``step`` and ``zero_grad`` change nothing (a
    closure given to ``step`` runs once, as the optimizer would run it)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # state, defaults: the optimizer's own
        return getattr(self.optimizer, name)


class _StandInStrategy:
    """What a step reads from ``self.trainer.strategy``, as one process holding the whole model has it."""

    dp_rank = 0
    dp_size = 1
    global_rank = 0
    local_rank = 0
    world_size = 1
    is_global_zero = True

    def __init__(self, standing_in: _TracedTrainer) -> None:
        self._standing_in = standing_in

    @property
    def root_device(self) -> torch.device:
        return self._standing_in.device

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._standing_in.optimizers

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"self.trainer.strategy.{name} is not there while the planner traces "
                             f"training_step (one process, the model on meta); read it in a hook the fit "
                             f"runs, or pin the degrees instead of planning")


class _TracedTrainer:
    """``self.trainer`` during the trace: the attached trainer's values, with the step's effects
    standing in (see the module's docstring)."""

    def __init__(self, module: nn.Module, attached: Any) -> None:
        self._module = module
        self._attached = attached
        self._optimizers: list[_StandInOptimizer] | None = None
        self._schedulers: list[Any] = []
        self.losses: list[torch.Tensor] = []
        self.strategy = _StandInStrategy(self)

    @property
    def device(self) -> torch.device:
        first = next(self._module.parameters(), None)
        return first.device if first is not None else torch.device("meta")

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o.optimizer for o in self.stepping_optimizers]

    @property
    def stepping_optimizers(self) -> list[_StandInOptimizer]:
        if self._optimizers is None:
            try:
                made, self._schedulers = parse_optimizers(self._module.configure_optimizers())
            except Exception as err:  # noqa: BLE001 - said with what the planner needed them for
                raise ConfigError(f"{type(self._module).__name__}.training_step asks for its optimizers, and "
                                  f"configure_optimizers() raised {type(err).__name__} on the planner's meta "
                                  f"model: {err}. Pin the degrees instead of planning") from err
            self._optimizers = [_StandInOptimizer(o) for o in made]
        return self._optimizers

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        self.stepping_optimizers  # noqa: B018 - built with the optimizers they step
        return self._schedulers

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.losses.append(loss)

    def clip_gradients(self, optimizer: Any, value: float, algorithm: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        attached = self.__dict__.get("_attached")
        if attached is None:
            raise AttributeError(f"self.trainer.{name}: the planner traces training_step with no Trainer "
                                 f"attached; plan through `polytrain plan` or a fit with plan: true")
        return getattr(attached, name)
