"""``polytrain.loggers`` as Lightning code uses it: the constructors' arguments, ``log_dir``/``version``/
``name``/``save_dir``, ``.experiment`` (the SummaryWriter, the CSV writer, the MLflow client, the W&B
run) reached from a module's step, a stand-in on ranks that do not log, a custom ``Logger`` subclass
written for Lightning, and checkpoints uploaded by ``log_model``. Every test reads what was written back."""

from __future__ import annotations

import csv
import os
from typing import Any

import pytest
import torch
from conftest import TinyModule
from distributed import run_distributed

import polytrain as pl
from polytrain import Trainer
from polytrain.utilities import rank_zero_only

pytestmark = pytest.mark.own_logic


def _kwargs(run_dir: str, **over: Any) -> dict[str, Any]:
    return {**dict(strategy="single", accelerator="cpu", devices=1, run_dir=run_dir,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   log_every_n_steps=1, num_sanity_val_steps=0, max_epochs=1), **over}


class _Drawing(TinyModule):
    """Uses the logger's experiment directly, as Lightning projects do for images and histograms."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.experiment_seen = type(self.logger.experiment).__name__
        self.logger.experiment.add_histogram("weights", self.net.weight.detach(), self.global_step)
        self.logger.experiment.add_image("picture", torch.zeros(1, 4, 4), self.global_step)
        return loss


def _tags(log_dir: str) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"images": 0, "histograms": 0, "scalars": 0})
    acc.Reload()
    return acc.Tags()


def test_lightning_import_paths() -> None:
    from polytrain.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from polytrain.loggers.csv_logs import CSVLogger as Csv
    from polytrain.loggers.logger import Logger as Base
    from polytrain.loggers.logger import rank_zero_experiment
    from polytrain.loggers.mlflow import MLFlowLogger as Mlf
    from polytrain.loggers.tensorboard import TensorBoardLogger as Tb
    from polytrain.loggers.wandb import WandbLogger as Wb

    assert (Csv, Base, Mlf, Tb, Wb) == (CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger)
    assert pl.loggers.TensorBoardLogger is TensorBoardLogger and callable(rank_zero_experiment)
    assert issubclass(TensorBoardLogger, pl.Callback)


def test_tensorboard_logger_with_lightnings_arguments_and_its_experiment(tmp_path: Any, run_dir: str) -> None:
    from polytrain.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir=str(tmp_path), name="exp", version="v7", sub_dir="tb", prefix="p",
                               default_hp_metric=False)
    assert (logger.name, logger.version, logger.save_dir) == ("exp", "v7", str(tmp_path))
    assert logger.root_dir == os.path.join(str(tmp_path), "exp")
    assert logger.log_dir == os.path.join(str(tmp_path), "exp", "v7", "tb")
    trainer = Trainer(**_kwargs(run_dir, logger=logger))
    trainer.fit(_Drawing())
    assert type(logger.experiment).__name__ == "SummaryWriter"
    tags = _tags(logger.log_dir)
    assert "weights" in tags["histograms"] and "picture" in tags["images"]
    assert "p-train/loss" in tags["scalars"] and "hp_metric" not in tags["scalars"]


def test_default_versions_count_up_as_lightnings(tmp_path: Any) -> None:
    from polytrain.loggers import CSVLogger, TensorBoardLogger

    os.makedirs(tmp_path / "lightning_logs" / "version_0")
    os.makedirs(tmp_path / "lightning_logs" / "version_4")
    assert TensorBoardLogger(str(tmp_path)).version == 5
    assert CSVLogger(str(tmp_path)).log_dir == os.path.join(str(tmp_path), "lightning_logs", "version_5")
    assert TensorBoardLogger(str(tmp_path), name="").log_dir == os.path.join(str(tmp_path), "version_0")


def test_csv_logger_experiment_and_files(tmp_path: Any, run_dir: str) -> None:
    from polytrain.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv", flush_logs_every_n_steps=2)

    class Extra(TinyModule):
        def on_train_end(self) -> None:
            self.logger.experiment.log_metrics({"custom": 1.5}, step=99)

    Trainer(**_kwargs(run_dir, logger=logger)).fit(Extra())
    experiment = logger.experiment
    assert experiment.metrics_file_path == os.path.join(logger.log_dir, "metrics.csv")
    with open(experiment.metrics_file_path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    # A row per log_metrics call, as Lightning: four training steps, the validation, the user's own row.
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "4", "99", "4"] and rows[-2]["custom"] == "1.5"
    assert rows[4]["epoch"] == "0" and rows[4]["val/loss"] and not rows[4]["train/loss"]
    assert rows[-1]["goodput/productive_fraction"]  # the fit's goodput, logged when it ended
    assert "train/loss" in rows[0] and rows[0]["epoch"] == "0"


class _Recorder(pl.loggers.Logger):
    """A logger written for Lightning: the abstract names, ``@rank_zero_only`` on its writers."""

    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict[str, float]]] = []
        self.params: dict[str, Any] = {}
        self.statuses: list[str] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        self.params.update(params)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.statuses.append(status)


class _WithHparams(TinyModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def test_hparams_naming_a_class_or_function_are_written_as_lightning_writes_them(tmp_path: Any) -> None:
    from polytrain.core.saving import load_hparams_from_yaml

    from polytrain.callbacks import CSVLogger, TensorBoardLogger

    for logger in (CSVLogger(str(tmp_path / "csv")), TensorBoardLogger(str(tmp_path / "tb"))):
        with pytest.warns(UserWarning, match="Skipping 'module'"):  # an instance is still left out
            logger.log_hyperparams({"rate": 0.3, "layer": torch.nn.BatchNorm1d, "act": torch.relu,
                                    "module": torch.nn.ReLU()})
        back = load_hparams_from_yaml(os.path.join(logger.log_dir, "hparams.yaml"), use_omegaconf=False)
        assert back == {"rate": 0.3, "layer": torch.nn.BatchNorm1d, "act": torch.relu}


def test_a_custom_lightning_logger_receives_metrics_hparams_and_finalize(run_dir: str) -> None:
    recorder = _Recorder()
    Trainer(**_kwargs(run_dir, logger=recorder)).fit(_WithHparams(lr=0.2))
    assert recorder.params == {"lr": 0.2}
    # Per step; the epoch values at the last step, then the fit's goodput.
    assert [step for step, _ in recorder.rows] == [1, 2, 3, 4, 4, 4]
    assert all("epoch" in row for _, row in recorder.rows[:-1]) and "val/loss" in recorder.rows[-2][1]
    assert "goodput/productive_fraction" in recorder.rows[-1][1]
    assert recorder.statuses == ["success"]


def _experiment_on_each_rank(rank: int, world: int, save_dir: str, run_dir: str) -> dict[str, Any]:
    from polytrain.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir, name="ddp")
    trainer = Trainer(**_kwargs(run_dir, strategy="ddp", devices=world, logger=logger))
    module = _Drawing()
    trainer.fit(module)
    return {"experiment": module.experiment_seen, "log_dir": logger.log_dir}


def test_experiment_is_a_stand_in_on_ranks_that_do_not_log(tmp_path: Any, run_dir: str) -> None:
    save_dir = str(tmp_path / "logs")
    results = run_distributed(_experiment_on_each_rank, 2, save_dir, run_dir, timeout=240)
    assert [r["experiment"] for r in results] == ["SummaryWriter", "DummyExperiment"]
    assert {r["log_dir"] for r in results} == {os.path.join(save_dir, "ddp", "version_0")}
    files = os.listdir(os.path.join(save_dir, "ddp", "version_0"))
    assert len([f for f in files if f.startswith("events.out")]) == 1  # rank 1 wrote nothing
    tags = _tags(os.path.join(save_dir, "ddp", "version_0"))
    assert "picture" in tags["images"] and "weights" in tags["histograms"]


def test_mlflow_logger_lightning_arguments_and_log_model(tmp_path: Any, run_dir: str,
                                                         monkeypatch: Any) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store named explicitly (MLflow 3 asks)
    from polytrain.callbacks import ModelCheckpoint
    from polytrain.loggers import MLFlowLogger

    store = "file:" + str(tmp_path / "mlruns")
    logger = MLFlowLogger(experiment_name="lightning_logs", tracking_uri=store, log_model=True, prefix="fit")
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=1)
    Trainer(**_kwargs(run_dir, logger=logger, callbacks=[checkpoint], enable_checkpointing=True,
                      max_epochs=2)).fit(TinyModule())
    client = logger.experiment
    run = client.get_run(logger.version)
    assert logger.name == run.info.experiment_id and run.info.status == "FINISHED"
    assert "fit-train/loss" in run.data.metrics
    uploaded = [a.path for a in client.list_artifacts(logger.version, "model/checkpoints")]
    assert sorted(os.path.basename(p) for p in uploaded) == ["epoch=1-step=8.ckpt"]


def test_wandb_logger_lightning_arguments_offline(tmp_path: Any, run_dir: str, monkeypatch: Any) -> None:
    pytest.importorskip("wandb")
    from polytrain.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(name="first", dir=str(tmp_path / "wb"), version="abc123", project="proj",
                         offline=True, prefix="x")
    Trainer(**_kwargs(run_dir, logger=logger)).fit(TinyModule())
    assert logger.version == "abc123" and logger.save_dir == str(tmp_path / "wb")
    runs = [d for d in os.listdir(tmp_path / "wb" / "wandb") if d.endswith("abc123")]
    assert len(runs) == 1


def test_a_logger_that_does_not_subclass_logger_is_driven_as_one(make_trainer: Any, run_dir: str) -> None:
    """Lightning's interface by duck typing (``log_metrics``, ``log_hyperparams``, ``save``, ``finalize``):
    each call reaches the object, and its other attributes stay its own."""

    class Plain:
        def __init__(self) -> None:
            self.calls: list[tuple[str, Any]] = []
            self.name, self.version, self.save_dir = "plain", "0", run_dir

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.calls.append(("metrics", sorted(metrics)))

        def log_hyperparams(self, params: Any) -> None:
            self.calls.append(("hparams", dict(params)))

        def finalize(self, status: str) -> None:
            self.calls.append(("finalize", status))

    class Saving(TinyModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

    plain = Plain()
    trainer = make_trainer(max_epochs=1, logger=plain, log_every_n_steps=2)
    trainer.fit(Saving(lr=0.05))
    assert trainer.logger.calls is plain.calls and trainer.logger.name == "plain"
    assert plain.calls[0] == ("hparams", {"lr": 0.05}) and plain.calls[-1] == ("finalize", "success")
    assert ("metrics", ["epoch", "train/loss"]) in plain.calls


def test_a_csv_logger_writes_to_a_url_and_the_checkpoints_stay_local(tmp_path: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``CSVLogger(save_dir="<protocol>://...")`` (fsspec's in-memory filesystem standing in for S3): the rows
    and ``hparams.yaml`` go to the URL, versions are numbered there, a later run's logger reads the rows
    back; the run's checkpoints stay under ``default_root_dir``, and nothing local is named after the URL."""
    import fsspec

    from polytrain.callbacks import ModelCheckpoint
    from polytrain.core.errors import ConfigError
    from polytrain.loggers import CSVLogger, TensorBoardLogger

    monkeypatch.chdir(tmp_path)  # a URL written as a local path would appear here
    url = "memory://polytrain-test-logs"
    fs = fsspec.filesystem("memory")
    fs.rm("/polytrain-test-logs", recursive=True) if fs.exists("/polytrain-test-logs") else None
    try:
        run_dir = str(tmp_path / "runs")
        written: dict[int, list[dict[str, str]]] = {}
        for expected_version in (0, 1):
            logger = CSVLogger(save_dir=url, name="exp")
            module = TinyModule(n=8, batch_size=4, val_n=None)
            module.save_hyperparameters({"width": 4})
            trainer = Trainer(**_kwargs(run_dir, enable_checkpointing=True, max_epochs=2),
                              logger=logger, callbacks=[ModelCheckpoint()])
            trainer.fit(module)
            assert logger.version == expected_version
            assert logger.log_dir == f"{url}/exp/version_{expected_version}"
            with fs.open(f"/polytrain-test-logs/exp/version_{expected_version}/metrics.csv") as fh:
                rows = list(csv.DictReader(fh.read().decode().splitlines()))
            assert [int(r["step"]) for r in rows if r.get("train/loss")] == [1, 2, 3, 4]
            written[expected_version] = rows
            with fs.open(f"/polytrain-test-logs/exp/version_{expected_version}/hparams.yaml") as fh:
                assert "width: 4" in fh.read().decode()
            # the checkpoints: under default_root_dir, in a run directory of their own
            assert os.path.isdir(os.path.join(run_dir, f"version_{expected_version}", "checkpoints"))
            assert trainer.log_dir == os.path.join(run_dir, f"version_{expected_version}")
        assert not any(name.startswith("memory") for name in os.listdir(tmp_path))
        # an existing file at the URL is read back, and rows are added after it
        again = CSVLogger(save_dir=url, name="exp", version=0)
        assert len(again.experiment.metrics) == len(written[0])
        with pytest.raises(ConfigError, match=r"TensorBoardLogger\(save_dir='memory://x'\): torch's "
                                              r"SummaryWriter writes event files to a local directory only"):
            TensorBoardLogger(save_dir="memory://x")
    finally:
        fs.rm("/polytrain-test-logs", recursive=True)
