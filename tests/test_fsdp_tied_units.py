"""FSDP on a model whose tied parameters sit in different children of its largest container (a GPT-style
``nn.Sequential``: the embedding first, the head last, one weight): the tied children stay in one unit
(the root's) instead of two, and two sharded ranks train it equal to one process on the same global batch.
A plain PyTorch loop is the reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.parallel.fully_shard import blocks_to_wrap

pytestmark = pytest.mark.torch_api

VOCAB, WIDTH, STEPS = 16, 8, 4


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (16, 5), generator=torch.Generator().manual_seed(3))


class Head(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def tied_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                        nn.Linear(WIDTH, WIDTH), Head(WIDTH, VOCAB, bias=False))
    net[4].weight = net[0].weight  # tied, as GPT-2's head is to its embedding
    return net


class TiedSequential(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tied_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(_tokens()), batch_size=4)


def _reference() -> dict[str, torch.Tensor]:
    """The global batch: both ranks' batches of 4 (samples 0..7, then 8..15), two epochs of two steps."""
    net = tied_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(STEPS // 2):
        for (tokens,) in DataLoader(TensorDataset(_tokens()), batch_size=8):
            loss = F.cross_entropy(net(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def _fsdp(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    module = TiedSequential()
    trainer = Trainer(strategy="fsdp", accelerator="cpu", devices=world_size, max_steps=STEPS,
                      run_dir=run_dir, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0, timeout=60)
    trainer.fit(module)
    state = trainer.strategy.module_state_dict()  # every rank: a collective
    return {"state": {k: v.detach().clone() for k, v in state.items()}}


def test_tied_children_are_not_units_of_their_own() -> None:
    net = tied_net()
    units = blocks_to_wrap(net, None)
    assert net[0] not in units and net[4] not in units  # the tie stays whole, in the root's unit
    assert net[1] in units and net[3] in units


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fsdp_trains_a_tied_sequential_equal_to_one_process(tmp_path: Any) -> None:
    reference = _reference()
    state = run_distributed(_fsdp, 2, str(tmp_path), timeout=200)[0]["state"]
    assert state.keys() == reference.keys()
    for key, want in reference.items():
        torch.testing.assert_close(state[key], want, rtol=0, atol=1e-6, msg=key)
