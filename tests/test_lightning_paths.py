"""What a Lightning project writes beyond the top-level names, with the import renamed: Lightning's deep
module paths, ``core.saving``'s YAML helpers, ``self.log``'s refusal, the ``limit_*=1`` note, a DataModule's
``str`` and checkpoint keys, checkpoints beside loggers that are stand-ins, and ``logger=False`` with a
``dirpath`` writing nothing but the checkpoints."""

from __future__ import annotations

import argparse
import enum
import logging
import os
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TinyModule, make_dataset
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

import polytrain as pl
from polytrain import Trainer
from polytrain.callbacks import ModelCheckpoint
from polytrain.loggers import CSVLogger

pytestmark = pytest.mark.own_logic


def test_lightning_module_paths_give_polytrains_own_objects() -> None:
    from polytrain.callbacks.callback import Callback
    from polytrain.core.datamodule import LightningDataModule
    from polytrain.core.mixins import HyperparametersMixin
    from polytrain.core.module import LightningModule
    from polytrain.core.saving import load_hparams_from_yaml, save_hparams_to_yaml

    from polytrain.utilities import GradClipAlgorithmType, is_picklable
    from polytrain.utilities.types import STEP_OUTPUT

    assert LightningModule is pl.LightningModule and LightningDataModule is pl.LightningDataModule
    assert Callback is pl.Callback
    assert issubclass(pl.LightningModule, HyperparametersMixin)
    assert callable(save_hparams_to_yaml) and callable(load_hparams_from_yaml) and STEP_OUTPUT is not None
    assert GradClipAlgorithmType.NORM == "norm" and GradClipAlgorithmType("value") == "value"
    assert is_picklable({"a": 1}) and not is_picklable(lambda: 1)


def test_a_module_written_against_a_deep_path_trains(make_trainer: Any) -> None:
    from polytrain.core.module import LightningModule

    class Deep(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(make_dataset(8, 4, seed=0), batch_size=4)

    trainer = make_trainer(max_epochs=1)
    trainer.fit(Deep())
    assert trainer.global_step == 2


class _Choice(str, enum.Enum):
    FIRST = "first-value"
    SECOND = "second-value"


@pytest.mark.parametrize("wrap", [dict, lambda d: argparse.Namespace(**d), pl.utilities.AttributeDict,
                                  OmegaConf.create])
def test_hyperparameters_go_to_yaml_and_back(tmp_path: Any, wrap: Any) -> None:
    from polytrain.core.saving import load_hparams_from_yaml, save_hparams_to_yaml

    hparams = {"batch_size": 32, "lr": 0.001, "nested": {"depth": 3, "name": "x"}}
    path = tmp_path / "hparams.yaml"
    save_hparams_to_yaml(path, wrap(hparams))
    assert load_hparams_from_yaml(path, use_omegaconf=False) == hparams
    loaded = load_hparams_from_yaml(path)
    assert isinstance(loaded, DictConfig) and loaded.nested.depth == 3


def test_yaml_without_omegaconf_writes_an_enum_by_name_and_leaves_out_what_yaml_cannot_hold(
        tmp_path: Any) -> None:
    from polytrain.core.saving import load_hparams_from_yaml, save_hparams_to_yaml

    path = tmp_path / "hparams.yaml"
    with pytest.warns(UserWarning, match="Skipping 'dtype' parameter"):
        save_hparams_to_yaml(path, {"choice": _Choice.SECOND, "dtype": torch.float32, "n": 2},
                             use_omegaconf=False)
    assert load_hparams_from_yaml(path, use_omegaconf=False) == {"choice": "SECOND", "n": 2}


def test_yaml_into_a_missing_folder_says_so_and_a_missing_file_warns(tmp_path: Any) -> None:
    from polytrain.core.saving import load_hparams_from_yaml, save_hparams_to_yaml

    with pytest.raises(RuntimeError, match="Missing folder"):
        save_hparams_to_yaml(tmp_path / "absent" / "hparams.yaml", {"a": 1})
    with pytest.warns(RuntimeWarning, match="Missing Tags"):
        assert load_hparams_from_yaml(tmp_path / "none.yaml") == {}


@pytest.mark.parametrize("value", [None, {"a": 1}, "text", [1, 2]])
def test_logging_what_cannot_be_logged_is_lightnings_value_error(make_trainer: Any, value: Any) -> None:
    class Logs(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("foo", value)
            return super().training_step(batch, batch_idx)

    refusal = r"`self\.log\(foo, .*\)` was called, but `\w+` values cannot be logged"
    with pytest.raises(ValueError, match=refusal):
        make_trainer(max_epochs=1).fit(Logs())


@pytest.mark.parametrize("name", ["limit_train_batches", "limit_val_batches", "limit_test_batches",
                                  "limit_predict_batches", "overfit_batches", "val_check_interval"])
@pytest.mark.parametrize("value", [1, 1.0])
def test_a_limit_of_one_says_whether_one_batch_or_all_were_meant(caplog: Any, name: str, value: Any) -> None:
    with caplog.at_level(logging.INFO, logger="polytrain"):
        Trainer(**{name: value})
    assert f"`Trainer({name}={value})` was configured so" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="polytrain"):
        Trainer()
    assert "was configured so" not in caplog.text


class _Data(pl.LightningDataModule):
    def __init__(self, size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()  # the datasets exist once setup() ran

    def setup(self, stage: str) -> None:
        self.train, self.val = make_dataset(self.hparams.size, 4, seed=0), make_dataset(4, 4, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=4)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(self.val, batch_size=2), DataLoader(self.val, batch_size=4)]


def test_a_datamodule_prints_its_loaders_as_lightning() -> None:
    data = _Data()
    lines = ["{Train dataloader: None}", "{Validation dataloader: None}", "{Test dataloader: None}",
             "{Predict dataloader: None}"]
    assert str(data) == os.linesep.join(lines)
    data.setup("fit")
    lines[:2] = ["{Train dataloader: size=8}", "{Validation dataloader: 1. size=4 ; 2. size=4}"]
    assert str(data) == os.linesep.join(lines)


def test_datamodule_hyperparameters_sit_under_the_key_its_class_names(tmp_path: Any,
                                                                      quiet_kwargs: dict[str, Any]) -> None:
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    trainer = Trainer(**{**quiet_kwargs, "enable_checkpointing": True}, max_epochs=1, callbacks=[checkpoints],
                      limit_val_batches=0)
    trainer.fit(TinyModule(n=8, val_n=None), datamodule=_Data(size=12))
    saved = torch.load(checkpoints.best_model_path, weights_only=False)
    assert _Data.CHECKPOINT_HYPER_PARAMS_KEY == "datamodule_hyper_parameters"
    assert saved[_Data.CHECKPOINT_HYPER_PARAMS_KEY]["size"] == 12
    assert _Data.load_from_checkpoint(checkpoints.best_model_path).hparams.size == 12


def test_a_logger_stand_in_is_not_pickled_into_the_checkpoint(tmp_path: Any,
                                                             quiet_kwargs: dict[str, Any]) -> None:
    """A ``MagicMock`` logger answers ``state_dict()`` with another mock: not a state, so not saved (it
    failed the save)."""
    stand_in = mock.MagicMock(name="logger")
    stand_in.save_dir = str(tmp_path)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    trainer = Trainer(**{**quiet_kwargs, "enable_checkpointing": True, "logger": stand_in}, max_epochs=1,
                      callbacks=[checkpoints])
    trainer.fit(TinyModule(n=8, val_n=None))
    saved = torch.load(checkpoints.best_model_path, weights_only=False)
    assert not any(isinstance(v, mock.Mock) for v in saved["callbacks"].values())


def test_no_logger_and_a_dirpath_write_nothing_but_the_checkpoints(tmp_path: Any,
                                                                   quiet_kwargs: dict[str, Any]) -> None:
    run_dir, ckpt_dir = tmp_path / "runs", tmp_path / "ckpt"
    checkpoints = ModelCheckpoint(dirpath=str(ckpt_dir))
    trainer = Trainer(**{**quiet_kwargs, "run_dir": str(run_dir), "enable_checkpointing": True}, max_epochs=1,
                      callbacks=[checkpoints])
    trainer.fit(TinyModule(n=8, val_n=None))
    assert not run_dir.exists()
    assert os.path.isfile(checkpoints.best_model_path)
    # a logger, or a ModelCheckpoint without a dirpath, still gets the run's directory
    logged = Trainer(**{**quiet_kwargs, "run_dir": str(run_dir), "logger": CSVLogger(str(run_dir), name="")},
                     max_epochs=1)
    logged.fit(TinyModule(n=8, val_n=None))
    assert os.path.isdir(logged.log_dir)


def test_barebones_turns_off_what_costs_speed_and_refuses_it_asked_for_beside(make_trainer: Any) -> None:
    trainer = Trainer(barebones=True, run_dir="unused")
    assert (trainer.config.logger, trainer.config.enable_checkpointing, trainer.config.enable_progress_bar,
            trainer.config.enable_model_summary, trainer.config.num_sanity_val_steps) == (False, False, False,
                                                                                         False, 0)
    assert trainer.callbacks == []
    for name, value in (("enable_checkpointing", True), ("logger", "csv"), ("num_sanity_val_steps", 2),
                        ("fast_dev_run", True), ("profiler", "simple")):
        with pytest.raises(ValueError, match=rf"`Trainer\(barebones=True, {name}=.*` was passed"):
            Trainer(barebones=True, **{name: value})


def test_enable_validation_and_fast_dev_run_read_as_lightnings(make_trainer: Any) -> None:
    assert Trainer(fast_dev_run=1).fast_dev_run is True and Trainer(fast_dev_run=3).fast_dev_run == 3
    trainer = make_trainer(max_epochs=1)
    trainer.fit(TinyModule(n=8, val_n=4))
    assert trainer.enable_validation
    limited = make_trainer(max_epochs=1, limit_val_batches=0)
    limited.fit(TinyModule(n=8, val_n=4))
    assert not limited.enable_validation
