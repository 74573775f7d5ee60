"""Clipping by norm under pipeline parallelism with two optimizers clips each by its own norm.

Each stage runs ``configure_optimizers`` on its part of the model. Under pipeline parallelism polytrain
reduces optimizer k's partial norm over the stages, so optimizer k must be one optimizer on every stage.
A module that builds an optimizer only over the parameters a stage holds (torch refuses an optimizer
over nothing) gives stage 0 ``[A]`` and stage 1 ``[B]``: optimizer 0 was then clipped by the norm of A's
and B's gradients together, silently (found by tests/matrix: 4e-2 off one device). Now that layout is
refused with an error naming each stage's optimizers and the fix; kept aligned (an empty group where a
stage holds none of an optimizer's parameters), the run equals the reference.

Reference: plain PyTorch on one device, two SGDs, ``clip_grad_norm_`` over each optimizer's own
parameters, the batch as two micro-batches (each loss times 1/2). Within 1e-5 (the pipeline sums the
norm from per-stage partial sums).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.torch_api

CLIP = 0.05
BATCH = 8


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6 * BATCH, 6, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def _build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _optimizers(net: nn.Sequential, aligned: bool) -> list[torch.optim.Optimizer]:
    groups = [[p for n, p in net.named_parameters() if n.startswith("0.")],
              [p for n, p in net.named_parameters() if n.startswith("2.")]]
    settings = [dict(lr=0.1, momentum=0.9), dict(lr=0.2)]
    if aligned:
        return [torch.optim.SGD(g or [{"params": []}], **kw) for g, kw in zip(groups, settings)]
    return [torch.optim.SGD(g, **kw) for g, kw in zip(groups, settings) if g]


class TwoOptimizers(TrainModule):
    def __init__(self, aligned: bool) -> None:
        super().__init__()
        self.net, self.aligned = _build(), aligned

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self.net(batch[0]), batch[1])

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def configure_optimizers(self) -> Any:
        return _optimizers(self.net, self.aligned)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH)


def _reference() -> dict[str, torch.Tensor]:
    net = _build()
    optimizers = _optimizers(net, aligned=False)  # one device holds every parameter
    for x, y in DataLoader(_data(), batch_size=BATCH):
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (F.mse_loss(net(xm), ym) * 0.5).backward()
        for opt in optimizers:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {f"net.{k}": v for k, v in net.state_dict().items()}


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for aligned in (True, False):
        trainer = Trainer(accelerator="cpu", devices=2,
                          strategy={"name": "pipeline", "pp": 2, "split_points": [2]},
                          max_epochs=1, gradient_clip_val=CLIP, logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, enable_model_summary=False, timeout=30.0,
                          run_dir=os.path.join(root, str(aligned)))
        try:
            trainer.fit(TwoOptimizers(aligned))
        except Exception as err:  # noqa: BLE001 - the refusal is the result
            out[aligned] = f"{type(err).__name__}: {err}"
            continue
        state = trainer.strategy.module_state_dict()
        out[aligned] = {k: v.clone() for k, v in state.items()} or None
    return out


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_each_optimizer_is_clipped_by_its_own_norm_or_refused(tmp_path: Any) -> None:
    runs = run_distributed(_worker, 2, str(tmp_path), timeout=80.0)
    state, ref = runs[0][True], _reference()
    assert isinstance(state, dict), f"the aligned optimizers failed: {state}"
    diffs = {k: float((state[k] - ref[k]).abs().max()) for k in ref}
    assert max(diffs.values()) <= 1e-5, f"pipeline clipping differs from per-optimizer clipping: {diffs}"
    for rank, run in enumerate(runs):  # every rank refuses (no hang, no silent mix of norms)
        message = run[False]
        assert isinstance(message, str) and message.startswith("ConfigError"), (rank, message)
        assert ("stage rank 0: [SGD(" in message and "stage rank 1: [SGD(" in message
                and "'params': []" in message)
