"""Stopping and resuming must be invisible: a resumed run ends BITWISE equal to one that never stopped.

The model has dropout (so every rank's RNG must be restored), trains with Adam (optimizer state)
and two LR schedulers (one stepped per optimizer step, one per epoch), on shuffled data (the
sampler must continue part-way through an epoch). Each resumed run also counts the training
steps it executed itself: equal weights alone would not tell a resume from a silent restart.

One interrupted run ``A`` (max_steps=7, mid-epoch) leaves checkpoints at steps 3 (every-n-steps),
5 (epoch end), 6 (every-n-steps) and 7 (fit end); each is resumed to 15 steps and compared with
the uninterrupted run ``C``. Single-device runs happen in the pytest process, DDP in one spawn.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer, TrainModule
from polytrain.callbacks.model_checkpoint import ModelCheckpoint

pytestmark = pytest.mark.torch_api

TOTAL_STEPS = 15  # 3 epochs of 5 batches
STOP_AT = 7  # mid-way through the second epoch
GLOBAL_BATCH = 8
NUM_SAMPLES = 40


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(NUM_SAMPLES, 6, generator=gen)
    return TensorDataset(x, x[:, :1] - 0.5 * x[:, 2:3] + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=gen))


class DropoutNet(TrainModule):
    def __init__(self, batch_size: int = GLOBAL_BATCH) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.steps_run = 0  # training steps executed by this process for this module

    def configure_model(self) -> None:
        if hasattr(self, "net"):  # idempotent: called again by validate/test
            return
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.02)
        per_step = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        per_epoch = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        return [opt], [{"scheduler": per_step, "interval": "step"}, per_epoch]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=self.batch_size, shuffle=True)


class _Snapshots(Callback):
    """The weights after every optimizer step, by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.by_step[trainer.global_step] = _weights(module)


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _trainer(run_dir: str, ddp: bool, **kwargs: Any) -> Trainer:
    place: dict[str, Any] = dict(strategy="ddp", devices=2) if ddp else dict(strategy="single", devices=1)
    return Trainer(accelerator="cpu", enable_progress_bar=False, logger=False, run_dir=run_dir, seed=3,
                   **place, **kwargs)


def _fit(run_dir: str, ddp: bool, batch_size: int, ckpt_path: str | None = None,
         **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("max_steps", TOTAL_STEPS)
    kwargs.setdefault("enable_checkpointing", False)
    module = DropoutNet(batch_size)
    trainer = _trainer(run_dir, ddp, **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return {"weights": _weights(module), "steps_run": module.steps_run, "global_step": trainer.global_step,
            "lr": trainer.strategy.optimizers[0].param_groups[0]["lr"]}


def _scenario(root: str, ddp: bool, batch_size: int) -> dict[str, Any]:
    """All runs of one strategy; every rank calls it (the DDP runs' collectives stay matched)."""
    rank = int(os.environ.get("RANK", "0"))  # the process group starts with the first fit, not before
    snapshots = _Snapshots()
    out: dict[str, Any] = {"uninterrupted": _fit(os.path.join(root, "C"), ddp, batch_size,
                                                 callbacks=[snapshots])}
    out["uninterrupted"]["by_step"] = snapshots.by_step
    run_a = os.path.join(root, "A")
    saver = ModelCheckpoint(save_last=True, every_n_train_steps=3, save_top_k=-1)
    out["interrupted"] = _fit(run_a, ddp, batch_size, max_steps=STOP_AT, enable_checkpointing=True,
                              callbacks=[saver])
    ckpts = os.path.join(run_a, "version_0", "checkpoints")
    out["files"] = sorted(os.listdir(ckpts))
    out["ckpt_models"] = {step: torch.load(os.path.join(ckpts, name), map_location="cpu",
                                           weights_only=True)["model"]
                          for step, name in ((3, "epoch=0-step=3.ckpt"), (5, "epoch=0-step=5.ckpt"),
                                             (6, "epoch=1-step=6.ckpt"), (7, "last.ckpt"))}
    # Fit-end checkpoint (stopped mid-epoch by max_steps), found through `last`.
    out["resume_last"] = _fit(run_a, ddp, batch_size, ckpt_path="last")
    # Epoch-boundary checkpoint and a mid-epoch every_n_train_steps one, by path.
    out["resume_epoch_end"] = _fit(run_a, ddp, batch_size,
                                   ckpt_path=os.path.join(ckpts, "epoch=0-step=5.ckpt"))
    out["resume_step_6"] = _fit(run_a, ddp, batch_size, ckpt_path=os.path.join(ckpts, "epoch=1-step=6.ckpt"))

    # Tear the newest checkpoint (the one `latest` names; last.ckpt is a hard link to the same
    # file) as a crash or a full disk would: `resume: last` must fall back to step 6.
    if rank == 0:
        with open(os.path.join(ckpts, "latest"), encoding="utf-8") as fh:
            newest = os.path.join(ckpts, fh.read().strip())
        out["torn"] = os.path.basename(newest)
        os.truncate(newest, os.path.getsize(newest) // 2)
    if ddp:
        dist.barrier()  # nobody looks for `last` before rank 0 has torn the file
    out["resume_after_torn"] = _fit(run_a, ddp, batch_size, resume="last")
    return out


def _check_scenario(out: dict[str, Any]) -> None:
    reference = out["uninterrupted"]
    assert reference["global_step"] == TOTAL_STEPS and reference["steps_run"] == TOTAL_STEPS
    assert out["interrupted"]["global_step"] == STOP_AT
    assert ({"epoch=0-step=3.ckpt", "epoch=0-step=5.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"}
            <= set(out["files"]))
    # Each checkpoint holds the model of its step, bitwise: the uninterrupted run's weights after that step.
    for step, model in out["ckpt_models"].items():
        assert model.keys() == reference["by_step"][step].keys()
        for key, value in reference["by_step"][step].items():
            assert torch.equal(model[key], value), (
                f"checkpoint of step {step}: {key} is not the model of that step")
    # The interrupted run really differs from the finished one (else "equal after resume" is empty).
    assert not torch.equal(out["interrupted"]["weights"]["net.0.weight"],
                           reference["weights"]["net.0.weight"])
    expected_steps = {"resume_last": TOTAL_STEPS - STOP_AT, "resume_epoch_end": TOTAL_STEPS - 5,
                      "resume_step_6": TOTAL_STEPS - 6, "resume_after_torn": TOTAL_STEPS - 6}
    for name, steps in expected_steps.items():
        run = out[name]
        assert run["steps_run"] == steps, f"{name} resumed from the wrong place"
        assert run["global_step"] == TOTAL_STEPS, name
        assert run["lr"] == reference["lr"], name
        assert run["weights"].keys() == reference["weights"].keys()
        for key, value in reference["weights"].items():
            assert torch.equal(run["weights"][key], value), (
                f"{name}: {key} differs from the uninterrupted run")


@pytest.mark.timeout(120)
def test_resume_single_device_is_bitwise_identical(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="polytrain"):
        out = _scenario(str(tmp_path), ddp=False, batch_size=GLOBAL_BATCH)
    _check_scenario(out)
    assert out["torn"] == "epoch=1-step=7.ckpt"
    assert any("incomplete or corrupt" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- DDP


def _hand_written_ddp_checkpoints(root: str) -> dict[str, str]:
    """What users bring from outside polytrain: a plain state_dict, and one saved from a DDP wrapper."""
    plain_path, wrapped_path = os.path.join(root, "plain.pt"), os.path.join(root, "ddp_loop.pt")
    torch.manual_seed(1000)  # not the trainer's seed: these weights differ from a fresh init
    model = DropoutNet()
    model.configure_model()
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), plain_path)
    ddp = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _dataset().tensors
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    if dist.get_rank() == 0:
        torch.save(ddp.state_dict(), wrapped_path)  # keys start with "module."
    dist.barrier()
    return {"plain": plain_path, "wrapped": wrapped_path}


def _ddp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out = _scenario(os.path.join(root, "scenario"), ddp=True, batch_size=GLOBAL_BATCH // world_size)
    files = _hand_written_ddp_checkpoints(root)
    for kind, path in files.items():
        module = DropoutNet(GLOBAL_BATCH // world_size)
        # max_steps=0: load, then stop; what the DDP run holds is exactly what the file held.
        _trainer(os.path.join(root, kind), True, max_steps=0,
                 enable_checkpointing=False).fit(module, ckpt_path=path)
        out[f"loaded_{kind}"] = _weights(module)
    out["files_at"] = files
    return out


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("resume_ddp"))
    return root, run_distributed(_ddp_worker, 2, root, timeout=150.0)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_resume_ddp_is_bitwise_identical(ddp_runs: tuple[str, list[dict[str, Any]]]) -> None:
    _, ranks = ddp_runs
    for out in ranks:
        _check_scenario(out)
    assert ranks[0]["torn"] == "epoch=1-step=7.ckpt"
    for key, value in ranks[0]["uninterrupted"]["weights"].items():
        assert torch.equal(ranks[1]["uninterrupted"]["weights"][key], value)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_ddp_checkpoint_loads_into_plain_module(ddp_runs: tuple[str, list[dict[str, Any]]]) -> None:
    root, ranks = ddp_runs
    payload = torch.load(os.path.join(root, "scenario", "A", "version_0", "checkpoints",
                                      "epoch=1-step=6.ckpt"),
                         map_location="cpu", weights_only=True)
    assert not any(k.startswith("module.") for k in payload["model"])
    plain = DropoutNet()
    plain.configure_model()
    plain.load_state_dict(payload["model"])  # strict: same keys, no wrapper prefixes
    # It is the model of that step: bitwise the weights the uninterrupted run had after step 6.
    assert payload["loop"]["global_step"] == 6
    at_step = ranks[0]["uninterrupted"]["by_step"]
    assert sorted(at_step) == list(range(1, TOTAL_STEPS + 1))
    assert payload["model"].keys() == at_step[6].keys()
    for key, value in at_step[6].items():
        assert torch.equal(payload["model"][key], value), (
            f"{key}: checkpoint 'step=6' is not the model of step 6")
    assert not torch.equal(at_step[6]["net.0.weight"], at_step[7]["net.0.weight"])  # neighbours differ


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_plain_and_prefixed_state_dicts_load_into_ddp_run(ddp_runs: tuple[str, list[dict[str, Any]]]) -> None:
    _, ranks = ddp_runs
    plain = torch.load(ranks[0]["files_at"]["plain"], weights_only=True)
    wrapped = torch.load(ranks[0]["files_at"]["wrapped"], weights_only=True)
    assert all(k.startswith("module.") for k in wrapped)
    wrapped = {k.removeprefix("module."): v for k, v in wrapped.items()}
    assert not torch.equal(plain["net.0.weight"], wrapped["net.0.weight"])  # two distinct files
    for out in ranks:
        for kind, expected in (("plain", plain), ("wrapped", wrapped)):
            loaded = out[f"loaded_{kind}"]
            assert loaded.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), f"{kind}: {key}"
