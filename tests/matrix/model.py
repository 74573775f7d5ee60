"""The matrix's model, data and optimizers, shared by the polytrain runs and the plain-PyTorch reference.

A seven-child ``nn.Sequential`` that every strategy can split:

    0 Linear(6, 16)   1 Dropout   2 Linear(16, 32)   3 Tanh   4 Linear(32, 16)   5 Dropout   6 Linear(16, 1)

- tensor parallel: child 2 column-parallel, child 4 row-parallel (Megatron's pair); both dropouts act on
  replicated activations, so tensor-parallel peers must draw identical masks (DESIGN.md, seeding);
- pipeline: stage 0 = children 0..2, stage 1 = children 3..6 (``SPLIT``), one dropout per stage;
- two optimizers: one over children 0..2 (``FIRST``), one over the rest, with different hyperparameters.

Each sample gets fresh input noise in ``__getitem__``, drawn by the process that loads it (a DataLoader
worker, or the main process with ``num_workers=0``): the loader's workers and its RNG state matter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from polytrain import TrainModule

SEED = 0
FEATURES = 6
P_DROP = 0.25
GLOBAL_BATCH = 8
BATCHES_PER_EPOCH = 6  # per rank; a multiple of every accumulation factor (no partial window)
EPOCHS = 2
N = GLOBAL_BATCH * BATCHES_PER_EPOCH
N_VAL = 2 * GLOBAL_BATCH  # validation samples (two batches per data-parallel rank)
SPLIT = 3  # first child of pipeline stage 1
FIRST = 3  # children [0, FIRST) belong to optimizer 0 when there are two
CLIP = 0.3  # small enough that most steps clip


class Noisy(Dataset):
    """A fixed regression problem; each access adds noise to ``x`` from the loading process's RNG."""

    def __init__(self, n: int = N, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        # Targets of ~10: the first 16-mixed steps overflow at the initial scale (2**16), so the scaler skips
        # steps and backs off, once per iteration.
        self.y = 10 * torch.sin(self.x @ torch.randn(FEATURES, 1, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(FEATURES), self.y[i]


def validation_set() -> Noisy:
    """Its own fixed problem; loaded in the main process, so every sample draws its noise from that
    process's stream (the validation's place in the stream shows in the weights)."""
    return Noisy(N_VAL, seed=11)


def build(dropout: bool) -> nn.Sequential:
    """The network; call under ``torch.manual_seed(SEED)`` for the matrix's initial weights."""
    drop = (lambda: nn.Dropout(P_DROP)) if dropout else nn.Identity
    return nn.Sequential(nn.Linear(FEATURES, 16), drop(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16),
                         drop(), nn.Linear(16, 1))


def loss_of(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), targets)


def optimizer_groups(named: list[tuple[str, nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """Parameters (names relative to the Sequential: ``"2.weight"``) per optimizer."""
    if count == 1:
        return [[p for _, p in named]]
    first = [p for n, p in named if int(n.split(".")[0]) < FIRST]
    return [first, [p for n, p in named if int(n.split(".")[0]) >= FIRST]]


IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def make_optimizers(groups: list[list[nn.Parameter]], impl: str = "for-loop") -> list[torch.optim.Optimizer]:
    """One SGD per group this process holds parameters of (a pipeline stage may hold none of a group's: torch
    refuses an optimizer over nothing, and an empty param group does not load from a sharded checkpoint),
    each with the implementation ``impl`` asked for explicitly."""
    settings = [dict(lr=0.01, momentum=0.9), dict(lr=0.02, momentum=0.5)]
    return [torch.optim.SGD(params, **settings[k], **IMPLEMENTATIONS[impl])
            for k, params in enumerate(groups) if params]


class MatrixNet(TrainModule):
    """The matrix's module: training_step calls the Sequential once (pipeline: ``pipeline_loss``)."""

    def __init__(self, dropout: bool, optimizers: int, batch_size: int, num_workers: int,
                 impl: str = "for-loop", validation: bool = False) -> None:
        super().__init__()
        self.impl = impl
        self.validation = validation
        torch.manual_seed(SEED)
        self.net = build(dropout)
        self.n_optimizers = optimizers
        self.batch_size = batch_size
        self.num_workers = num_workers

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"net.2": ColwiseParallel(), "net.4": RowwiseParallel()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_of(self.net(x), y)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_of(outputs, targets)

    def configure_optimizers(self) -> Any:
        return make_optimizers(optimizer_groups(list(self.net.named_parameters()), self.n_optimizers),
                               self.impl)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(), batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", loss_of(self.net(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader | None:
        return DataLoader(validation_set(), batch_size=self.batch_size) if self.validation else None
