"""Tensor parallelism with dropout follows Megatron's RNG rule.

Tensor-parallel peers hold the same replicated activations, so they must draw the same dropout
masks on them; otherwise their replicated parameters (everything outside the sharded layers) get
different gradients and drift apart while every peer believes it holds "the" model. Data-parallel
ranks draw distinct masks; inside a sharded region peers draw distinct masks.

References, in plain PyTorch (never polytrain's own ``single`` strategy):

- a 1-device loop whose dropout stream is seeded as data-parallel rank 0's (``seed + dp_rank``),
  after the model was built under ``seed`` (DESIGN: identical streams while building, per-dp-rank
  streams for the training steps): the tp=2 run must equal it within 1e-5 (TP splits the sums, so
  not bitwise);
- the invariant: replicated parameters stay bitwise identical on both tensor-parallel peers.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.layers import sharded_rng

pytestmark = pytest.mark.torch_api

SEED = 0
STEPS = 20
BATCH = 8
P = 0.25


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(STEPS * BATCH, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


class Block(nn.Module):
    """``fc`` column-parallel, ``proj`` row-parallel; ``inner`` dropout sits in the sharded region."""

    def __init__(self, width: int, inner: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.inner = inner
        self.inner_masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.norm(x)))
        if self.inner and self.training:
            with sharded_rng():  # a sharded activation: each peer holds other columns
                h = F.dropout(h, P)
            self.inner_masks.append((h == 0).clone())
        return x + self.proj(h)


def _build(inner: bool = False) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(P), Block(16, inner), nn.Dropout(P), nn.LayerNorm(16),
                         nn.Linear(16, 3))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class DropoutNet(TrainModule):
    def __init__(self, inner: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.losses: list[float] = []

    def configure_model(self) -> None:
        self.net = _build(self.inner)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"net.2.fc": ColwiseParallel(), "net.2.proj": RowwiseParallel()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return _optimizer(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=True)


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch on one device; dropout stream = data-parallel rank 0's (seed + 0)."""
    torch.manual_seed(SEED)
    net = _build()
    opt = _optimizer(net.parameters())
    torch.manual_seed(SEED + 0)
    ds = _data()
    loader = DataLoader(ds, batch_size=BATCH,
                        sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=SEED))
    net.train()
    losses = []
    for x, y in loader:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {f"net.{k}": v for k, v in net.state_dict().items()}, losses


def _replicated_locals(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            if any(isinstance(pl, Shard) for pl in p.placements):
                continue
            p = p.to_local()
        out[name] = p.detach().clone()
    return out


def _worker(rank: int, world_size: int, root: str, inner: bool) -> dict[str, Any]:
    module = DropoutNet(inner)
    trainer = Trainer(accelerator="cpu", devices="auto",
                      strategy={"name": "model_parallel", "mode": "tensor", "tp": 2},
                      max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      run_dir=os.path.join(root, "run"), seed=SEED, use_distributed_sampler="always")
    trainer.fit(module)
    state = trainer.strategy.module_state_dict()
    return {"state": {k: v.clone() for k, v in state.items()} or None, "losses": module.losses,
            "replicated": _replicated_locals(trainer.strategy.module),
            "inner_masks": [m.clone() for m in trainer.strategy.module.net[2].inner_masks],
            "steps": trainer.global_step}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max()) for k in a}


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_tp_peers_draw_identical_masks_on_replicated_activations(tmp_path: Any) -> None:
    ref_state, ref_losses = _reference()
    runs = run_distributed(_worker, 2, str(tmp_path), False, timeout=80.0)
    assert [r["steps"] for r in runs] == [STEPS, STEPS]
    drift = _max_diff(runs[0]["replicated"], runs[1]["replicated"])
    assert all(torch.equal(runs[0]["replicated"][k], runs[1]["replicated"][k]) for k in drift), (
        f"replicated parameters drifted apart across tensor-parallel peers: {drift}")
    state = runs[0]["state"]
    assert state.keys() == ref_state.keys()
    diffs = _max_diff(state, ref_state)
    assert max(diffs.values()) <= 1e-5, f"tp=2 differs from the 1-device run on dp rank 0's stream: {diffs}"
    assert max(abs(a - b) for a, b in zip(runs[0]["losses"], ref_losses)) <= 1e-5
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_tp_peers_draw_distinct_masks_inside_a_sharded_region(tmp_path: Any) -> None:
    runs = run_distributed(_worker, 2, str(tmp_path), True, timeout=80.0)
    masks0, masks1 = runs[0]["inner_masks"], runs[1]["inner_masks"]
    assert len(masks0) == len(masks1) == STEPS
    assert all(m0.shape == (BATCH, 32) for m0 in masks0)  # the local half of 64 columns
    # Distinct columns of one activation: an identical pattern on every peer would be a correlation.
    assert sum(torch.equal(m0, m1) for m0, m1 in zip(masks0, masks1)) == 0
    # ... while the replicated parameters still agree bitwise.
    assert all(torch.equal(runs[0]["replicated"][k], runs[1]["replicated"][k]) for k in runs[0]["replicated"])


class ShardedDropoutNet(TrainModule):
    """One process: dropout on the hidden layer under ``sharded_rng``, plain dropout after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(6, 32), nn.Linear(32, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.fc(x))
        with sharded_rng():
            h = F.dropout(h, P)
        return F.cross_entropy(self.out(F.dropout(h, P)), y)

    def configure_optimizers(self) -> Any:
        return _optimizer(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=True)


def _fit_sharded(root: str, max_steps: int,
                 ckpt_path: str | None = None) -> tuple[Trainer, ShardedDropoutNet]:
    torch.manual_seed(SEED)
    module = ShardedDropoutNet()
    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, run_dir=root, seed=SEED,
                      use_distributed_sampler="always")
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.timeout(60)
def test_the_sharded_stream_is_checkpointed(tmp_path: Any) -> None:
    """A mid-epoch resume continues the sharded-region stream where it was (not from its seed): the
    resumed run equals the uninterrupted one bitwise."""
    _, whole = _fit_sharded(str(tmp_path / "whole"), STEPS)
    trainer, _ = _fit_sharded(str(tmp_path / "first"), STEPS // 2 + 1)
    path = str(tmp_path / "mid.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert "sharded" in saved["rng"][0], "the payload must hold the sharded-region stream"
    trainer, resumed = _fit_sharded(str(tmp_path / "resumed"), STEPS, ckpt_path=path)
    assert trainer.global_step == STEPS
    diffs = {k: float((v - whole.state_dict()[k]).abs().max()) for k, v in resumed.state_dict().items()}
    assert all(torch.equal(v, whole.state_dict()[k]) for k, v in resumed.state_dict().items()), diffs
