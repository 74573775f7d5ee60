"""The non-finite guard's check under ``nan_policy: error``, path by path.

Each scalar loss goes into a slot of a device buffer as ``0 * loss`` (0 while the loss is finite,
NaN for an inf or NaN one); losses that fit no slot (a vector returned under manual optimisation)
are kept and stacked at the check instead. Logging steps test the losses; parameters are tested before every
checkpoint and at the end of the fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TinyModule

from polytrain import Callback
from polytrain.trainer.loops.guards import NonFiniteError

pytestmark = pytest.mark.own_logic

MakeTrainer = Callable[..., Any]


class LossAt(TinyModule):
    """The loss becomes ``transform(loss)`` on the given batch indices (epoch 0)."""

    def __init__(self, at: set[int], transform: Callable[[torch.Tensor], torch.Tensor],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at, self.transform = at, transform
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(batch_idx)
        loss = super().training_step(batch, batch_idx)
        return self.transform(loss) if batch_idx in self.at else loss


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_an_infinite_or_nan_loss_is_named_at_the_next_logging_step(make_trainer: MakeTrainer,
                                                                   bad: float) -> None:
    # batch 3 is bad; the first check after it is the logging step at step 4 (log_every_n_steps=4)
    module = LossAt({3}, lambda loss: loss * bad, n=40, batch_size=4, val_n=None)
    with pytest.raises(NonFiniteError, match="non-finite loss at step 3 on rank"):
        make_trainer(max_epochs=1, log_every_n_steps=4).fit(module)
    assert module.seen == [0, 1, 2, 3]


def test_more_losses_than_slots_between_checks(make_trainer: MakeTrainer, monkeypatch: Any) -> None:
    # Slot buffers of 4: by the check at step 8, two full buffers were set aside; the NaN is in the second.
    from polytrain.trainer.loops.guards import NonFiniteGuard

    monkeypatch.setattr(NonFiniteGuard, "FOLD_EVERY", 4)
    module = LossAt({6}, lambda loss: loss * float("nan"), n=40, batch_size=4, val_n=None)
    with pytest.raises(NonFiniteError, match="non-finite loss at step 6 on rank"):
        make_trainer(max_epochs=1, log_every_n_steps=9).fit(module)
    assert module.seen == list(range(9))


def test_large_finite_losses_are_not_taken_for_infinite_ones(make_trainer: MakeTrainer) -> None:
    # Ten losses of 3e38 would sum past float32's largest value: the check must not add the values.
    # The offset is a constant, so the gradients, and the weights, stay those of the plain loss.
    module = LossAt(set(range(10)), lambda loss: loss + 3e38, n=40, batch_size=4, val_n=None)
    trainer = make_trainer(max_epochs=1, log_every_n_steps=10)
    trainer.fit(module)
    assert module.seen == list(range(10)) and trainer.global_step == 10


class ManualVectorLoss(TinyModule):
    """Manual optimisation returning a per-sample loss vector, NaN in one element at batch ``at``."""

    def __init__(self, at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        per_sample = ((self(x) - y) ** 2).mean(dim=1)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(per_sample.mean())
        opt.step()
        if batch_idx == self.at:
            per_sample = per_sample.detach().clone()
            per_sample[1] = float("nan")
        return {"loss": per_sample}


def test_a_loss_that_fits_no_slot_is_still_checked(make_trainer: MakeTrainer) -> None:
    module = ManualVectorLoss(at=5, n=40, batch_size=4, val_n=None)
    trainer = make_trainer(max_epochs=1, log_every_n_steps=4)
    with pytest.raises(NonFiniteError, match="non-finite loss at step 5 on rank"):
        trainer.fit(module)
    assert not trainer.guard._slotted  # the vector fits no slot: the check stacked the kept losses


class UnusedParameter(TinyModule):
    """A parameter the loss never reads, set to NaN after batch ``at``: only the parameter check sees it."""

    def __init__(self, at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unused = torch.nn.Parameter(torch.zeros(3))
        self.at = at

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            with torch.no_grad():
                self.unused[0] = float("nan")


def test_parameters_are_checked_at_the_end_of_the_fit(make_trainer: MakeTrainer) -> None:
    # Logging every step: those checks test the losses (all finite); the fit's last check finds the parameter.
    module = UnusedParameter(at=2, n=40, batch_size=4, val_n=None)
    trainer = make_trainer(max_epochs=1, log_every_n_steps=1)
    with pytest.raises(NonFiniteError, match="non-finite parameters on rank"):
        trainer.fit(module)
    assert trainer.global_step == 10  # every batch ran: no logging step stopped it


class Saves(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.steps.append(trainer.global_step)


def test_parameters_are_checked_before_every_checkpoint(make_trainer: MakeTrainer, run_dir: str) -> None:
    from polytrain.callbacks import ModelCheckpoint

    module = UnusedParameter(at=2, n=40, batch_size=4, val_n=None)
    saves = Saves()
    trainer = make_trainer(max_epochs=1, log_every_n_steps=50, callbacks=[
        ModelCheckpoint(save_last=True, every_n_train_steps=1, save_top_k=-1), saves])
    with pytest.raises(NonFiniteError, match="non-finite parameters on rank"):
        trainer.fit(module)
    # Batch 2 is step 3: its checkpoint was written (callbacks' batch-end hooks run before the module's,
    # which then made the parameter NaN); step 4's was refused.
    assert saves.steps == [1, 2, 3]
    last = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"), weights_only=True)
    assert last["loop"]["global_step"] == 3
    assert all(torch.isfinite(t).all() for t in last["model"].values())


def test_a_dtensor_loss_is_checked_through_its_local_part() -> None:
    # A DTensor loss (one left distributed by tensor parallelism) can neither be added into a plain slot
    # (torch asserts instead of raising) nor read with tolist(): its local part is checked instead.
    from types import SimpleNamespace

    import torch.distributed as dist
    from distributed import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from polytrain.trainer.loops.guards import NonFiniteGuard
    from polytrain.trainer.loops.progress import FitProgress

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        strategy = SimpleNamespace(collective_device=torch.device("cpu"))
        guard = NonFiniteGuard("error", strategy, torch.nn.Linear(2, 1), FitProgress())
        guard.observe(torch.tensor(1.0))
        guard.observe(torch.tensor(2.0))
        guard.observe(distribute_tensor(torch.tensor(float("nan")), mesh, [Replicate()]))
        assert guard._slotted and guard._slot_steps == [0, 1, 2] and not guard._pending
        with pytest.raises(NonFiniteError, match="non-finite loss at step 2 on rank"):
            guard.check(parameters=False)
    finally:
        dist.destroy_process_group()
