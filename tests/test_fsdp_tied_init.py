"""fsdp builds ``configure_model``'s layers on the meta device and initialises each rank's shards afterwards;
with a head tied to its embedding the initial weights still equal a CPU build with the same seed: the
shared tensor keeps what the first module holding it drew (as a CPU build that ties after constructing),
and every later module still draws, so the layers after it draw what they would have."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.torch_api


class TiedLM(TrainModule):
    def configure_model(self) -> None:
        if hasattr(self, "embed"):
            return
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16)
        self.head.weight = self.embed.weight  # tied after both were built, as GPT-style models do

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.head(self.blocks(self.embed(tokens))).logsumexp(-1).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights after one step are the initial ones

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(0, 16, (8, 3),
                                                      generator=torch.Generator().manual_seed(1))),
                          batch_size=2)


def _cpu_build() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = TiedLM()
    module.configure_model()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fsdp_build(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = TiedLM()
    trainer = Trainer(strategy="fsdp", accelerator="cpu", devices=world_size, max_steps=1, run_dir=run_dir,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0, timeout=60)
    trainer.fit(module)
    try:
        state = trainer.strategy.module_state_dict()  # every rank: a collective
        return {"state": {k: v.detach().clone() for k, v in state.items()},
                "tied": module.head.weight is module.embed.weight}
    finally:
        trainer.strategy.teardown()  # fsdp joins a process group even on one process: leave none behind


def _check(out: dict[str, Any]) -> None:
    want = _cpu_build()
    assert out["tied"]
    assert out["state"].keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(out["state"][k], v), f"{k} differs by {(out['state'][k] - v).abs().max().item()}"


def test_tied_weights_initialise_as_a_cpu_build_on_one_process(tmp_path: Any) -> None:
    _check(_fsdp_build(0, 1, str(tmp_path)))
    assert not torch.distributed.is_initialized()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tied_weights_initialise_as_a_cpu_build_sharded_over_two_ranks(tmp_path: Any) -> None:
    _check(run_distributed(_fsdp_build, 2, str(tmp_path), timeout=200)[0])
