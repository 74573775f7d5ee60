"""BaseFinetuning / BackboneFinetuning: Lightning's freezing helpers and schedule, a resume that rebuilds
the optimizer's parameter groups before their state loads (exact against an uninterrupted fit), and the
refusal across processes."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule
from distributed import run_distributed
from torch import nn

from polytrain import Trainer
from polytrain.callbacks import BackboneFinetuning, BaseFinetuning, ModelCheckpoint
from polytrain.core.errors import ConfigError

pytestmark = pytest.mark.own_logic


class _Backboned(TinyModule):
    """A frozen-at-first backbone (with a BatchNorm) under a head; SGD with momentum on the head only, so
    the backbone's group and its momentum exist only once the callback adds them."""

    def __init__(self, gamma: float = 0.7) -> None:
        super().__init__(n=16, batch_size=4, val_n=None)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.net = nn.Linear(8, 1)
        self.gamma = gamma
        self.seen: list[tuple[int, list[float]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self(x), y)

    def on_train_epoch_start(self) -> None:  # runs after the callbacks' hook: the rates this epoch trains at
        self.seen.append((self.current_epoch, [g["lr"] for g in self.optimizers().param_groups]))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.gamma)]


def test_backbone_finetuning_follows_lightnings_schedule(make_trainer: Any) -> None:
    module = _Backboned()
    make_trainer(max_epochs=7, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=3)]).fit(module)
    head = [0.1 * 0.7 ** e for e in range(7)]
    # frozen until epoch 3; then a tenth of the head's rate, doubled each epoch, never above the head's
    backbone = {3: head[3] * 0.1, 4: head[3] * 0.2, 5: head[3] * 0.4, 6: head[6]}
    for epoch, rates in module.seen:
        expected = [head[epoch]] + ([backbone[epoch]] if epoch >= 3 else [])
        assert rates == pytest.approx(expected, rel=1e-12), epoch
    # train_bn=False: the BatchNorm is not in the backbone's group
    assert [len(g["params"]) for g in module.optimizers().param_groups] == [2, 2]


def test_a_resume_rebuilds_the_added_groups_before_their_state_loads(make_trainer: Any, run_dir: str) -> None:
    torch.manual_seed(0)
    whole = _Backboned()
    make_trainer(max_epochs=6, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=2)]).fit(whole)

    torch.manual_seed(0)
    first = _Backboned()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(run_dir, "ck"), save_top_k=-1)
    make_trainer(max_epochs=4, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=2), checkpoints],
                 run_dir=run_dir + "-a").fit(first)
    resumed = _Backboned()
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=2)
    make_trainer(max_epochs=6, callbacks=[callback], run_dir=run_dir + "-b").fit(
        resumed, ckpt_path=checkpoints.last_model_path)
    # the backbone's group came back with its rate and momentum: the same weights as one fit, bit for bit
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert resumed.seen == whole.seen[4:]
    assert callback.previous_backbone_lr == pytest.approx(whole.seen[-1][1][1])


def test_the_freezing_helpers_treat_batchnorm_and_parents_with_parameters_as_lightning() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.own = nn.Parameter(torch.zeros(1))
            self.conv = nn.Linear(2, 2)
            self.bn = nn.BatchNorm1d(2)

    model = nn.Sequential(Parent(), nn.Linear(2, 2))
    assert len(BaseFinetuning.flatten_modules(model)) == 4  # the parent holds a parameter of its own
    BaseFinetuning.freeze(model, train_bn=True)
    assert not model[0].own.requires_grad and not model[0].conv.weight.requires_grad
    assert model[0].bn.weight.requires_grad and model[0].bn.track_running_stats
    BaseFinetuning.freeze([model[0].bn, [model[1]]], train_bn=False)
    assert not model[0].bn.weight.requires_grad and not model[0].bn.track_running_stats
    BaseFinetuning.make_trainable(model)
    assert all(p.requires_grad for p in model.parameters()) and model[0].bn.track_running_stats
    assert len(list(BaseFinetuning.filter_params(model, train_bn=False))) == 5  # all but the BatchNorm's

    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.5)
    with pytest.warns(UserWarning, match="already exist within another group"):
        BaseFinetuning.unfreeze_and_add_param_group(model, optimizer)  # model[1]'s are held already
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 5]
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.05)  # the first group's over initial_denom_lr


def test_backbone_finetuning_needs_a_backbone(make_trainer: Any) -> None:
    with pytest.raises(ConfigError, match="`backbone` attribute; TinyModule has none"):
        make_trainer(max_epochs=1, callbacks=[BackboneFinetuning()]).fit(TinyModule())


def _two_ranks(rank: int, world_size: int, root: str) -> str:
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, run_dir=root, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      max_epochs=1, callbacks=[BackboneFinetuning()], timeout=60)
    try:
        trainer.fit(_Backboned())
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_finetuning_is_refused_on_every_rank_across_processes(tmp_path: Any) -> None:
    # a part unfrozen after the data-parallel wrapper was built would not have its gradients averaged
    for message in run_distributed(_two_ranks, 2, str(tmp_path), timeout=150.0):
        assert "runs on one process only (2 here)" in message


class _AddsToTheSGDOnly(BaseFinetuning):
    """Unfreezes the backbone into the plain SGD optimizer only, chosen by its exact type (as a Lightning
    project writes it): the optimizer the callback receives is the torch one, not a wrapper."""

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        if epoch == 1 and type(optimizer) is torch.optim.SGD:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.05, train_bn=True)


class _TwoOptimizers(_Backboned):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(self(x), y))
            optimizer.step()

    def on_train_epoch_start(self) -> None: ...

    def on_train_epoch_end(self) -> None:
        self.lr_schedulers().step()

    def configure_optimizers(self) -> Any:
        first = torch.optim.SGD(self.net.parameters(), lr=0.1)
        second = torch.optim.Adam(self.net.parameters(), lr=0.01)
        return [first, second], [torch.optim.lr_scheduler.StepLR(first, step_size=1, gamma=0.5)]


def test_the_learning_rate_monitor_renames_an_optimizer_that_gained_a_group(make_trainer: Any) -> None:
    """An optimizer with one group is logged as ``lr-SGD``; once the callback adds a group, its record moves
    to ``lr-SGD/pg1`` (the whole history, at the end of the order) beside ``lr-SGD/pg2``, as Lightning's
    LearningRateMonitor does; ``trainer.optimizers`` are the torch optimizers themselves."""
    from polytrain.callbacks import LearningRateMonitor

    monitor = LearningRateMonitor(logging_interval="epoch")
    seen_types: list[type] = []

    class Types(BaseFinetuning):
        def freeze_before_training(self, pl_module: Any) -> None: ...

        def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
            seen_types.append(type(optimizer))

    module = _TwoOptimizers()
    trainer = make_trainer(max_epochs=3, callbacks=[_AddsToTheSGDOnly(), Types(), monitor])
    trainer.fit(module)
    assert [type(o) for o in trainer.optimizers] == [torch.optim.SGD, torch.optim.Adam]
    assert set(seen_types) == {torch.optim.SGD, torch.optim.Adam}
    assert list(monitor.lrs) == ["lr-Adam", "lr-SGD/pg1", "lr-SGD/pg2"]
    assert monitor.lrs["lr-SGD/pg1"] == pytest.approx([0.1, 0.05, 0.025])
    assert monitor.lrs["lr-SGD/pg2"] == pytest.approx([0.05, 0.025])  # added at 0.05, then halved
    assert monitor.lrs["lr-Adam"] == pytest.approx([0.01, 0.01, 0.01])
