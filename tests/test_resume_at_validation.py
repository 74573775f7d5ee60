"""A step checkpoint that lands on a mid-epoch validation resumes exactly.

With ``val_check_interval=0.5`` and ``ModelCheckpoint(every_n_train_steps=4)`` on an 8-batch epoch, every
step checkpoint coincides with a validation. Lightning's order is kept: the step checkpoint is written
after the validation at its step, so the file holds that validation's metrics and the random state after
it; resuming continues with the next batch and runs every later validation at the same step, with the
same value, ending on the uninterrupted run's weights bitwise (dropout and shuffling draw from the
streams the validation's loader also draws from). A checkpoint taken *between* a batch and its
validation (a user's own callback saving in ``on_train_batch_end``) resumes exactly too: the loop
state records that the validation is still due, and the resumed run runs it first.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule
from distributed import run_distributed

from polytrain import Callback, Trainer
from polytrain.callbacks import ModelCheckpoint

pytestmark = pytest.mark.own_logic

EPOCHS = 3
BATCHES = 8  # per epoch and rank: 32 samples, batch 4 (per rank)


class DropoutModule(TinyModule):
    """Dropout and a shuffled loader draw from the global stream; every validation's loader iterator
    draws its base seed from it too, so a validation skipped or repeated on resume changes the weights."""

    def __init__(self, devices: int = 1) -> None:
        torch.manual_seed(0)
        super().__init__(n=32 * devices, batch_size=4, shuffle=True, val_n=8)
        self.drop = torch.nn.Dropout(0.5)
        self.validations: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.net(self.drop(x)), y)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("val/loss", loss, sync_dist=True)
        return loss

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validations.append((self.trainer.global_step,
                                     float(self.trainer.callback_metrics["val/loss"])))


class SaveBeforeValidation(Callback):
    """A user's own save in ``on_train_batch_end``: before the validation that follows this batch."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _trainer(run_dir: str, devices: int, callbacks: list[Any], **kwargs: Any) -> Trainer:
    strategy = "single" if devices == 1 else "ddp"
    return Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=EPOCHS, run_dir=run_dir,
                   val_check_interval=0.5, callbacks=callbacks, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, seed=None if devices == 1 else 0,
                   timeout=60, **kwargs)


def _weights(module: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.net.parameters()])


def _whole_and_resumed(root: str, devices: int, resume_step: int, user_save: bool) -> dict[str, Any]:
    """The uninterrupted run (which writes the checkpoints), then a fresh run resumed from the step
    ``resume_step`` file; weights and validations of both."""
    torch.manual_seed(0)
    whole_dir = os.path.join(root, "whole")
    saved = os.path.join(root, "before-validation.ckpt")
    callbacks: list[Any] = [ModelCheckpoint(every_n_train_steps=4, save_top_k=-1, every_n_epochs=None)]
    if user_save:
        callbacks.append(SaveBeforeValidation(resume_step, saved))
    module = DropoutModule(devices)
    _trainer(whole_dir, devices, callbacks).fit(module)
    whole = (_weights(module), module.validations)
    ckpt_dir = os.path.join(whole_dir, "version_0", "checkpoints")
    files = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("epoch="))
    path = saved if user_save else os.path.join(
        ckpt_dir, next(f for f in files if f.endswith(f"step={resume_step}.ckpt")))
    meta = torch.load(path, weights_only=True)
    torch.manual_seed(123)  # the resumed run's own stream must not matter: the checkpoint restores it
    resumed_module = DropoutModule(devices)
    resumed = _trainer(os.path.join(root, "resumed"), devices, [])
    resumed.fit(resumed_module, ckpt_path=path)
    return {"whole": whole, "resumed": (_weights(resumed_module), resumed_module.validations), "files": files,
            "loop": meta["loop"], "metrics": sorted(meta["callbacks"]) if "callbacks" in meta else None}


def _check(out: dict[str, Any], resume_step: int) -> None:
    (whole_w, whole_v), (resumed_w, resumed_v) = out["whole"], out["resumed"]
    expected_saves = [f"epoch={s // BATCHES}-step={s}.ckpt" for s in range(4, EPOCHS * BATCHES + 1, 4)]
    # The epoch-end validation's step file is named after the epoch it closes.
    assert all(any(f.endswith(f"step={s}.ckpt") for f in out["files"])
               for s in range(4, EPOCHS * BATCHES + 1, 4)), (out["files"], expected_saves)
    later = [v for v in whole_v if v[0] > resume_step]
    assert resumed_v == later, (
        f"validations after step {resume_step}: resumed {resumed_v}, uninterrupted {later}")
    assert torch.equal(resumed_w, whole_w), f"weights differ by {(resumed_w - whole_w).abs().max().item()}"


@pytest.mark.parametrize("resume_step", [12, 8])  # mid-epoch validation; the epoch-end one
def test_step_checkpoint_on_a_validation_resumes_exactly(tmp_path: Any, resume_step: int) -> None:
    out = _whole_and_resumed(str(tmp_path), 1, resume_step, user_save=False)
    _check(out, resume_step)


def test_step_checkpoint_is_written_after_the_validation_at_its_step(tmp_path: Any) -> None:
    """Lightning's order: the file taken at a validation step resumes after that validation (it is not run
    again) and already ranks by its value."""
    out = _whole_and_resumed(str(tmp_path), 1, 12, user_save=False)
    assert out["loop"]["global_step"] == 12 and out["loop"]["batch_in_epoch"] == 4
    assert out["loop"]["validation_due"] is False


def test_a_save_before_the_validation_resumes_with_that_validation_first(tmp_path: Any) -> None:
    out = _whole_and_resumed(str(tmp_path), 1, 12, user_save=True)
    assert out["loop"]["validation_due"] is True
    _check(out, 12 - 1)  # the resumed run runs the validation at step 12 itself


def _plain_pytorch() -> tuple[torch.Tensor, list[tuple[int, float]]]:
    """The uninterrupted run written by hand: the same module, loaders and SGD; a validation (the whole
    validation loader, without gradients, its sample-weighted mean loss) after every fourth batch."""
    torch.manual_seed(0)
    module = DropoutModule()
    optimizer = torch.optim.SGD(module.parameters(), lr=module.lr)
    train, val = module.train_dataloader(), module.val_dataloader()
    validations, step = [], 0
    for _ in range(EPOCHS):
        module.train()
        for i, (x, y) in enumerate(train):
            F.mse_loss(module.net(module.drop(x)), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if (i + 1) % (BATCHES // 2) == 0:
                module.eval()
                with torch.no_grad():
                    total = sum(F.mse_loss(module.net(xv), yv) * float(len(xv)) for xv, yv in val)
                validations.append((step, float(total / torch.tensor(float(len(val.dataset))))))
                module.train()
    return _weights(module), validations


def test_the_uninterrupted_run_is_a_plain_pytorch_loop(tmp_path: Any) -> None:
    """The reference of the resume tests is itself checked against plain PyTorch: same weights bitwise,
    the same validations at the same steps (every validation's loader draws from the one stream)."""
    out = _whole_and_resumed(str(tmp_path), 1, 12, user_save=False)
    weights, validations = _plain_pytorch()
    assert torch.equal(out["whole"][0], weights), (out["whole"][0] - weights).abs().max()
    assert [s for s, _ in out["whole"][1]] == [s for s, _ in validations]
    torch.testing.assert_close(torch.tensor([v for _, v in out["whole"][1]]),
                               torch.tensor([v for _, v in validations]), rtol=1e-6, atol=0)


def _ddp_worker(rank: int, world_size: int, root: str, resume_step: int) -> Any:
    out = _whole_and_resumed(root, world_size, resume_step, user_save=False)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_step_checkpoint_on_a_validation_resumes_exactly_under_ddp(tmp_path: Any) -> None:
    ranks = run_distributed(_ddp_worker, 2, str(tmp_path), 12, timeout=240)
    for out in ranks:
        _check(out, 12)
