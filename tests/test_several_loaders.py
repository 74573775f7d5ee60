"""Several loaders per stage under every strategy equal one process: training from a dict of loaders
(Lightning's ``CombinedLoader``, ``max_size_cycle``) and validating on a list of two, under ddp x2,
fsdp x2 and a two-stage pipeline; and a fit resumed mid-epoch under ddp x2 ends bitwise where the
uninterrupted one does. The one-process reference reads the order two ranks read together
(``use_distributed_sampler: always``) with the global batch."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer, TrainModule
from polytrain.utilities import CombinedLoader

pytestmark = pytest.mark.torch_api

GLOBAL_BATCH = 8
TOL = {"rtol": 0.0, "atol": 1e-5}


def _data(n: int, features: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    return TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] * 0.25 + 0.05 * torch.randn(n, 1, generator=gen))


class PairedRegressor(TrainModule):
    """Each training batch pairs a batch of ``a`` (48 samples) with one of ``b`` (32, read again from its
    start once it runs out): the net reads both, row by row. Validation reads two loaders of other sizes."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                     nn.Linear(16, 1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        (xa, ya), (xb, yb) = batch["a"], batch["b"]
        loss = F.mse_loss(self.net(torch.cat([xa, xb], dim=1)), ya + yb)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(torch.cat([x, x], dim=1)), 2 * y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> CombinedLoader:
        return CombinedLoader({"a": DataLoader(_data(48, 3, 0), batch_size=self.batch_size, shuffle=True),
                               "b": DataLoader(_data(32, 3, 1), batch_size=self.batch_size, shuffle=True)},
                              "max_size_cycle")

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(_data(12, 3, 2), batch_size=4), DataLoader(_data(10, 3, 3), batch_size=2)]


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.losses[step] = metrics["train/loss"]


def _fit(run_dir: str, strategy: Any, devices: int, batch_size: int, max_steps: int = -1,
         ckpt_path: str | None = None, save_to: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    module, losses = PairedRegressor(batch_size), _Losses()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, run_dir=run_dir, max_epochs=2,
                      max_steps=max_steps, enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, log_every_n_steps=1, callbacks=[losses], seed=0,
                      use_distributed_sampler="always", num_sanity_val_steps=0, timeout=60)
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    state = {k: v.detach().clone() for k, v in trainer.strategy.module_state_dict().items()}
    return {"losses": losses.losses, "steps": trainer.global_step, "state": state,
            "val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
            "num_training_batches": trainer.num_training_batches, "num_val_batches": trainer.num_val_batches}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _fit(str(tmp_path_factory.mktemp("single")), "single", 1, GLOBAL_BATCH)


def _same_as_single(run: dict[str, Any], single: dict[str, Any], pipeline: bool = False,
                    weights: bool = True) -> None:
    assert run["steps"] == single["steps"] == 12  # 6 batches of a per epoch, b read again from its start
    assert run["losses"].keys() == single["losses"].keys()
    assert_close(torch.tensor(list(run["losses"].values())), torch.tensor(list(single["losses"].values())),
                 **TOL)
    assert set(run["val"]) == {"val/loss/dataloader_idx_0", "val/loss/dataloader_idx_1"}
    for name, value in single["val"].items():
        assert run["val"][name] == pytest.approx(value, abs=1e-5), name
    if not weights:
        return
    if not pipeline:  # a pipeline rank holds only its stage's weights
        assert run["state"].keys() == single["state"].keys()
    for name, value in run["state"].items():
        assert_close(value, single["state"][name], **TOL)


def _ddp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    whole = _fit(os.path.join(root, "whole"), "ddp", 2, GLOBAL_BATCH // 2)
    # stopped at step 3 of 6 in the first epoch (b was read once and a half), then resumed from its file
    path = os.path.join(root, "mid.ckpt")
    _fit(os.path.join(root, "first"), "ddp", 2, GLOBAL_BATCH // 2, max_steps=3, save_to=path)
    resumed = _fit(os.path.join(root, "resumed"), "ddp", 2, GLOBAL_BATCH // 2, ckpt_path=path)
    return {"whole": whole, "resumed": resumed}


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_several_loaders_under_ddp_equal_one_process_and_resume_exactly(single: dict[str, Any],
                                                                         tmp_path: Any) -> None:
    runs = run_distributed(_ddp_worker, 2, str(tmp_path), timeout=200)
    for run in runs:
        _same_as_single(run["whole"], single)
        assert run["whole"]["num_training_batches"] == 6 and run["whole"]["num_val_batches"] == [2, 3]
        resumed, whole = run["resumed"], run["whole"]
        assert resumed["steps"] == whole["steps"]
        for step, loss in resumed["losses"].items():  # the steps after the resume, bitwise
            assert loss == whole["losses"][step], step
        for name, value in resumed["state"].items():
            assert torch.equal(value, whole["state"][name]), name
        assert resumed["val"] == whole["val"]


def _fsdp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return _fit(os.path.join(root, "fsdp"), {"name": "fsdp"}, 2, GLOBAL_BATCH // 2)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_several_loaders_under_fsdp_equal_one_process(single: dict[str, Any], tmp_path: Any) -> None:
    rank0, rank1 = run_distributed(_fsdp_worker, 2, str(tmp_path), timeout=200)
    _same_as_single(rank0, single)  # the whole weights, gathered on rank 0
    _same_as_single(rank1, single, weights=False)


def _pipeline_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    strategy = {"name": "parallel", "pp": 2, "schedule": "gpipe", "n_microbatches": 2}
    return _fit(os.path.join(root, "pipeline"), strategy, 2, GLOBAL_BATCH)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_several_loaders_under_a_pipeline_equal_one_process(single: dict[str, Any], tmp_path: Any) -> None:
    """Both stages see what one process saw; each holds its stage's weights, equal to those weights of
    the one-process run."""
    runs = run_distributed(_pipeline_worker, 2, str(tmp_path), timeout=200)
    for run in runs:
        _same_as_single(run, single, pipeline=True)
    assert len(runs[0]["state"]) + len(runs[1]["state"]) == len(single["state"])
