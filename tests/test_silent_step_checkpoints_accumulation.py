"""Step checkpoints under gradient accumulation are taken at optimizer-step boundaries only.

``ModelCheckpoint(every_n_train_steps=3)`` with ``accumulate_grad_batches=2``: a checkpoint taken in
the middle of an accumulation window holds a position (batch) whose gradient it does not hold, so
resuming from it silently drops that gradient; and a step number recurs on every micro-batch of a
window, so a resumed run rewrites a step file with another state. Rules: saves happen right after
an optimizer step, never at step 0; one file name never names two different states.

Reference: a plain PyTorch accumulation loop (``(loss * 0.5).backward()`` per batch, ``step()`` every
second batch), bitwise: the arithmetic is identical.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.callbacks.model_checkpoint import ModelCheckpoint

pytestmark = pytest.mark.own_logic

N, BATCH, ACCUMULATE, EPOCHS, EVERY = 16, 2, 2, 2, 3  # 8 batches = 4 optimizer steps per epoch


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=g))


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


class Regressor(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _build()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH)


def _reference() -> list[dict[str, torch.Tensor]]:
    """Weights after every optimizer step (index 0: the initial weights)."""
    net = _build()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    states = [{f"net.{k}": v.clone() for k, v in net.state_dict().items()}]
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(DataLoader(_data(), batch_size=BATCH)):
            (F.mse_loss(net(x), y) * (1.0 / ACCUMULATE)).backward()
            if (i + 1) % ACCUMULATE == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
                states.append({f"net.{k}": v.clone() for k, v in net.state_dict().items()})
    return states


def _fit(run_dir: str, ckpt_path: str | None = None) -> tuple[Trainer, Regressor]:
    module = Regressor()
    callback = ModelCheckpoint(every_n_train_steps=EVERY, every_n_epochs=None, save_top_k=-1, save_last=False,
                               save_on_fit_end=False)
    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", max_epochs=EPOCHS, logger=False,
                      enable_progress_bar=False, run_dir=run_dir, accumulate_grad_batches=ACCUMULATE,
                      callbacks=[callback])
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def _files(run_dir: str) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "version_0", "checkpoints", "*.ckpt"))):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        out[os.path.basename(path)] = {"model": ckpt["model"], "loop": ckpt["loop"], "path": path}
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(60)
def test_step_checkpoints_sit_on_optimizer_step_boundaries(tmp_path: Any) -> None:
    ref = _reference()
    run_dir = str(tmp_path / "run")
    _fit(run_dir)
    files = _files(run_dir)
    described = {n: (f["loop"]["global_step"], f["loop"]["batch_in_epoch"]) for n, f in files.items()}
    assert sorted(f["loop"]["global_step"] for f in files.values()) == [3, 6], (
        f"expected saves after optimizer steps 3 and 6 only; got (step, batch_in_epoch): {described}")
    for name, f in files.items():
        loop = f["loop"]
        assert loop["batch_in_epoch"] % ACCUMULATE == 0, f"{name} was taken mid-window: {loop}"
        assert _same(f["model"], ref[loop["global_step"]]), name


@pytest.mark.timeout(60)
def test_resuming_from_every_step_checkpoint_matches_and_rewrites_nothing(tmp_path: Any) -> None:
    ref = _reference()
    first = str(tmp_path / "first")
    _fit(first)
    saved = _files(first)
    assert saved
    problems = []
    for name, f in saved.items():
        run_dir = str(tmp_path / f"resume-{name}")
        os.makedirs(os.path.join(run_dir, "version_0", "checkpoints"))
        for other, g in saved.items():  # the resumed run writes next to the files of the first run
            with (open(g["path"], "rb") as src,
                  open(os.path.join(run_dir, "version_0", "checkpoints", other), "wb") as dst):
                dst.write(src.read())
        try:
            _, module = _fit(run_dir, ckpt_path=os.path.join(run_dir, "version_0", "checkpoints", name))
        except Exception as err:  # noqa: BLE001 - reported with the others below
            problems.append(f"resume from {name} ({f['loop']}) failed: {type(err).__name__}: {err}")
            continue
        final = dict(module.state_dict())
        if not _same(final, ref[-1]):
            diffs = {k: float((v - ref[-1][k]).abs().max()) for k, v in final.items()}
            problems.append(f"resumed from {name} ({f['loop']}): final weights differ by {diffs}")
        after = _files(run_dir)
        for other, g in saved.items():
            if not (_same(after[other]["model"], g["model"]) and after[other]["loop"] == g["loop"]):
                problems.append(f"resumed from {name}: {other} was rewritten with another state: "
                                f"{g['loop']} -> {after[other]['loop']}")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(60)
def test_a_run_that_resumes_and_ends_at_once_writes_nothing(tmp_path: Any) -> None:
    """Resumed at step 3 with max_steps=3 and save_on_fit_end: the state at step 3 is the file loaded,
    so no file (not even ``last``) is written again."""
    run_dir = str(tmp_path / "run")
    _fit(run_dir)
    path = os.path.join(run_dir, "version_0", "checkpoints", "epoch=0-step=3.ckpt")
    before = {p: os.stat(p).st_mtime_ns
              for p in glob.glob(os.path.join(run_dir, "version_0", "checkpoints", "*"))}
    module = Regressor()
    callback = ModelCheckpoint(every_n_train_steps=EVERY, every_n_epochs=None, save_top_k=-1, save_last=True,
                               save_on_fit_end=True)
    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", max_steps=3, logger=False,
                      enable_progress_bar=False, run_dir=run_dir, accumulate_grad_batches=ACCUMULATE,
                      callbacks=[callback])
    trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 3
    after = {p: os.stat(p).st_mtime_ns
             for p in glob.glob(os.path.join(run_dir, "version_0", "checkpoints", "*"))}
    assert after == before, (
        f"a resume that took no step wrote {sorted(set(after.items()) - set(before.items()))}")
