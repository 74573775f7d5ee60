"""CUDA paths: NCCL DDP parity, CUDA AMP with GradScaler, torch's SyncBatchNorm, DataParallel.

Marked ``gpu``: skipped (and reported as skipped) where CUDA is absent, which includes CI.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule

pytestmark = [pytest.mark.torch_api, pytest.mark.gpu]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


class Net(TrainModule):
    def __init__(self, batch_size: int, bn: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16)]
        layers += [torch.nn.BatchNorm1d(16)] if bn else []
        layers += [torch.nn.ReLU(), torch.nn.Linear(16, 3)]
        self.net = torch.nn.Sequential(*layers)
        self.batch_size = batch_size
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning: {"loss": t}
        self.losses.append(float(self.trainer.strategy.reduce(outputs["loss"].detach())))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> Any:
        return DataLoader(_data(), batch_size=self.batch_size, shuffle=True)


def _quiet(tmp: str, **kwargs: Any) -> dict[str, Any]:
    return dict(accelerator="cuda", run_dir=tmp, enable_progress_bar=False, enable_checkpointing=False,
                logger=False, max_epochs=2, **kwargs)


def _ddp_rank(rank: int, world_size: int, tmp: str, bn: bool) -> dict[str, Any]:
    module = Net(batch_size=8, bn=bn)
    strategy = {"name": "ddp", "sync_batchnorm": bn}
    trainer = Trainer(devices=world_size, strategy=strategy, **_quiet(tmp))
    trainer.fit(module)
    out = {"losses": module.losses, "state": {k: v.cpu() for k, v in module.state_dict().items()},
           "backend": torch.distributed.get_backend()}
    if bn:
        out["bn_type"] = type(module.net[1]).__name__
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bn", [False, True], ids=["plain", "sync_batchnorm"])
def test_nccl_ddp_equals_single_gpu(tmp_path: Any, bn: bool) -> None:
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    from distributed import run_distributed

    ranks = run_distributed(_ddp_rank, 2, str(tmp_path / "ddp"), bn, timeout=280)
    single = Net(batch_size=16, bn=bn)
    Trainer(devices=1, strategy="single", **_quiet(str(tmp_path / "single"))).fit(single)
    assert ranks[0]["backend"] == "nccl"
    if bn:
        assert ranks[0]["bn_type"] == "SyncBatchNorm"  # torch's own on CUDA
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single.losses), atol=1e-5,
                               rtol=1e-5)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_cuda_amp_trains_without_non_finite_values(tmp_path: Any, precision: str) -> None:
    module = Net(batch_size=16)
    trainer = Trainer(devices=1, strategy="single", precision=precision, gradient_clip_val=1.0,
                      **_quiet(str(tmp_path)))
    trainer.fit(module)
    assert all(torch.isfinite(torch.tensor(module.losses)))
    assert module.losses[-1] < module.losses[0]
    scaler = trainer.strategy.precision.scaler
    assert (scaler is not None) == (precision == "16-mixed")


@pytest.mark.timeout(120)
def test_data_parallel_splits_the_batch_over_gpus(tmp_path: Any) -> None:
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    dp = Net(batch_size=16)
    Trainer(devices=2, strategy="dp", **_quiet(str(tmp_path / "dp"))).fit(dp)
    single = Net(batch_size=16)
    Trainer(devices=1, strategy="single", **_quiet(str(tmp_path / "single"))).fit(single)
    # The mean of the replicas' mean losses equals the whole batch's mean (equal halves).
    torch.testing.assert_close(torch.tensor(dp.losses), torch.tensor(single.losses), atol=1e-5, rtol=1e-5)


class _SavedWeights(TrainModule):
    """Net's layers; notes its weights (on the CPU) after every optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 3))
        self.at_step: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.at_step[self.global_step] = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return DataLoader(_data(), batch_size=4)


@pytest.mark.timeout(120)
def test_async_checkpoints_on_cuda_hold_the_weights_of_their_step(tmp_path: Any) -> None:
    """CUDA parameters staged into (pinned) CPU memory while training goes on: each file holds the
    weights of its own step, not a later step's."""
    from polytrain.callbacks import ModelCheckpoint

    module = _SavedWeights()
    saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1,
                            async_save=True, every_n_epochs=None)
    trainer = Trainer(devices=1, strategy="single", callbacks=[saver], **{**_quiet(str(tmp_path)),
                                                                          "enable_checkpointing": True})
    trainer.fit(module)
    steps = set()
    for path in sorted(p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("epoch=")):
        payload = torch.load(path, map_location="cpu", weights_only=True)
        step = payload["loop"]["global_step"]
        steps.add(step)
        for name, value in module.at_step[step].items():
            assert torch.equal(payload["model"][name], value), (path.name, name)
    assert set(range(3, 31, 3)) <= steps  # 16 steps per epoch x 2 epochs, every 3rd step
