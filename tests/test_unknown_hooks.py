"""A hook name polytrain never calls (a typo, or a Lightning hook it lacks) warns, once per class, on a
module, a callback and a DataModule; every Lightning hook name is known, so none of those warns."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from conftest import TinyModule
from torch.utils.data import DataLoader

from polytrain import Callback, DataModule, Trainer
from polytrain.trainer.api.hooks import CALLBACK_HOOKS, DATAMODULE_HOOKS, MODULE_HOOKS

pytestmark = pytest.mark.own_logic


def _fit(trainer_kwargs: dict, module: Any, **kwargs: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count our own once-per-class rule, not Python's registry
        Trainer(**trainer_kwargs).fit(module, **kwargs)
    return [str(w.message) for w in caught if "is never called by polytrain" in str(w.message)]


def test_a_misspelt_module_hook_warns_once_per_class(quiet_kwargs: dict) -> None:
    class Typo(TinyModule):
        def on_train_epoch_begin(self) -> None:  # Lightning 0.x's name; never called
            pass

        def on_validation_epoch_end(self) -> None:  # a real hook: no warning
            pass

    kwargs = {**quiet_kwargs, "max_epochs": 1}
    first = _fit(kwargs, Typo())
    assert first == ["Typo.on_train_epoch_begin is never called by polytrain: it is not one of its hooks. "
                     "Did you mean 'on_train_epoch_start'?"]
    assert _fit(kwargs, Typo()) == []  # the same class again: already told

    class OtherTypo(TinyModule):
        def on_train_epoch_begin(self) -> None:
            pass

    assert len(_fit(kwargs, OtherTypo())) == 1  # another class: told again


def test_a_misspelt_callback_hook_warns_once_per_class(quiet_kwargs: dict) -> None:
    class Watcher(Callback):
        def on_batch_end(self, trainer: Any, module: Any) -> None:  # removed from Lightning in 2.0
            pass

        def on_train_batch_end(self, *args: Any) -> None:
            pass

    kwargs = {**quiet_kwargs, "max_epochs": 1}
    messages = _fit({**kwargs, "callbacks": [Watcher(), Watcher()]}, TinyModule())
    assert len(messages) == 1 and messages[0].startswith("Watcher.on_batch_end is never called")
    assert _fit({**kwargs, "callbacks": [Watcher()]}, TinyModule()) == []


def test_a_misspelt_datamodule_hook_warns_once_per_class(quiet_kwargs: dict) -> None:
    module = TinyModule()

    class Data(DataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(module.train_ds, batch_size=4)

        def on_before_batch_transfers(self, batch: Any, dataloader_idx: int) -> Any:  # typo: extra "s"
            return batch

    kwargs = {**quiet_kwargs, "max_epochs": 1}
    messages = _fit(kwargs, module, datamodule=Data())
    assert messages == ["Data.on_before_batch_transfers is never called by polytrain: it is not one of "
                        "its hooks. Did you mean 'on_before_batch_transfer'?"]
    assert _fit(kwargs, module, datamodule=Data()) == []


def test_every_lightning_hook_name_is_known() -> None:
    """A module, callback or DataModule written for Lightning never triggers the warning by using a hook."""
    pl = pytest.importorskip("lightning.pytorch")
    hooks = {n for n in dir(pl.LightningModule)
             if n.startswith("on_") and callable(getattr(pl.LightningModule, n))}
    assert hooks - MODULE_HOOKS == set()
    assert {n for n in dir(pl.Callback) if n.startswith("on_")} - CALLBACK_HOOKS == set()
    assert {n for n in dir(pl.LightningDataModule) if n.startswith("on_")} - DATAMODULE_HOOKS == set()
