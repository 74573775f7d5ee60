"""A small model for the asynchronous-checkpoint tests (imported by the test files and by the worker
processes they start): AdamW with a large learning rate, so every step changes every weight in place."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.callbacks.base import Callback
from polytrain.callbacks.model_checkpoint import ModelCheckpoint
from polytrain.checkpoint import async_writer
from polytrain.checkpoint.state import full_optimizer_state
from polytrain.core import collectives as C

_FINISH_STAGING = async_writer.finish_staging  # the writer's own, which set_hooks wraps


class Lin(TrainModule):
    def __init__(self, n: int = 64, batch_size: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        self.x, self.y, self.batch_size = (torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g),
                                           batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class StepAtStart(Callback):
    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.step = trainer.global_step


class WeightsAt(Callback):
    """Records the full model's weights after each optimizer step named in ``steps`` (every rank calls
    ``module_state_dict``: a collective under fsdp)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps, self.weights, self.optimizer = steps, {}, {}

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step in self.steps:
            state = trainer.strategy.module_state_dict()
            self.weights[trainer.global_step] = {k: v.detach().clone() for k, v in state.items()
                                                 if isinstance(v, torch.Tensor)}
            optim = full_optimizer_state(trainer.strategy.state_parts())  # AdamW's moments, by name
            self.optimizer[trainer.global_step] = {k: v.clone() for k, v in optim.items()
                                                   if isinstance(v, torch.Tensor)}


class LinManual(Lin):
    """The same model under manual optimisation."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


def set_hooks(delay: float = 0.0, fail_rank: int | None = None, stage_delay: float = 0.0) -> None:
    """Make the writer thread slow or failing, as a slow or full disk would (set inside a worker: each
    process patches its own writer module). ``stage_delay``: seconds before the background staging copy;
    ``delay``: seconds after it, before the write; ``fail_rank``: the global rank whose write then raises
    ENOSPC."""

    def slowed(deferred: Any) -> None:
        time.sleep(stage_delay)
        _FINISH_STAGING(deferred)
        time.sleep(delay)
        if fail_rank is not None and C.rank() == fail_rank:
            raise OSError(28, "No space left on device (injected by the test)")

    async_writer.finish_staging = slowed


def trainer(root: str, strategy: str = "single", devices: int = 1, max_steps: int = 6,
            callbacks: list[Any] | None = None, every_n: int = 2, saver_class: type = ModelCheckpoint,
            trainer_kwargs: dict[str, Any] | None = None, **ckpt: Any) -> Trainer:
    saver = saver_class(every_n_train_steps=every_n, every_n_epochs=None, async_save=True,
                        **{"save_top_k": -1, "save_last": True, **ckpt})
    return Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, run_dir=root,
                   seed=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   use_distributed_sampler="always", callbacks=[*(callbacks or []), saver],
                   **(trainer_kwargs or {}))
