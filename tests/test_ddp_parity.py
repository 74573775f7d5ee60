"""DDP on 2 gloo ranks with per-rank batch b must train exactly like one process with batch 2b.

The injected ``DistributedSampler`` deals the shuffled permutation round-robin, so global batch k
of the DDP run holds the same samples as batch k of the single run; DDP averages gradients of
per-rank mean losses, which equals the gradient of the global mean loss when the local batches
have equal size. Everything below (plain, gradient accumulation, clipping, sync batch norm) is
compared against the single-device run step by step and on the final weights.

All DDP variants run inside one spawn (process start-up dominates the cost of these tiny runs).
"""

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

pytestmark = pytest.mark.torch_api

PER_RANK_BATCH = 4
WORLD = 2
NUM_SAMPLES = 80  # 10 global batches of 8 per epoch: 2 epochs = 20 optimizer steps
TOL = {"rtol": 0.0, "atol": 1e-6}

# name -> trainer settings shared by the DDP and the single run, whether the model has BatchNorm
# (the DDP run then sets sync_batchnorm) and, where not NUM_SAMPLES, the dataset size.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"trainer": {"max_epochs": 2}, "bn": False},
    # 160 samples: 20 micro-batches per epoch, 10 optimizer steps per epoch, 20 in total.
    "accumulate": {"trainer": {"max_epochs": 2, "accumulate_grad_batches": 2}, "bn": False, "samples": 160},
    # Small enough that every step is clipped (checked below), so clipping really shapes the run.
    "clip": {"trainer": {"max_epochs": 2, "gradient_clip_val": 0.05}, "bn": False},
    "sync_bn": {"trainer": {"max_epochs": 2}, "bn": True},
}


def _dataset(num_samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    # Unit-scale data and losses below 1: float32 rounding (which differs between one mean over 2b
    # samples and two means over b) then stays well under the 1e-6 tolerance.
    x = torch.randn(num_samples, 6, generator=gen)
    y = x[:, :1] * 0.3 - x[:, 1:2] * 0.2 + 0.05 * torch.randn(num_samples, 1, generator=gen)
    return TensorDataset(x, y)


class Regressor(TrainModule):
    def __init__(self, batch_size: int, num_samples: int, bn: bool) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.bn = bn
        self.pre_clip_norms: list[float] = []
        self.post_clip_norms: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "net"):  # idempotent: called again by validate/test
            return
        # Built here, under the trainer's seed, so both runs start from the same weights.
        layers: list[nn.Module] = [nn.Linear(6, 16)]
        if self.bn:
            layers.append(nn.BatchNorm1d(16))
        layers += [nn.Tanh(), nn.Linear(16, 1)]
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        # sync_dist: the logged value is the mean over ranks = the global batch's mean loss.
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def on_after_backward(self) -> None:
        self.pre_clip_norms.append(_grad_norm(self))

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.post_clip_norms.append(_grad_norm(self))  # what the update sees

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(self.num_samples), batch_size=self.batch_size, shuffle=True)


def _grad_norm(module: nn.Module) -> float:
    grads = [p.grad.detach().flatten() for p in module.parameters() if p.grad is not None]
    return float(torch.cat(grads).norm()) if grads else 0.0


class LossRecorder(Callback):
    """Collects what the trainer published for every logged step (every step here)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.losses[step] = metrics["train/loss"]


class AllReduceCounter(Callback):
    """Installs a DDP communication hook that counts the gradient buckets actually all-reduced."""

    def __init__(self) -> None:
        self.calls = 0

    def on_fit_start(self, trainer: Any, module: TrainModule) -> None:
        # Before the first backward; it counts real all-reduces, it does not replace them.
        if isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(None, self.hook)

    # No annotations on bucket/return: DDP checks them against the real classes, and this file's
    # `from __future__ import annotations` would turn them into strings it rejects.
    def hook(self, state: Any, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.calls += 1
        return allreduce_hook(None, bucket)


def _fit(variant: str, run_dir: str, batch_size: int, **trainer_kwargs: Any) -> dict[str, Any]:
    spec = VARIANTS[variant]
    module = Regressor(batch_size, spec.get("samples", NUM_SAMPLES), spec["bn"])
    recorder, counter = LossRecorder(), AllReduceCounter()
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      run_dir=run_dir, log_every_n_steps=1, callbacks=[recorder, counter], seed=0,
                      use_distributed_sampler="always", **spec["trainer"],
                      **trainer_kwargs)
    trainer.fit(module)
    bn_layers = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return {
        "losses": [recorder.losses[s] for s in sorted(recorder.losses)],
        "steps": trainer.global_step,
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "bn_types": [type(m).__name__ for m in bn_layers],
        "pre_clip": module.pre_clip_norms,
        "post_clip": module.post_clip_norms,
        "allreduce_calls": counter.calls,
    }


def _ddp_worker(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    out = {}
    for variant in VARIANTS:
        strategy: Any = {"name": "ddp", "sync_batchnorm": True} if VARIANTS[variant]["bn"] else "ddp"
        out[variant] = _fit(variant, os.path.join(root, f"ddp-{variant}"), PER_RANK_BATCH,
                            strategy=strategy, devices=world_size)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("parity"))
    ddp = run_distributed(_ddp_worker, WORLD, root, timeout=150.0)
    single = {v: _fit(v, os.path.join(root, f"single-{v}"), PER_RANK_BATCH * WORLD, strategy="single",
                      devices=1)
              for v in VARIANTS}
    return {"ddp": ddp, "single": single}


def _check_parity(runs: dict[str, Any], variant: str) -> None:
    single = runs["single"][variant]
    ranks = [r[variant] for r in runs["ddp"]]
    assert single["steps"] == 20
    for rank in ranks:
        assert rank["steps"] == 20
        # One published (rank-averaged) loss per optimizer step, equal on every rank.
        assert len(rank["losses"]) == 20
        assert rank["losses"] == ranks[0]["losses"]
    assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), **TOL)
    # Training moved the weights; parity of a model that never changed would prove nothing.
    assert single["losses"][-1] < single["losses"][0]
    for rank in ranks:
        assert rank["state"].keys() == single["state"].keys()
        for name, value in single["state"].items():
            assert_close(rank["state"][name], value, **TOL, msg=lambda m, n=name: f"{variant} {n}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ddp_matches_single_device(runs: dict[str, Any]) -> None:
    _check_parity(runs, "plain")
    # Without accumulation every step all-reduces (one bucket for this model).
    assert [r["plain"]["allreduce_calls"] for r in runs["ddp"]] == [20, 20]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ddp_gradient_accumulation_matches_single_device(runs: dict[str, Any]) -> None:
    _check_parity(runs, "accumulate")
    # 40 micro-batches, 20 all-reduces: the first micro-batch of each window ran under no_sync.
    assert [r["accumulate"]["allreduce_calls"] for r in runs["ddp"]] == [20, 20]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ddp_gradient_clipping_matches_single_device(runs: dict[str, Any]) -> None:
    _check_parity(runs, "clip")
    for run in [runs["single"]["clip"], *(r["clip"] for r in runs["ddp"])]:
        # Clipping was active on every step and left exactly the requested norm.
        assert min(run["pre_clip"]) > 0.05
        assert_close(torch.tensor(run["post_clip"]), torch.full((20,), 0.05), rtol=1e-5, atol=0.0)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ddp_sync_batchnorm_matches_single_device_running_stats(runs: dict[str, Any]) -> None:
    assert runs["single"]["sync_bn"]["bn_types"] == ["BatchNorm1d"]
    for rank in runs["ddp"]:
        assert rank["sync_bn"]["bn_types"] == ["CrossProcessBatchNorm"]
    _check_parity(runs, "sync_bn")
    single = runs["single"]["sync_bn"]["state"]
    # Stated explicitly: the running statistics are those of the global batch, not of a rank's half.
    for rank in runs["ddp"]:
        for buf in ("net.1.running_mean", "net.1.running_var"):
            assert_close(rank["sync_bn"]["state"][buf], single[buf], **TOL)
        assert int(rank["sync_bn"]["state"]["net.1.num_batches_tracked"]) == 20
    assert not torch.allclose(single["net.1.running_var"], torch.ones(16))  # they did move
