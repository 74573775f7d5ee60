"""A tiny regression TrainModule for the launch tests: fast to import, fast to train, deterministic.

With ``record_dir`` (or ``POLYTRAIN_TEST_RECORD_DIR``) every rank writes ``<tag>-rank<R>.json`` at
the end of ``fit``: who it was (rank, world, node, pid, the launcher's variables), which strategy
trained it, the step it started from and ended at, and its final weights.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS")


def make_dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.25 + 0.01 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def weights(module: nn.Module) -> list[float]:
    """The module's parameters flattened, in state-dict order (exact values for comparisons)."""
    return [float(v) for t in module.state_dict().values() for v in t.detach().flatten().tolist()]


def write_json(path: str, data: dict) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


class TinyRegressor(TrainModule):
    """Linear regression on 64 fixed samples. ``fail_rank``: raise on that global rank once optimizer
    step ``fail_step`` is reached (the other ranks are then waiting in DDP's all-reduce)."""

    def __init__(self, n: int = 64, batch_size: int = 8, lr: float = 0.05, shuffle: bool = False,
                 fail_rank: int = -1, fail_step: int = 1, record_dir: str | None = None,
                 record_tag: str = "fit", step_sleep: float = 0.0) -> None:
        super().__init__()
        self.step_sleep = step_sleep  # seconds a step takes at least: a job still running when signalled
        self.n = n
        self.batch_size = batch_size
        self.lr = lr
        self.shuffle = shuffle
        self.fail_rank = fail_rank
        self.fail_step = fail_step
        self.record_dir = record_dir or os.environ.get("POLYTRAIN_TEST_RECORD_DIR")
        self.record_tag = record_tag
        self.start_step: int | None = None
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == self.fail_rank and self.trainer.global_step >= self.fail_step:
            if self.record_dir:  # when it failed, so a test can measure how long the job lingered
                os.makedirs(self.record_dir, exist_ok=True)
                write_json(os.path.join(self.record_dir, f"failed-rank{self.fail_rank}.json"),
                           {"time": time.time()})
            raise RuntimeError(f"tiny-module deliberate failure on rank {self.fail_rank}")
        time.sleep(self.step_sleep)
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        # the ranks' sum, per step: what callback_metrics shows once the ranks reduced it
        self.log("train/rank_sum", float(self.trainer.global_rank), sync_dist=True, reduce_fx="sum")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(make_dataset(self.n), batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self):
        return DataLoader(make_dataset(16, seed=1), batch_size=8)

    def on_fit_start(self) -> None:
        self.start_step = self.trainer.global_step

    def on_fit_end(self) -> None:
        if not self.record_dir:
            return
        trainer = self.trainer
        strategy = trainer.strategy
        record = {
            "rank": trainer.global_rank, "world_size": trainer.world_size, "local_rank": strategy.local_rank,
            "node_rank": strategy.env.node_rank, "env_source": strategy.env.source, "strategy": strategy.name,
            "pid": os.getpid(), "ppid": os.getppid(), "start_step": self.start_step,
            "global_step": trainer.global_step, "weights": weights(self),
            "env": {k: os.environ.get(k) for k in LAUNCHER_VARS},
        }
        os.makedirs(self.record_dir, exist_ok=True)
        write_json(os.path.join(self.record_dir, f"{self.record_tag}-rank{trainer.global_rank}.json"), record)
