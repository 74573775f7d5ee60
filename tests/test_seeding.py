"""The seeding rule (docs/reproducibility.md): with no ``trainer.seed`` polytrain leaves the user's
random streams alone, so one process gives bitwise what the user's own loop gives; everything built
before training sees one stream on every rank; training steps get a stream per data-parallel rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.torch_api


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class DropoutMLP(TrainModule):
    """Dropout and a shuffled loader: every step draws from the global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=4, shuffle=True)


def test_one_process_without_trainer_seed_is_bitwise_the_users_plain_loop(tmp_path: Any) -> None:
    """The obvious loop: same seed, same module, same DataLoader(shuffle=True), same dropout."""
    torch.manual_seed(1234)
    module = DropoutMLP()
    Trainer(accelerator="cpu", devices=1, max_epochs=3, accumulate_grad_batches=2, gradient_clip_val=0.5,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            run_dir=str(tmp_path)).fit(module)

    torch.manual_seed(1234)
    plain = DropoutMLP()
    [opt], [sched] = plain.configure_optimizers()
    loader = plain.train_dataloader()
    losses = []
    for _ in range(3):
        plain.train()
        for i, (x, y) in enumerate(loader):
            loss = F.mse_loss(plain.net(x), y)
            losses.append(loss.detach())
            (loss / 2).backward()
            if (i + 1) % 2 == 0 or i + 1 == len(loader):
                torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        sched.step()
    assert len(module.losses) == len(losses) == 30
    assert all(torch.equal(a, b) for a, b in zip(module.losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), plain.state_dict().values()))


def test_trainer_seed_set_reseeds_so_the_plain_loop_differs(tmp_path: Any) -> None:
    """The rule's other half: with trainer.seed polytrain seeds everything from it (so the test above
    would fail with it set: proof that test can fail)."""
    torch.manual_seed(1234)
    module = DropoutMLP()
    Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, run_dir=str(tmp_path), seed=7).fit(module)
    torch.manual_seed(1234)
    plain = DropoutMLP()
    x, y = next(iter(plain.train_dataloader()))
    assert not torch.equal(module.losses[0], F.mse_loss(plain.net(x), y).detach())


class SplitInSetup(TrainModule):
    """random_split in setup() with the global RNG, as Lightning users write it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
        self.masks: list[torch.Tensor] = []

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = random_split(_data(), [32, 8])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.net[0](x)
        dropped = self.net[1](hidden)
        self.masks.append((dropped != 0).clone())
        return F.mse_loss(self.net[2](dropped), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=4, shuffle=True)


def _split_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # ranks seeded differently on purpose: polytrain must share rank 0's stream
    module = SplitInSetup()
    Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            run_dir=root).fit(module)
    return {"train": sorted(module.train_set.indices), "val": sorted(module.val_set.indices),
            "masks": module.masks}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_random_split_in_setup_is_the_same_on_every_rank_and_dropout_differs(tmp_path: Any) -> None:
    ranks = run_distributed(_split_worker, 2, str(tmp_path), timeout=240)
    assert ranks[0]["train"] == ranks[1]["train"] and ranks[0]["val"] == ranks[1]["val"]
    assert not set(ranks[0]["train"]) & set(ranks[0]["val"])  # no validation sample leaks into training
    # Training steps: each data-parallel rank draws its own dropout masks.
    assert len(ranks[0]["masks"]) == len(ranks[1]["masks"]) == 4
    assert any(not torch.equal(a, b) for a, b in zip(ranks[0]["masks"], ranks[1]["masks"])
               if a.shape == b.shape)


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, -5])
def test_seed_everything_draws_what_torch_manual_seed_draws(seed: int) -> None:
    # On a machine without an accelerator only the CPU generator is seeded (torch.manual_seed's lazy
    # per-device seeds cost a stack trace each): the CPU stream must be exactly torch's.
    import random

    from polytrain.core.rng import seed_everything

    torch.manual_seed(seed)
    random.seed(seed)
    expected = torch.rand(5), torch.randint(0, 10**6, (3,)), random.random()
    torch.manual_seed(seed + 1)  # something else in between
    seed_everything(seed)
    assert torch.equal(torch.rand(5), expected[0]) and torch.equal(torch.randint(0, 10**6, (3,)), expected[1])
    assert random.random() == expected[2]
