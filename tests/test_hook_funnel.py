"""Every hook goes through the one funnel (``trainer/api/hooks.py``): a run where a module, a callback and a
DataModule override every hook they can has each of those hooks timed by the simple profiler, whose only
way in is that funnel (it wraps callables as the funnel plans them, and patches nothing). The steps
(``training_step``, ``validation_step``, ...) run inside the strategy and show as the profiler's phase rows.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from conftest import TinyModule
from torch.utils.data import DataLoader

from polytrain import Callback, DataModule, Trainer
from polytrain.trainer.api.hooks import CALLBACK_HOOKS, DATAMODULE_HOOKS, MODULE_HOOKS, is_overridden
from polytrain.trainer.api.module import TrainModule

pytestmark = pytest.mark.own_logic

# the strategy runs them: phase rows
STEPS = {"training_step", "validation_step", "test_step", "predict_step"}
NOT_CALLED_BY_THE_LOOP = {"forward"}  # the module's own code calls it (predict_step's default does)


def _pass_through(name: str, base: type) -> Any:
    """An override that does what ``base``'s does (so the run behaves as an unhooked one)."""
    default = getattr(base, name)

    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        return default(self, *args, **kwargs)

    hook.__name__ = name
    return hook


class EveryHookModule(TinyModule):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]  # lr_scheduler_step

    def train_dataloader(self) -> DataLoader:
        return super().train_dataloader()


for _name in MODULE_HOOKS - STEPS - NOT_CALLED_BY_THE_LOOP - {"train_dataloader", "val_dataloader",
                                                              "test_dataloader", "predict_dataloader",
                                                              "configure_optimizers"}:
    if _name not in vars(EveryHookModule) and not is_overridden(EveryHookModule(), _name, TrainModule):
        setattr(EveryHookModule, _name, _pass_through(_name, TrainModule))


class EveryHookCallback(Callback):
    pass


for _name in CALLBACK_HOOKS:
    setattr(EveryHookCallback, _name, lambda self, *args, **kwargs: None)


class EveryHookData(DataModule):
    def __init__(self, module: TinyModule) -> None:
        super().__init__()
        self.module = module

    def train_dataloader(self) -> DataLoader:
        return self.module.train_dataloader()

    def val_dataloader(self) -> DataLoader:
        return self.module.val_dataloader()

    def test_dataloader(self) -> DataLoader:
        return self.module.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.module.val_dataloader()


for _name in DATAMODULE_HOOKS - {"train_dataloader", "val_dataloader", "test_dataloader",
                                 "predict_dataloader"}:
    setattr(EveryHookData, _name, _pass_through(_name, DataModule))


class Boom(RuntimeError):
    pass


def test_every_hook_is_reached_through_the_funnel(quiet_kwargs: dict, tmp_path: Any) -> None:
    module = EveryHookModule(n=16, batch_size=4, val_n=8)
    data = EveryHookData(module)
    trainer = Trainer(**{**quiet_kwargs, "num_sanity_val_steps": 1, "max_epochs": 1, "gradient_clip_val": 1.0,
                         "profiler": "simple", "callbacks": [EveryHookCallback()]})
    trainer.fit(module, datamodule=data)
    path = os.path.join(str(tmp_path), "saved.ckpt")
    trainer.save_checkpoint(path)
    trainer.fit(module, datamodule=data, ckpt_path=path)  # nothing left to train: the restore's hooks
    trainer.validate(module, datamodule=data)
    trainer.test(module, datamodule=data)
    trainer.predict(module, datamodule=data)

    def broken_test_step(batch: Any, batch_idx: int) -> Any:
        raise Boom("on purpose")

    module.test_step = broken_test_step  # type: ignore[method-assign] - the test's own module
    with pytest.raises(Boom):
        trainer.test(module, datamodule=data)

    rows = {name for name, (_, calls) in trainer.profiler.records.items() if calls}
    # rows named as Lightning's profilers name them: [Callback]<state key>.<hook>,
    # [LightningModule]<class>.<hook>, [LightningDataModule]<class>.<hook>
    row_name = re.compile(r"\[(?:Callback|LightningModule|LightningDataModule)\](\w+)\.(\w+)")
    named = [row_name.fullmatch(row) for row in rows]
    owners = {m.group(1) for m in named if m}
    assert {"EveryHookModule", "EveryHookCallback", "EveryHookData"} <= owners
    by_owner = {owner: {m.group(2) for m in named if m and m.group(1) == owner} for owner in owners}
    assert CALLBACK_HOOKS <= by_owner["EveryHookCallback"], (
        sorted(CALLBACK_HOOKS - by_owner["EveryHookCallback"]))
    module_hooks = MODULE_HOOKS - STEPS - NOT_CALLED_BY_THE_LOOP
    module_missing = sorted(module_hooks - by_owner["EveryHookModule"] - by_owner["EveryHookData"])
    # the *_dataloader hooks come from the DataModule (it comes first)
    assert not module_missing, module_missing
    assert DATAMODULE_HOOKS <= by_owner["EveryHookData"], sorted(DATAMODULE_HOOKS - by_owner["EveryHookData"])
    assert STEPS <= rows, sorted(STEPS - rows)
