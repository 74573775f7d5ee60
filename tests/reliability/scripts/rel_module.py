"""The reliability battery's TrainModule: tiny, deterministic, and able to fail on purpose.

Faults come from ``POLYTRAIN_REL_FAULT`` (so torchrun scripts, ``polytrain fit`` configs and
in-process tests share one switch), a comma-separated list of ``kind:rank:step``:

- ``kill``      SIGKILL this process in ``training_step`` once ``global_step == step``, on the first
                elastic attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or ``'0'``)
- ``raise``     raise ``RuntimeError`` there instead
- ``sleep``     sleep forever there (a rank stuck outside any collective)
- ``nan_loss``  make the loss NaN on that step (once per process)
- ``nan_grad``  keep the loss finite but make every gradient NaN (once per process)
- ``diverge``   call ``trainer.strategy.reduce`` in ``on_train_epoch_end`` on that rank only
- ``diverge_missing``  in ``on_train_batch_end`` at that step: this rank calls ``reduce``, every
                other rank sleeps forever

Every rank records what it did under ``out_dir``: ``events_rank{r}.jsonl`` (start, resume
point, elastic attempt), ``samples_rank{r}.jsonl`` (the dataset indices of each batch it trained
on) and, at the end of ``fit``, ``final_rank{r}.pt`` (the weights, for bitwise comparisons).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from polytrain import TrainModule


class IndexedRegression(Dataset):
    """``(x, y, index)``: the index lets a test see exactly which samples each rank consumed."""

    def __init__(self, n: int, features: int = 4, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=gen)
        w = torch.randn(features, 1, generator=gen)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN backward: a non-finite gradient from a finite loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def _listing(directory: str) -> dict[str, list[float]]:
    """Names, sizes and mtimes in a directory, hidden temporaries included."""
    if not os.path.isdir(directory):
        return {}
    out = {}
    for name in sorted(os.listdir(directory)):
        st = os.stat(os.path.join(directory, name))
        out[name] = [st.st_size, st.st_mtime]
    return out


def parse_faults(text: str | None) -> list[tuple[str, int, int]]:
    faults = []
    for item in (text or "").split(","):
        if item.strip():
            kind, rank, step = item.strip().split(":")
            faults.append((kind, int(rank), int(step)))
    return faults


class RelModule(TrainModule):
    def __init__(self, n: int = 32, batch_size: int = 4, lr: float = 0.05, shuffle: bool = True,
                 hidden: int = 8, dropout: float = 0.1, val_n: int = 0, out_dir: str | None = None,
                 optimizer: str = "adam", drop_last: bool = False) -> None:
        super().__init__()
        self.n = n
        self.batch_size = batch_size
        self.lr = lr
        self.shuffle = shuffle
        self.val_n = val_n
        self.drop_last = drop_last
        self.optimizer_name = optimizer
        self.out_dir = out_dir or os.environ.get("POLYTRAIN_REL_OUT")
        self.faults = parse_faults(os.environ.get("POLYTRAIN_REL_FAULT"))
        self.fired: set[tuple[str, int, int]] = set()
        self.train_steps_run = 0
        self.hidden = hidden
        self.dropout = dropout

    def configure_model(self) -> None:
        # Built here, under the Trainer's seed: identical weights whatever launched the process.
        if not hasattr(self, "net"):
            self.net = nn.Sequential(nn.Linear(4, self.hidden), nn.Dropout(self.dropout), nn.Tanh(),
                                     nn.Linear(self.hidden, 1))

    # ------------------------------------------------------------------ bookkeeping
    @property
    def rank(self) -> int:
        return self.trainer.global_rank

    def _write(self, name: str, record: dict[str, Any]) -> None:
        if not self.out_dir:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        record = {**record, "t": time.time()}
        with open(os.path.join(self.out_dir, f"{name}_rank{self.rank}.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _attempt(self) -> int:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)

    def _fault(self, kind: str) -> bool:
        for fault in self.faults:
            k, rank, step = fault
            if (k == kind and rank == self.rank and self.trainer.global_step == step
                    and fault not in self.fired):
                self.fired.add(fault)
                return True
        return False

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self) -> None:
        self._write("events", {"event": "fit_start", "attempt": self._attempt(),
                               "step": self.trainer.global_step,
                               "pid": os.getpid(), "world_size": self.trainer.world_size})

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._write("events", {"event": "resumed", "attempt": self._attempt(),
                               "step": int(checkpoint["loop"]["global_step"]), "pid": os.getpid()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.train_steps_run += 1
        if self._fault("kill") and self._attempt() == 0:
            self._write("events", {"event": "killing", "step": self.trainer.global_step, "pid": os.getpid()})
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fault("raise"):
            self._write("events", {"event": "raising", "step": self.trainer.global_step,
                                   "checkpoints": _listing(os.path.join(self.trainer.log_dir,
                                                                        "checkpoints"))})
            raise RuntimeError(f"deliberate failure on rank {self.rank} at step {self.trainer.global_step}")
        if self._fault("sleep"):
            self._write("events", {"event": "sleeping", "step": self.trainer.global_step})
            while True:
                time.sleep(3600)
        self._write("samples", {"step": self.trainer.global_step, "epoch": self.trainer.current_epoch,
                                "world_size": self.trainer.world_size, "indices": idx.tolist()})
        out = self(x)
        if self._fault("nan_grad"):
            out = _NanGrad.apply(out)
        loss = F.mse_loss(out, y)
        if self._fault("nan_loss"):
            loss = loss * float("nan")
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._fault("diverge_missing"):
            self.trainer.strategy.reduce(torch.ones(1))
        for kind, rank, step in self.faults:
            if kind == "diverge_missing" and rank != self.rank and self.trainer.global_step == step:
                while True:
                    time.sleep(3600)

    def on_train_epoch_end(self) -> None:
        if self._fault("diverge"):
            self.trainer.strategy.reduce(torch.ones(1))  # a collective in a rank-dependent branch: a bug

    def on_fit_end(self) -> None:
        self._write("events", {"event": "fit_end", "attempt": self._attempt(),
                               "step": self.trainer.global_step})
        state = self.trainer.strategy.module_state_dict()  # a collective under sharded strategies
        if self.out_dir and state:
            state = {k: v.detach().clone() for k, v in state.items()}
            path = os.path.join(self.out_dir, f"final_rank{self.rank}.pt")
            torch.save({"state": state, "step": self.trainer.global_step}, path + ".tmp")
            os.replace(path + ".tmp", path)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRegression(self.n), batch_size=self.batch_size, shuffle=self.shuffle,
                          drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader | None:
        if not self.val_n:
            return None
        return DataLoader(IndexedRegression(self.val_n, seed=1), batch_size=self.batch_size)
