"""DDP on 2 real gloo ranks, beyond parity: every ``strategy: ddp`` option reaches the
``DistributedDataParallel`` object and keeps the run equal to a plain PyTorch loop on the global batch;
EarlyStopping and a monitored ModelCheckpoint decide the same on both ranks; test/predict over an
uneven split see every sample once; TensorBoard/CSV are written by rank 0 only; ThroughputMonitor
logs sane global rates. One spawn runs all of it (process start-up dominates these tiny runs).
"""

from __future__ import annotations

import csv
import os
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer, TrainModule
from polytrain.callbacks import EarlyStopping, ModelCheckpoint, ThroughputMonitor

pytestmark = pytest.mark.torch_api

PER_RANK_BATCH = 4
NUM_SAMPLES = 32  # 4 global batches of 8 per epoch
EPOCHS = 2
LR = 0.1


def dataset(n: int = NUM_SAMPLES, seed: int = 5) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    return TensorDataset(x, x[:, :1] * 0.7 - x[:, 3:] * 0.4)


class Branchy(TrainModule):
    """Two-layer regressor plus an ``extra`` head that forward uses only when ``use_extra``."""

    def __init__(self, use_extra: bool = True, val_values: list[list[float]] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.extra = nn.Linear(4, 1)
        self.use_extra, self.val_values = use_extra, val_values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + (0.5 * self.extra(x) if self.use_extra else 0.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # A per-rank value per epoch (not synchronised by the user): the callbacks must still agree.
        self.log("val_metric", torch.tensor(self.val_values[self.global_rank][self.current_epoch]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test/loss", F.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.cat([batch[0][:, :1], self(batch[0])], dim=1)  # (sample id, prediction)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=PER_RANK_BATCH)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(8, seed=6), batch_size=PER_RANK_BATCH)


def plain_reference(use_extra: bool) -> dict[str, torch.Tensor]:
    """What the run must equal: one process, plain PyTorch, the global batch (2 x per-rank)."""
    model = Branchy(use_extra)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for x, y in DataLoader(dataset(), batch_size=2 * PER_RANK_BATCH):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trainer(root: str, strategy: dict[str, Any], **kwargs: Any) -> Trainer:
    settings = dict(accelerator="cpu", devices=2, run_dir=root, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, log_every_n_steps=1, num_sanity_val_steps=0,
                    max_epochs=EPOCHS, limit_val_batches=0)
    return Trainer(strategy={"name": "ddp", **strategy}, **{**settings, **kwargs})


OPTION_RUNS: dict[str, tuple[dict[str, Any], bool]] = {  # name -> (ddp options, use_extra)
    "defaults": ({}, True),
    "find_unused": ({"find_unused_parameters": True}, False),
    "static_graph": ({"static_graph": True}, True),
    "buckets": ({"bucket_cap_mb": 0.0001, "gradient_as_bucket_view": True, "broadcast_buffers": False}, True),
}


def _ddp_attrs(ddp: nn.parallel.DistributedDataParallel) -> dict[str, Any]:
    return {"type": type(ddp).__name__, "find_unused_parameters": ddp.find_unused_parameters,
            "static_graph": ddp.static_graph, "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "broadcast_buffers": ddp.broadcast_buffers}


def _callbacks_run(root: str) -> dict[str, Any]:
    # Rank-mean val_metric per epoch: [2, 1, 1.5, ...]: best at epoch 1, no improvement at epoch 2,
    # so patience=1 stops after epoch 2. Rank 1 alone ([1, 2, 0]) would stop after epoch 1 with its
    # best at epoch 0; rank 0 alone ([3, 0, 3]) agrees with the mean. Disagreement would hang or split.
    values = [[3.0, 0.0, 3.0, 0.0, 0.0], [1.0, 2.0, 0.0, 0.0, 0.0]]
    saver = ModelCheckpoint(monitor="val_metric", mode="min", save_top_k=1)
    trainer = _trainer(root, {}, max_epochs=5, limit_val_batches=None, enable_checkpointing=True,
                       callbacks=[EarlyStopping("val_metric", patience=1, mode="min", verbose=False), saver])
    trainer.fit(Branchy(val_values=values))
    return {"epoch": trainer.current_epoch, "step": trainer.global_step, "best": saver.best_model_path,
            "best_score": float(saver.best_model_score),
            "files": sorted(os.listdir(os.path.join(root, "version_0", "checkpoints")))}


def _eval_run(root: str) -> dict[str, Any]:
    # 5 samples, batch 2: rank 0 gets samples 0, 2, 4, rank 1 samples 1, 3 (no padding duplicate).
    ids = torch.arange(5, dtype=torch.float32).unsqueeze(1)
    data = TensorDataset(torch.cat([ids, torch.randn(5, 3, generator=torch.Generator().manual_seed(3))], 1),
                         torch.randn(5, 1, generator=torch.Generator().manual_seed(4)))
    module = Branchy()
    trainer = _trainer(root, {})
    test = trainer.test(module, dataloaders=DataLoader(data, batch_size=2))[0]["test/loss"]
    preds = trainer.predict(module, dataloaders=DataLoader(data, batch_size=2))
    return {"test": float(test), "preds": torch.cat(preds).tolist(),
            "data": [t.tolist() for t in data.tensors]}


class _EpochClock(Callback):
    """Seconds from each epoch's start to its last batch's end, summed: the span ThroughputMonitor times."""

    def __init__(self) -> None:
        self.seconds, self._start, self._last = 0.0, 0.0, 0.0

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self._start = self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._last = time.perf_counter()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.seconds += self._last - self._start


def _logging_run(root: str) -> dict[str, Any]:
    clock = _EpochClock()
    trainer = _trainer(root, {}, logger=["tensorboard", "csv"], callbacks=[ThroughputMonitor(), clock])
    trainer.fit(Branchy())
    return {"train_seconds": clock.seconds, "logging_rank": trainer.is_logging_rank}


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (options, use_extra) in OPTION_RUNS.items():
        module = Branchy(use_extra)
        trainer = _trainer(os.path.join(root, name), options)
        trainer.fit(module)
        out[name] = {"ddp": _ddp_attrs(trainer.strategy.model),
                     "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    out["callbacks"] = _callbacks_run(os.path.join(root, "callbacks"))
    out["eval"] = _eval_run(os.path.join(root, "eval"))
    out["logging"] = _logging_run(os.path.join(root, "logging"))
    # Last, as it breaks the run: an unused parameter without find_unused_parameters is DDP's error.
    try:
        _trainer(os.path.join(root, "unused"), {}).fit(Branchy(use_extra=False))
        out["unused_error"] = None
    except RuntimeError as err:
        out["unused_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("ddp_behaviours"))
    return root, run_distributed(_worker, 2, root, timeout=240.0)


TOL = {"rtol": 0.0, "atol": 1e-6}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(OPTION_RUNS))
def test_ddp_options_reach_distributed_data_parallel_and_keep_parity(ranks: Any, name: str) -> None:
    _, results = ranks
    options, use_extra = OPTION_RUNS[name]
    expected = {"type": "DistributedDataParallel", "find_unused_parameters": False, "static_graph": False,
                "bucket_bytes_cap": int(25 * 1024 * 1024), "gradient_as_bucket_view": False,
                "broadcast_buffers": True}
    expected.update({k: v for k, v in options.items() if k != "bucket_cap_mb"})
    if "bucket_cap_mb" in options:
        expected["bucket_bytes_cap"] = int(options["bucket_cap_mb"] * 1024 * 1024)
    reference = plain_reference(use_extra)
    for rank, result in enumerate(results):
        assert result[name]["ddp"] == expected, f"rank {rank}"
        for key, value in reference.items():
            assert_close(result[name]["state"][key], value, **TOL,
                         msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")
    if not use_extra:  # the unused head really received no update
        assert torch.equal(results[0][name]["state"]["extra.weight"], Branchy().extra.weight.detach())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_unused_parameter_without_find_unused_parameters_is_ddps_error(ranks: Any) -> None:
    _, results = ranks
    for result in results:
        assert result["unused_error"] is not None and "find_unused_parameters" in result["unused_error"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_early_stopping_and_monitored_checkpoint_agree_across_ranks(ranks: Any) -> None:
    root, results = ranks
    rank0, rank1 = (r["callbacks"] for r in results)
    assert rank0 == rank1  # same stop, same best path and score, same files: no rank went its own way
    assert rank0["step"] == 3 * (NUM_SAMPLES // (2 * PER_RANK_BATCH))  # stopped after epoch 2 of 5
    assert rank0["best_score"] == pytest.approx(1.0)
    assert os.path.basename(rank0["best"]).startswith("epoch=1-") and os.path.isfile(rank0["best"])
    assert os.path.basename(rank0["best"]) in rank0["files"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_test_and_predict_over_an_uneven_split_see_every_sample_once(ranks: Any) -> None:
    _, results = ranks
    x, y = (torch.tensor(t) for t in results[0]["eval"]["data"])
    model = Branchy()  # test/predict without fit: the initial weights, as on every rank
    with torch.no_grad():
        expected_loss = float(F.mse_loss(model(x), y))  # the mean over all 5 samples, not per-rank means
        expected_preds = model(x)[:, 0]
    for result in results:
        assert result["eval"]["test"] == pytest.approx(expected_loss, abs=1e-6)
    preds = torch.tensor(results[0]["eval"]["preds"] + results[1]["eval"]["preds"])
    assert sorted(int(i) for i in preds[:, 0]) == [0, 1, 2, 3, 4]  # none missing, none duplicated
    assert_close(preds[:, 1], expected_preds[preds[:, 0].long()], **TOL)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_loggers_write_on_rank_zero_only_and_throughput_is_global(ranks: Any) -> None:
    root, results = ranks
    assert [r["logging"]["logging_rank"] for r in results] == [True, False]
    run_dir = os.path.join(root, "logging")
    events = [n for n in os.listdir(os.path.join(run_dir, "version_0"))
              if n.startswith("events.out.tfevents")]
    assert len(events) == 1, events  # a second writer (rank 1) would add its own file
    with open(os.path.join(run_dir, "version_0", "metrics.csv"), newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    steps = EPOCHS * NUM_SAMPLES // (2 * PER_RANK_BATCH)
    # One row per step (the default logger's layout): the loop's loss and the throughput monitor's rate
    # together, the fit's goodput on the last; a second writer (rank 1) would add rows of its own.
    throughput = [r for r in rows if r.get("throughput/samples_per_sec")]
    goodput = [r for r in rows if r.get("goodput/productive_fraction")]
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    assert all(r["train/loss"] for r in rows) and [int(r["step"]) for r in goodput] == [steps]
    assert [int(r["step"]) for r in throughput] == list(range(1, steps + 1))
    rates = [float(r["throughput/samples_per_sec"]) for r in throughput]
    assert len(rates) == steps
    # Global samples per second, logged every step: each step's interval holds 2 x 4 samples, so
    # 8 / rate is that interval's length, and the intervals tile each epoch from its start to its last
    # batch (less the logging calls between them). A per-rank rate (no x dp_size) would double the sum;
    # a wrong unit would shrink or inflate it by orders of magnitude.
    intervals = sum(2 * PER_RANK_BATCH / r for r in rates)
    epochs_seconds = results[0]["logging"]["train_seconds"]
    # measured: 0.99 of the epochs' span on 2.11 and 2.15 (the rest is the logging calls themselves)
    assert 0.5 * epochs_seconds <= intervals <= 1.05 * epochs_seconds, (intervals, epochs_seconds, rates)
