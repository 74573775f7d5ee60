"""``DataModule`` (Lightning's ``LightningDataModule``): prepare_data once per node (or once in all) while
the other ranks wait, setup/teardown(stage), ``trainer.datamodule``, its state and hyperparameters in
checkpoints, and the ``datamodule:`` config section (Lightning CLI's name) through ``polytrain fit``."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch.utils.data import DataLoader, TensorDataset

from polytrain import DataModule, Trainer, TrainModule
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.cli import main as cli_main
from polytrain.core.errors import ConfigError
from polytrain.trainer.configuration.config import load_config

pytestmark = pytest.mark.own_logic

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)


class Model(TrainModule):
    """Takes all its data from the DataModule."""

    def __init__(self, calls: list | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.calls = calls if calls is not None else []

    def setup(self, stage: str) -> None:
        self.calls.append(("module.setup", stage))

    def teardown(self, stage: str) -> None:
        self.calls.append(("module.teardown", stage))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Data(DataModule):
    def __init__(self, n: int = 16, batch_size: int = 4, calls: list | None = None) -> None:
        super().__init__()
        self.save_hyperparameters("n", "batch_size")
        self.calls = calls if calls is not None else []
        self.batches_served = 0
        self.restored: dict | None = None

    def setup(self, stage: str) -> None:
        self.calls.append(("dm.setup", stage))
        g = torch.Generator().manual_seed(0)
        self.ds = TensorDataset(torch.randn(self.hparams.n, 4, generator=g),
                                torch.randn(self.hparams.n, 1, generator=g))

    def teardown(self, stage: str) -> None:
        self.calls.append(("dm.teardown", stage))

    def _loader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=self.hparams.batch_size)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.batches_served += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"batches_served": self.batches_served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = dict(state_dict)
        self.batches_served = state_dict["batches_served"]


# ---------------------------------------------------------------------- setup / teardown / trainer.datamodule


def test_setup_and_teardown_get_each_stage_and_the_datamodule_comes_first(tmp_path: Any) -> None:
    calls: list = []
    dm, module = Data(calls=calls), Model(calls=calls)
    trainer = Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1,
                      enable_checkpointing=False)
    trainer.fit(module, datamodule=dm)
    assert trainer.datamodule is dm and dm.trainer is trainer
    trainer.validate(module, datamodule=dm, verbose=False)
    trainer.test(module, datamodule=dm, verbose=False)
    predictions = trainer.predict(module, datamodule=dm)
    assert len(predictions) == 4  # the DataModule's predict loader
    expected = []
    for stage in ("fit", "validate", "test", "predict"):
        expected += [("dm.setup", stage), ("module.setup", stage)]
        expected += [("dm.teardown", stage), ("module.teardown", stage)]
    assert calls == expected
    assert trainer.global_step == 4  # trained on the DataModule's 16 samples in batches of 4


def test_fit_takes_a_datamodule_positionally_too(tmp_path: Any) -> None:
    trainer = Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1,
                      enable_checkpointing=False)
    dm = Data()
    trainer.fit(Model(), dm)  # Lightning allows fit(model, datamodule) as the second positional argument
    assert trainer.datamodule is dm and trainer.global_step == 4
    other = Data(n=8)
    assert len(trainer.validate(Model(), other, verbose=False)) == 1 and trainer.datamodule is other
    assert trainer.num_val_batches == [2]  # the 8 samples of the DataModule given as the loaders
    trainer.test(Model(), Data(n=12), verbose=False)
    assert trainer.num_test_batches == [3]
    assert len(trainer.predict(Model(), Data(n=4))) == 1
    with pytest.raises(ValueError, match="passed both as the loaders"):
        trainer.validate(Model(), Data(), datamodule=Data())


# ------------------------------------------------------------------- state and hyperparameters in checkpoints


def test_datamodule_state_and_hparams_round_trip_through_a_checkpoint(tmp_path: Any) -> None:
    root = str(tmp_path / "root")
    dm = Data(n=16, batch_size=4)
    trainer = Trainer(**QUIET, devices=1, default_root_dir=root, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Model(), datamodule=dm)
    assert dm.batches_served == 8  # 4 training + 4 validation batches
    path = os.path.join(root, "version_0", "checkpoints", "last.ckpt")
    checkpoint = read_checkpoint(path)
    assert checkpoint["datamodule"] == {"Data": {"batches_served": 8}}  # under its class name
    assert checkpoint["datamodule_hyper_parameters"] == {"n": 16, "batch_size": 4}

    rebuilt = Data.load_from_checkpoint(path)  # Lightning's classmethod: hparams, then state
    assert (rebuilt.hparams.n, rebuilt.hparams.batch_size, rebuilt.batches_served) == (16, 4, 8)

    resumed = Data(n=16, batch_size=4)
    Trainer(**QUIET, devices=1, default_root_dir=root, max_epochs=2, num_sanity_val_steps=0).fit(
        Model(), datamodule=resumed, ckpt_path="last")
    assert resumed.restored == {"batches_served": 8}  # load_state_dict got what state_dict gave
    assert resumed.batches_served == 16


# --------------------------------------------------------------------------- prepare_data on 2 ranks


class Prepared(DataModule):
    """prepare_data is slow and writes a file; setup, on every rank, must find it complete."""

    def __init__(self, root: str, per_node: bool) -> None:
        super().__init__()
        self.root = root
        self.prepare_data_per_node = per_node

    def _path(self) -> str:
        return os.path.join(self.root, f"prepared-node{self.trainer.node_rank}.txt")

    def prepare_data(self) -> None:
        time.sleep(1.0)  # a download: the other ranks must wait for it at the barrier
        tmp = self._path() + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"written by global rank {self.trainer.global_rank}")
        os.replace(tmp, self._path())
        with open(os.path.join(self.root, f"prepare-ran-on-rank{self.trainer.global_rank}"), "w"):
            pass

    def setup(self, stage: str) -> None:
        files = sorted(n for n in os.listdir(self.root) if n.startswith("prepared-node"))
        self.seen_at_setup = {n: open(os.path.join(self.root, n), encoding="utf-8").read() for n in files}
        self.ds = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=4)


def _prepare_worker(rank: int, world_size: int, root: str, nodes: int, per_node: bool) -> dict[str, Any]:
    if nodes == world_size:  # one process per node: each is local rank 0 of its node
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), NODE_RANK=str(rank))
    dm = Prepared(root, per_node)
    trainer = Trainer(**QUIET, strategy="ddp", devices=world_size // nodes, num_nodes=nodes,
                      default_root_dir=root, max_epochs=1, enable_checkpointing=False)
    trainer.fit(Model(), datamodule=dm)
    return {"node": trainer.node_rank, "local_rank": trainer.local_rank, "seen": dm.seen_at_setup}


@pytest.mark.distributed
@pytest.mark.parametrize(("nodes", "per_node", "preparers"), [
    (1, True, [0]),  # one node: local rank 0 prepares, rank 1 waits
    (2, True, [0, 1]),  # two nodes: each node's local rank 0 prepares (its own disk)
    (2, False, [0]),  # prepare_data_per_node=False: global rank 0 only
])
def test_prepare_data_runs_once_per_node_while_the_others_wait(tmp_path: Any, nodes: int, per_node: bool,
                                                                  preparers: list[int]) -> None:
    root = str(tmp_path)
    results = run_distributed(_prepare_worker, 2, root, nodes, per_node, timeout=180.0)
    assert sorted(int(n.rsplit("rank", 1)[1]) for n in os.listdir(root)
                  if n.startswith("prepare-ran")) == preparers
    assert [r["node"] for r in results] == ([0, 1] if nodes == 2 else [0, 0])
    expected = {f"prepared-node{results[r]['node']}.txt": f"written by global rank {r}" for r in preparers}
    for r in results:
        # Every rank's setup saw every file complete, although prepare_data took a second to write it.
        assert r["seen"] == expected


# --------------------------------------------------------------------------- datamodule: in YAML configs


MODULE_FILE = '''
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from polytrain import LightningDataModule, LightningModule


class Net(LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Numbers(LightningDataModule):
    def __init__(self, n=12, batch_size=4):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage):
        self.ds = TensorDataset(torch.randn(self.hparams.n, 4), torch.randn(self.hparams.n, 1))

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.hparams.batch_size)
'''


def test_a_datamodule_section_is_accepted_like_data(tmp_path: Any) -> None:
    # loading imports the targets (building nothing)
    (tmp_path / "lightning_style.py").write_text(MODULE_FILE)
    cfg = tmp_path / "cfg.yaml"
    try:
        cfg.write_text("module: {_target_: lightning_style.Net}\n"
                       "datamodule: {_target_: lightning_style.Numbers, n: 8}\n")
        loaded = load_config(str(cfg), ["datamodule.batch_size=2"])
        assert loaded["data"] == {"_target_": "lightning_style.Numbers", "n": 8, "batch_size": 2}
        cfg.write_text("module: {_target_: lightning_style.Net}\ndata: {_target_: lightning_style.Numbers}\n"
                       "datamodule: {_target_: lightning_style.Numbers}\n")
        with pytest.raises(ConfigError, match="both data: and datamodule:"):
            load_config(str(cfg))
        cfg.write_text("module: {_target_: lightning_style.Net}\ndatamodule: {n: 8}\n")
        with pytest.raises(ConfigError, match="_target_"):
            load_config(str(cfg))
    finally:
        sys.modules.pop("lightning_style", None)


@pytest.mark.parametrize("section", ["datamodule", "data"])
def test_polytrain_fit_config_with_a_datamodule_section(tmp_path: Any, capsys: Any, section: str) -> None:
    (tmp_path / "lightning_style.py").write_text(MODULE_FILE)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(textwrap.dedent(f"""
        module: {{_target_: lightning_style.Net, lr: 0.05}}
        {section}:
          _target_: lightning_style.Numbers
          n: 12
          batch_size: 4
        trainer: {{accelerator: cpu, devices: 1, max_epochs: 2, default_root_dir: {tmp_path / 'run'},
                   enable_progress_bar: false, enable_model_summary: false, logger: csv}}
    """))
    try:
        assert cli_main(["fit", "--config", str(cfg)]) == 0
    finally:
        sys.modules.pop("lightning_style", None)
    assert "final metrics: train/loss=" in capsys.readouterr().out
    checkpoint = read_checkpoint(str(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"))
    assert checkpoint["global_step"] == 6  # 2 epochs of the DataModule's 3 batches
    assert checkpoint["datamodule_hyper_parameters"] == {"n": 12, "batch_size": 4}
    assert checkpoint["hyper_parameters"] == {"lr": 0.05}
