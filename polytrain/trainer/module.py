"""``TrainModule``: the user's model plus the steps and hooks the Trainer calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from polytrain.core.protocol import LOG_TAP, MUTED

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer


class TrainModule(nn.Module):
    """Subclass this; override ``training_step`` and ``configure_optimizers`` at least.

    Hook names and meanings follow PyTorch Lightning's where they coincide.
    """

    def __init__(self) -> None:
        super().__init__()
        # Stored outside nn.Module's registries: the trainer is not a submodule or a buffer.
        self.__dict__["_trainer"] = None

    # ------------------------------------------------------------------ trainer access
    @property
    def trainer(self) -> Trainer:
        trainer = self.__dict__.get("_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; call trainer.fit(module) first")
        return trainer

    def _attach(self, trainer: Trainer | None) -> None:
        self.__dict__["_trainer"] = trainer

    def __getstate__(self) -> dict[str, Any]:
        # Sent to spawned workers without the parent's trainer.
        state = self.__dict__.copy()
        state["_trainer"] = None
        return state

    @property
    def device(self) -> torch.device:
        trainer = self.__dict__.get("_trainer")
        if trainer is not None and trainer.strategy is not None:
            return trainer.strategy.root_device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        trainer = self.__dict__.get("_trainer")
        return trainer.global_rank if trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    # ------------------------------------------------------------------ logging
    def log(self, name: str, value: torch.Tensor | float | int, *, prog_bar: bool = False,
            sync_dist: bool = False, on_step: bool | None = None, on_epoch: bool | None = None,
            batch_size: int | None = None, logger: bool = True) -> None:
        """Record a metric. Training steps log per step by default; evaluation per epoch.

        Epoch values are averaged over samples and reduced across data-parallel ranks once per
        epoch. ``sync_dist=True`` also reduces per-step values (only on steps that are logged).
        """
        trainer = self.__dict__.get("_trainer")
        if trainer is None:
            return
        tap = self.__dict__.get(LOG_TAP)  # set by a strategy around a padding batch or a pipeline stage
        if tap is not None:
            if tap is MUTED:
                return
            tap.append((name, torch.as_tensor(value).detach().reshape(()).float(),
                        dict(prog_bar=prog_bar, sync_dist=sync_dist, on_step=on_step, on_epoch=on_epoch,
                             batch_size=batch_size, logger=logger)))
        trainer.metrics.log(name, value, prog_bar=prog_bar, sync_dist=sync_dist, on_step=on_step,
                            on_epoch=on_epoch, batch_size=batch_size, logger=logger)

    def log_dict(self, values: Mapping[str, torch.Tensor | float | int], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)

    # ------------------------------------------------------------------ model and optimisation
    def configure_model(self) -> None:
        """Build layers here instead of ``__init__`` to have sharded strategies create them
        directly on the meta device (never materialising the whole model on one rank)."""

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define configure_optimizers() returning an optimizer, "
            f"(optimizer, scheduler), ([optimizers], [schedulers]) or a dict"
        )

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define training_step(self, batch, batch_idx) returning a loss tensor"
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return None

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return None

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch)

    # ------------------------------------------------------------------ data
    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    # ------------------------------------------------------------------ hooks (call order for fit)
    def on_fit_start(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...


def overrides(module: nn.Module, name: str) -> bool:
    """True if ``module``'s class defines ``name`` itself rather than inheriting TrainModule's."""
    method = getattr(type(module), name, None)
    return method is not None and method is not getattr(TrainModule, name, None)
