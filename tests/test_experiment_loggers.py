"""The MLflow and W&B loggers (optional extras) write what the CSV logger writes: every metric at every
step, and the hyperparameters. MLflow against a real local file store (``file:`` URI), W&B in offline
mode (its run file is read back). Both are chosen by name in ``trainer.logger`` or passed as objects; their
libraries load late, and a missing one fails at construction with the install command."""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, TensorDataset

from polytrain import LightningModule, Trainer
from polytrain.callbacks import CSVLogger, MLFlowLogger, WandbLogger
from polytrain.callbacks.loggers import flatten_hparams
from polytrain.core.errors import ConfigError

pytestmark = pytest.mark.own_logic

QUIET = dict(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
             enable_checkpointing=False, max_epochs=2, log_every_n_steps=2)
HPARAMS = {"hidden": 4, "lr": 0.05, "optim": {"momentum": 0.5, "name": "sgd"}}


class Tracked(LightningModule):
    def __init__(self, hidden: int = 4, lr: float = 0.05, optim: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))
        g = torch.Generator().manual_seed(0)
        self.train_ds = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
        self.val_ds = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("train/loss", loss, on_step=True, on_epoch=True)  # forked: _step and _epoch
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("val/loss", loss)
        self.log("val/step_loss", loss, on_step=True, on_epoch=False)  # the evaluation step axis

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_ds, batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=4)


def csv_points(run_dir: str) -> set[tuple[int, str, float]]:
    """Every (step, name, value) the CSV logger wrote."""
    with open(os.path.join(run_dir, "version_0", "metrics.csv"), newline="", encoding="utf-8") as fh:
        return {(int(row["step"]), k, float(v)) for row in csv.DictReader(fh) for k, v in row.items()
                if k != "step" and v != ""}


def csv_hparams(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "version_0", "hparams.yaml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def fit(run_dir: str, logger: Any) -> Trainer:
    trainer = Trainer(**QUIET, default_root_dir=run_dir, logger=logger)
    trainer.fit(Tracked(**HPARAMS))
    return trainer


# --------------------------------------------------------------------------- MLflow


mlflow_needed = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                   reason="pip install polytrain[mlflow]")


def mlflow_points(client: Any, run_id: str) -> set[tuple[int, str, float]]:
    names = client.get_run(run_id).data.metrics
    return {(m.step, name, m.value) for name in names for m in client.get_metric_history(run_id, name)}


@mlflow_needed
def test_mlflow_by_name_writes_what_the_csv_logger_writes(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = str(tmp_path / "run")
    trainer = Trainer.from_config({"trainer": {**QUIET, "default_root_dir": run_dir,
                                               "logger": ["csv", "mlflow"]}})
    trainer.fit(Tracked(**HPARAMS))
    logger = trainer.loggers[1]
    assert isinstance(logger, MLFlowLogger)
    # a file store in the run directory
    assert logger.tracking_uri == "file:" + os.path.join(run_dir, "mlruns")
    client = logger.experiment
    points = csv_points(run_dir)
    assert {n for _, n, _ in points} >= {"train/loss_step", "train/loss_epoch", "val/loss", "val/step_loss",
                                         "epoch"}
    assert mlflow_points(client, logger.run_id) == points
    run = client.get_run(logger.run_id)
    assert run.data.params == {k: str(v) for k, v in flatten_hparams(csv_hparams(run_dir)).items()}
    assert run.info.status == "FINISHED"


@mlflow_needed
def test_mlflow_as_an_object_with_a_file_uri(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it with an explicit file: store
    store = "file:" + str(tmp_path / "store")
    run_dir = str(tmp_path / "run")
    logger = MLFlowLogger(experiment_name="exp", run_name="first", tracking_uri=store, tags={"team": "a"})
    trainer = fit(run_dir, [CSVLogger(run_dir, name=""), logger])
    assert trainer.loggers[1] is logger
    client = logger.experiment
    run = client.get_run(logger.run_id)
    assert (run.info.run_name, run.data.tags["team"]) == ("first", "a")
    assert client.get_experiment_by_name("exp").experiment_id == run.info.experiment_id
    assert mlflow_points(client, logger.run_id) == csv_points(run_dir)
    assert os.path.isdir(str(tmp_path / "store"))


# --------------------------------------------------------------------------- W&B


wandb_needed = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                  reason="pip install polytrain[wandb]")


def wandb_records(run_file: str) -> list[Any]:
    """The records of an offline run file (LevelDB-style log: 7-byte header, 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    raw = open(run_file, "rb").read()
    assert raw[:4] == b":W&B"
    records, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding at a block's end
            pos += left - 7
            continue
        if pos + length > len(raw):
            break  # a record still being written
        pending += raw[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(save_dir: str) -> tuple[set[tuple[int, str, float]], dict[str, Any]]:
    [run_file] = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    deadline = time.monotonic() + 30
    records = wandb_records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)  # W&B's writer process may still be flushing the finished run
        records = wandb_records(run_file)
    points: set[tuple[int, str, float]] = set()
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            step = row.pop("trainer/global_step")
            points |= {(step, k, float(v)) for k, v in row.items() if not k.startswith("_")}
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates if u.key != "_wandb"})
    return points, config


@wandb_needed
@pytest.mark.parametrize("how", ["name", "object"])
def test_wandb_offline_writes_what_the_csv_logger_writes(tmp_path: Any, monkeypatch: Any, how: str) -> None:
    import wandb

    # wandb reads WANDB_* once per process, at its first setup, and keeps what it read; a test that ran
    # earlier in this process set it up without WANDB_MODE. Start as a fresh process would.
    wandb.teardown()
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "run")
    if how == "name":
        monkeypatch.setenv("WANDB_MODE", "offline")
        trainer = fit(run_dir, ["csv", "wandb"])
        logger = trainer.loggers[1]
    else:
        logger = WandbLogger(name="first", save_dir=str(tmp_path / "wb"), project="proj", offline=True)
        trainer = fit(run_dir, [CSVLogger(run_dir, name=""), logger])
    assert isinstance(logger, WandbLogger) and logger.id
    points, config = wandb_run(logger.save_dir)
    assert points == csv_points(run_dir)
    assert config == csv_hparams(run_dir) == {**HPARAMS}


# --------------------------------------------------------------------------- optional dependency handling


@pytest.mark.parametrize(("cls", "module", "extra"), [(MLFlowLogger, "mlflow", "mlflow"),
                                                      (WandbLogger, "wandb", "wandb")])
def test_a_missing_library_names_the_install_command(monkeypatch: Any, cls: type, module: str,
                                                     extra: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(ImportError, match=rf"pip install polytrain\[{extra}\]"):
        cls()
    with pytest.raises(ImportError, match=rf"pip install polytrain\[{extra}\]"):
        Trainer(logger=module)  # by name: when the Trainer is built, before any process starts


def test_logger_names_are_validated() -> None:
    with pytest.raises(ConfigError, match="tensorboard, csv, mlflow, wandb"):
        Trainer(logger="neptune")


def test_the_libraries_load_only_when_a_value_is_written() -> None:
    code = ("import sys; from polytrain.callbacks import MLFlowLogger, WandbLogger; "
            "from polytrain import Trainer; "
            "found = [m for m in ('mlflow', 'wandb') if __import__('importlib').util.find_spec(m)]; "
            "[{'mlflow': MLFlowLogger, 'wandb': WandbLogger}[m]() for m in found]; "
            "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
