"""``16-mixed`` with two optimizers equals PyTorch's documented multi-optimizer AMP recipe.

Reference (https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-multiple-models-losses-and-optimizers):
one ``scaler.scale(loss).backward()``, then ``scaler.step(opt)`` for every optimizer and ONE
``scaler.update()`` per iteration. Written here in plain PyTorch, not with polytrain's ``single``.

The model and learning rates are chosen so that fp16 gradients overflow during the first steps
(the initial scale 2**16 times a loss of ~1e2): the scale must drop once per skipped iteration,
and both optimizers must skip or step together. Bitwise: the arithmetic is identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.torch_api

STEPS = 40
BATCH = 8


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * BATCH, 16, generator=g) * 4
    y = x[:, :4].sum(1, keepdim=True) * 10  # large targets: a large loss, so scaled fp16 gradients overflow
    return TensorDataset(x, y)


def _build() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(16, 64), nn.Linear(64, 1)


def _optimizers(encoder: nn.Module, head: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(encoder.parameters(), lr=1e-3), torch.optim.Adam(head.parameters(), lr=1e-2)]


def _loss(encoder: nn.Module, head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(head(torch.relu(encoder(x))).float(), y)


class TwoOptimizers(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = _build()
        self.scales: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return _loss(self.encoder, self.head, x, y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.scales.append(float(self.trainer.strategy.precision.scaler.get_scale()))

    def configure_optimizers(self) -> Any:
        return _optimizers(self.encoder, self.head)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH)


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    encoder, head = _build()
    optimizers = _optimizers(encoder, head)
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    for x, y in DataLoader(_data(), batch_size=BATCH):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(encoder, head, x, y)
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        scales.append(float(scaler.get_scale()))
    state = {f"encoder.{k}": v for k, v in encoder.state_dict().items()}
    state.update({f"head.{k}": v for k, v in head.state_dict().items()})
    return state, scales


@pytest.mark.timeout(60)
def test_16_mixed_two_optimizers_update_the_scaler_once_per_iteration(tmp_path: Any) -> None:
    ref_state, ref_scales = _reference()
    assert ref_scales[0] < 2.0**16, "the reference must overflow at first, or this test proves nothing"
    module = TwoOptimizers()
    trainer = Trainer(accelerator="cpu", strategy="single", devices=1, precision="16-mixed", max_epochs=1,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      run_dir=str(tmp_path))
    trainer.fit(module)
    assert trainer.global_step == STEPS
    diffs = {k: float((v - ref_state[k]).abs().max()) for k, v in module.state_dict().items()}
    assert all(torch.equal(v, ref_state[k]) for k, v in module.state_dict().items()), (
        f"weights differ from the AMP recipe (max abs diff per tensor): {diffs}; "
        f"scales {module.scales[:6]} vs reference {ref_scales[:6]}")
    assert module.scales == ref_scales, "the loss scale must move once per iteration"
