"""The Trainer's verbs that the loops and the module call while training: moving a batch through the
batch-transfer hooks, optimizer steps (automatic and manual), clipping, scheduler steps, publishing
metrics. A mixin, so ``trainer.py`` stays about entry points and state."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from polytrain.core.errors import ConfigError
from polytrain.trainer import lifecycle
from polytrain.trainer.guards import NonFiniteGuard
from polytrain.trainer.metrics import Logged
from polytrain.trainer.optim import parse_optimizers
from polytrain.trainer.optimization import wrap_optimizer

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer


def _no_closure() -> None:
    return None


class StepMixin:
    """Used by ``Trainer``; ``self`` is the Trainer."""

    # ------------------------------------------------------------------ set-up for fit
    def setup_optimizers(self: Trainer) -> None:
        strategy, module = self.strategy, self.module
        if not strategy.optimizers:
            optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers())
            strategy.setup_optimizers(optimizers)
        self.optimizers = [wrap_optimizer(opt, self) for opt in strategy.optimizers]
        if not module.automatic_optimization and self.config.gradient_clip_val is not None:
            raise ConfigError(f"trainer.gradient_clip_val={self.config.gradient_clip_val} does nothing under manual "
                              f"optimisation ({type(module).__name__}.automatic_optimization is False): call "
                              f"self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...) "
                              f"in training_step before optimizer.step(), and drop the option")
        self._after_closure: dict[int, Callable[[], None]] = {}

    def restore_checkpoint_for_fit(self: Trainer) -> None:
        lifecycle.restore_for_fit(self, self.fit_ckpt_path)
        self.guard = NonFiniteGuard(self)  # after the restore: it names steps from the resumed count

    # ------------------------------------------------------------------ batches
    def transfer_batch(self: Trainer, batch: Any) -> Any:
        """Replaced per run by ``lifecycle.bind_transfer`` (the strategy's move when no hook is overridden)."""
        return self.strategy.batch_to_device(batch)

    # ------------------------------------------------------------------ optimisation
    def _optimizer_step(self: Trainer, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
        """``StepOptimizer.step``: through the strategy's precision, with the hooks of the mode."""
        if self.module.automatic_optimization:
            after = self._after_closure.get(id(optimizer))
            if after is None:
                after = self._after_closure[id(optimizer)] = partial(self._automatic_after_closure, optimizer)
            return self.strategy.optimizer_step(optimizer, closure or _no_closure, after)
        result = self.strategy.optimizer_step(optimizer, closure or _no_closure,
                                              partial(self.hooks, "on_before_optimizer_step", optimizer))
        self.global_step += 1  # manual optimisation counts every optimizer.step(), as Lightning
        return result

    def _automatic_after_closure(self: Trainer, optimizer: torch.optim.Optimizer) -> None:
        self._automatic.after_closure(optimizer)

    def manual_backward(self: Trainer, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.module.automatic_optimization:
            raise RuntimeError("manual_backward is for manual optimisation: set self.automatic_optimization = "
                               "False in __init__, or return the loss from training_step")
        self.strategy.manual_backward(loss, *args, **kwargs)

    def clip_gradients(self: Trainer, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> None:
        """Clip ``optimizer``'s gradients, unscaled first; a non-finite norm is the NaN guard's to judge."""
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}; valid: norm, value")
        self.strategy.precision.unscale_gradients(optimizer)
        norm = self.strategy.clip_gradients(optimizer, value, algorithm)
        if self.guard is not None and self.guard.check_grad_norm(norm):
            self.skip_this_step = True

    def scheduler_step(self: Trainer, scheduler: Any, metric: Any) -> None:
        with self.metrics.refusing("lr_scheduler_step"):
            self.module.lr_scheduler_step(scheduler, metric)

    # ------------------------------------------------------------------ metrics
    def publish(self: Trainer, values: dict[str, tuple[Logged, torch.Tensor]], step: int) -> None:
        """Hand values to callbacks and loggers: the only place metrics leave the device."""
        latest, self.metrics.last_step_values = self.metrics.last_step_values, {}
        for name, (entry, value) in latest.items():  # the epoch's last step values, not sent again
            if entry.prog_bar:
                self.progress_bar_metrics[name] = float(value)
            if entry.logger:
                self.logged_metrics[name] = float(value)
        if not values:
            return
        scalars = {name: float(v) for name, (_, v) in values.items()}
        self.progress_bar_metrics.update({n: scalars[n] for n, (e, _) in values.items() if e.prog_bar})
        logged = {n: scalars[n] for n, (e, _) in values.items() if e.logger}
        self.logged_metrics.update(logged)
        for cb in self.callbacks:
            cb.on_log(self, logged, step)
