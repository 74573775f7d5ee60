"""The fit/validate/test/predict loops on the ``single`` strategy, in one process."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_dataset
from torch.utils.data import DataLoader

from polytrain import Callback, TrainModule
from polytrain.trainer.api.optimizer_config import parse_optimizers
from polytrain.trainer.configuration.config import ConfigError
from polytrain.trainer.loops.guards import EmptyDataError, NonFiniteError

pytestmark = pytest.mark.own_logic

MakeTrainer = Callable[..., Any]


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class LogRecorder(Callback):
    """Every (step, metrics) pair the loop publishes to callbacks."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        self.logs.append((step, dict(metrics)))

    def names(self) -> list[set[str]]:
        return [set(m) for _, m in self.logs]


# --------------------------------------------------------------------------- hook order


class HookRecorder(TinyModule):
    def __init__(self, calls: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = calls

    def configure_model(self) -> None:
        self.calls.append("configure_model")

    def configure_optimizers(self) -> Any:
        self.calls.append("configure_optimizers")
        return super().configure_optimizers()

    def on_fit_start(self) -> None:
        self.calls.append("on_fit_start")

    def on_train_epoch_start(self) -> None:
        self.calls.append("on_train_epoch_start")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls.append("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.calls.append("on_before_backward")

    def on_after_backward(self) -> None:
        self.calls.append("on_after_backward")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("on_before_optimizer_step")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls.append("on_train_batch_end")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls.append("validation_step")
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self.calls.append("on_validation_epoch_end")

    def on_train_epoch_end(self) -> None:
        self.calls.append("on_train_epoch_end")

    def on_fit_end(self) -> None:
        self.calls.append("on_fit_end")


class CallbackRecorder(Callback):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self.calls.append(f"cb.setup:{stage}")

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.calls.append("cb.on_fit_start")

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self.calls.append("cb.on_validation_start")

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self.calls.append("cb.on_validation_end")

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.calls.append("cb.on_train_epoch_end")

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self.calls.append("cb.on_fit_end")

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        self.calls.append(f"cb.teardown:{stage}")


def test_fit_hook_order(make_trainer: MakeTrainer) -> None:
    calls: list[str] = []
    module = HookRecorder(calls, n=8, batch_size=4, val_n=4)  # 2 train batches, 1 val batch
    make_trainer(max_epochs=1, num_sanity_val_steps=2).fit(module)
    step = ["training_step", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
            "on_train_batch_end"]
    # Lightning's order: a sanity check (2 batches at most) before the first epoch.
    assert calls == [
        "configure_model", "configure_optimizers", "on_fit_start",
        "validation_step", "on_validation_epoch_end",
        "on_train_epoch_start", *step, *step,
        "validation_step", "on_validation_epoch_end", "on_train_epoch_end", "on_fit_end",
    ]


def test_callback_hooks_interleave_with_module_hooks(make_trainer: MakeTrainer) -> None:
    calls: list[str] = []
    module = HookRecorder(calls, n=4, batch_size=4, val_n=4)
    make_trainer(max_epochs=1, callbacks=[CallbackRecorder(calls)]).fit(module)
    kept = [c for c in calls if c.startswith("cb.") or c in ("on_fit_start", "validation_step",
                                                             "on_train_epoch_end", "on_fit_end")]
    assert kept == [
        "cb.setup:fit", "cb.on_fit_start", "on_fit_start",  # callbacks before the module's hook
        "cb.on_validation_start", "validation_step", "cb.on_validation_end",
        "cb.on_train_epoch_end", "on_train_epoch_end", "cb.on_fit_end", "on_fit_end", "cb.teardown:fit",
    ]


def test_accumulation_calls_optimizer_hook_once_per_window(make_trainer: MakeTrainer) -> None:
    calls: list[str] = []
    module = HookRecorder(calls, n=20, batch_size=4, val_n=None)  # 5 batches: windows of 2, 2, 1
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(module)
    assert calls.count("training_step") == 5
    assert calls.count("on_before_optimizer_step") == 3
    assert trainer.global_step == 3


# --------------------------------------------------------------------------- accumulation


class MomentumModule(TinyModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def test_accumulation_equals_one_step_on_double_batch(make_trainer: MakeTrainer) -> None:
    accumulated = MomentumModule(n=32, batch_size=4, lr=0.05, val_n=None)
    big = MomentumModule(n=32, batch_size=8, lr=0.05, val_n=None)
    big.load_state_dict(accumulated.state_dict())
    start = params_of(big)

    t_acc = make_trainer(max_epochs=2, accumulate_grad_batches=2)
    t_acc.fit(accumulated)
    t_big = make_trainer(max_epochs=2)
    t_big.fit(big)

    assert t_acc.global_step == t_big.global_step == 8  # optimizer steps, not micro-batches
    assert not same(params_of(big), start)
    for a, b in zip(accumulated.parameters(), big.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_without_accumulation_small_batches_differ(make_trainer: MakeTrainer) -> None:
    # Guards the test above: batch b with one step per batch is *not* the same as batch 2b.
    small = MomentumModule(n=32, batch_size=4, lr=0.05, val_n=None)
    big = MomentumModule(n=32, batch_size=8, lr=0.05, val_n=None)
    big.load_state_dict(small.state_dict())
    make_trainer(max_epochs=1).fit(small)
    make_trainer(max_epochs=1).fit(big)
    assert not torch.allclose(small.net.weight, big.net.weight, atol=1e-4)


# --------------------------------------------------------------------------- clipping


class GradSpy(TinyModule):
    """Big targets -> big gradients; records them after backward and right before the step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.before_clip: list[list[torch.Tensor]] = []
        self.after_clip: list[list[torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self(x), 100.0 * y)

    def on_after_backward(self) -> None:
        self.before_clip.append([p.grad.clone() for p in self.parameters()])

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        # What the update really used: clipping runs after on_before_optimizer_step (Lightning's order),
        # inside optimizer.step (the closure), so read the gradients once the step is done.
        optimizer.register_step_post_hook(
            lambda *_: self.after_clip.append([p.grad.clone() for p in self.parameters()]))
        return optimizer


def test_clip_by_norm(make_trainer: MakeTrainer) -> None:
    module = GradSpy(n=12, batch_size=4, lr=0.01, val_n=None)
    make_trainer(max_epochs=1, gradient_clip_val=0.5, gradient_clip_algorithm="norm").fit(module)
    assert len(module.after_clip) == 3
    for before, after in zip(module.before_clip, module.after_clip, strict=True):
        norm_before = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
        norm_after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in after]))
        assert norm_before > 5.0  # clipping actually had work to do
        assert norm_after <= 0.5 + 1e-5
        coef = 0.5 / (float(norm_before) + 1e-6)  # torch's clip_grad_norm_ formula
        for b, a in zip(before, after, strict=True):
            torch.testing.assert_close(a, b * coef)


def test_clip_by_value(make_trainer: MakeTrainer) -> None:
    module = GradSpy(n=12, batch_size=4, lr=0.01, val_n=None)
    make_trainer(max_epochs=1, gradient_clip_val=0.25, gradient_clip_algorithm="value").fit(module)
    for before, after in zip(module.before_clip, module.after_clip, strict=True):
        assert max(float(g.abs().max()) for g in before) > 0.25
        for b, a in zip(before, after, strict=True):
            assert float(a.abs().max()) <= 0.25
            torch.testing.assert_close(a, b.clamp(-0.25, 0.25))


def test_no_clipping_by_default(make_trainer: MakeTrainer) -> None:
    module = GradSpy(n=4, batch_size=4, lr=0.01, val_n=None)
    make_trainer(max_epochs=1).fit(module)
    for b, a in zip(module.before_clip[0], module.after_clip[0], strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- stopping and limits


class CountingModule(TinyModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_batches: list[tuple[int, int]] = []  # (epoch, batch_idx)
        self.val_batches = 0
        self.val_epochs = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.train_batches.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.val_batches += 1
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self.val_epochs += 1


def test_max_steps_stops_mid_epoch_and_checkpoint_keeps_position(make_trainer: MakeTrainer,
                                                                 run_dir: str) -> None:
    module = CountingModule(n=32, batch_size=4, lr=0.05)  # 8 batches per epoch
    trainer = make_trainer(max_steps=3, enable_checkpointing=True)
    trainer.fit(module)
    assert trainer.global_step == 3
    assert module.train_batches == [(0, 0), (0, 1), (0, 2)]
    assert module.val_batches == 0  # the epoch never finished, so no end-of-epoch validation
    assert (trainer.current_epoch, trainer.batch_in_epoch) == (0, 3)
    # `resume: last` must continue at batch 3 of epoch 0, not skip the rest of the epoch.
    ckpt = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"), weights_only=True)
    assert ckpt["loop"]["epoch"] == 0
    assert ckpt["loop"]["batch_in_epoch"] == 3
    assert ckpt["loop"]["global_step"] == 3


def test_max_steps_across_epochs(make_trainer: MakeTrainer) -> None:
    module = CountingModule(n=16, batch_size=4, lr=0.05, val_n=None)  # 4 batches per epoch
    trainer = make_trainer(max_steps=6, max_epochs=10)
    trainer.fit(module)
    assert module.train_batches == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert trainer.global_step == 6


def test_full_epochs_checkpoint_counts_epochs_once(make_trainer: MakeTrainer, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=2)
    trainer.fit(TinyModule(lr=0.05))
    assert trainer.current_epoch == 2
    trainer.save_checkpoint(os.path.join(run_dir, "after_fit.ckpt"))  # the state a finished fit leaves
    ckpt = torch.load(os.path.join(run_dir, "after_fit.ckpt"), weights_only=True)
    assert (ckpt["loop"]["epoch"], ckpt["loop"]["batch_in_epoch"]) == (2, 0)


def test_limit_train_and_val_batches(make_trainer: MakeTrainer) -> None:
    module = CountingModule(n=16, batch_size=4, val_n=12, lr=0.05)  # 4 train, 3 val batches
    trainer = make_trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module)
    assert module.train_batches == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert trainer.global_step == 4
    assert module.val_epochs == 2 and module.val_batches == 2


@pytest.mark.parametrize(("interval", "expected_val_runs"), [(1, 4), (2, 2), (3, 1), (0.5, 2), (0.25, 4),
                                                             (1.0, 1)])
def test_val_check_interval(make_trainer: MakeTrainer, interval: Any, expected_val_runs: int) -> None:
    module = CountingModule(n=16, batch_size=4, val_n=4, lr=0.05)  # 4 train batches
    make_trainer(max_epochs=1, val_check_interval=interval).fit(module)
    # Lightning's meaning: every `interval` batches (or that fraction of the epoch) within the epoch;
    # the end of the epoch validates only when it falls on the interval.
    assert module.val_epochs == expected_val_runs


def test_val_check_interval_longer_than_the_epoch_is_refused(make_trainer: MakeTrainer) -> None:
    module = CountingModule(n=16, batch_size=4, val_n=4, lr=0.05)
    with pytest.raises(ConfigError, match=r"number of the training batches of an epoch \(4\)"):
        make_trainer(max_epochs=1, val_check_interval=5).fit(module)


def test_val_check_interval_across_epochs(make_trainer: MakeTrainer) -> None:
    module = CountingModule(n=16, batch_size=4, val_n=4, lr=0.05)  # 4 train batches per epoch
    make_trainer(max_epochs=3, val_check_interval=6, check_val_every_n_epoch=None).fit(module)
    assert module.val_epochs == 2  # after global batches 6 and 12


class _Stream(torch.utils.data.IterableDataset):
    """Five batches of four samples per epoch, with no length."""

    def __iter__(self) -> Any:
        x, y = make_dataset(20).tensors
        return iter([(x[i:i + 4], y[i:i + 4]) for i in range(0, 20, 4)])


class _WhereValidated(CountingModule):
    """Records (epoch, fit_loop.batch_idx, fit_loop.total_batch_idx) at each validation; an epoch listed
    in ``cut`` is ended by ``on_train_batch_start`` returning -1 at its batch 1."""

    def __init__(self, cut: tuple[int, ...] = (), stream: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cut, self.stream = cut, stream
        self.validated_at: list[tuple[int, int, int]] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(), batch_size=None) if self.stream else super().train_dataloader()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch in self.cut and batch_idx == 1 else None

    def on_validation_epoch_end(self) -> None:
        loop = self.trainer.fit_loop
        self.validated_at.append((self.current_epoch, loop.batch_idx, loop.total_batch_idx))


def test_val_check_interval_across_epochs_counts_the_batches_taken(make_trainer: MakeTrainer,
                                                                   run_dir: str) -> None:
    # A stream with no length validates every 4 batches of the fit, wherever the epochs end.
    module = _WhereValidated(stream=True, val_n=4)
    trainer = make_trainer(max_epochs=3, val_check_interval=4, check_val_every_n_epoch=None)
    trainer.fit(module)
    assert module.validated_at == [(0, 3, 3), (1, 2, 7), (2, 1, 11)]
    loop = trainer.fit_loop
    assert (loop.batch_idx, loop.total_batch_idx, trainer.is_last_batch) == (4, 14, True)

    # Epochs of different lengths (epoch 0 ends after its batch 1, two batches taken): the count is of
    # the batches taken, not epochs times a length; a resume from a mid-epoch checkpoint keeps counting.
    module = _WhereValidated(cut=(0,), n=16, val_n=4)  # 4 batches per epoch
    trainer = make_trainer(max_epochs=3, val_check_interval=3, check_val_every_n_epoch=None,
                           enable_checkpointing=True, max_steps=4)
    trainer.fit(module)
    assert module.validated_at == [(1, 0, 2)] and trainer.fit_loop.total_batch_idx == 4
    resumed = _WhereValidated(n=16, val_n=4)
    make_trainer(max_epochs=3, val_check_interval=3, check_val_every_n_epoch=None, run_dir=run_dir + "-2"
                 ).fit(resumed, ckpt_path=os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"))
    assert resumed.validated_at == [(1, 3, 5), (2, 2, 8)]
    assert resumed.train_batches[0] == (1, 3)  # the resume starts inside epoch 1


def test_check_val_every_n_epoch(make_trainer: MakeTrainer) -> None:
    module = CountingModule(n=8, batch_size=4, val_n=4, lr=0.05)
    make_trainer(max_epochs=4, check_val_every_n_epoch=2).fit(module)
    assert module.val_epochs == 2


# --------------------------------------------------------------------------- optimizers and schedulers


class SchedModule(TinyModule):
    def __init__(self, sched: Callable[[torch.optim.Optimizer], Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sched = sched

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return self.sched(opt)


def lr_of(trainer: Any) -> float:
    return trainer.strategy.optimizers[0].param_groups[0]["lr"]


def test_step_interval_scheduler(make_trainer: MakeTrainer) -> None:
    module = SchedModule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5), "interval": "step"}},
        n=16, batch_size=4, val_n=None)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module)
    assert lr_of(trainer) == pytest.approx(0.1 * 0.5**4)


def test_step_scheduler_frequency(make_trainer: MakeTrainer) -> None:
    module = SchedModule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5), "interval": "step", "frequency": 2}},
        n=16, batch_size=4, val_n=None)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module)
    assert lr_of(trainer) == pytest.approx(0.1 * 0.5**2)


def test_epoch_interval_scheduler_is_the_default(make_trainer: MakeTrainer) -> None:
    module = SchedModule(lambda o: (o, torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)),
                         n=16, batch_size=4, val_n=None)
    trainer = make_trainer(max_epochs=3)
    trainer.fit(module)
    assert lr_of(trainer) == pytest.approx(0.1 * 0.5**3)


class PlateauModule(SchedModule):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("val/plateau", 1.0)  # never improves


def test_reduce_on_plateau_with_monitor(make_trainer: MakeTrainer) -> None:
    module = PlateauModule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
        "monitor": "val/plateau"}}, n=8, batch_size=4, val_n=4)
    trainer = make_trainer(max_epochs=3)
    trainer.fit(module)
    # Epoch 0 sets the best value; epochs 1 and 2 do not improve on it.
    assert lr_of(trainer) == pytest.approx(0.1 * 0.5**2)


def test_reduce_on_plateau_without_monitor_is_rejected(make_trainer: MakeTrainer) -> None:
    module = SchedModule(lambda o: (o, torch.optim.lr_scheduler.ReduceLROnPlateau(o)), val_n=None)
    with pytest.raises(ValueError, match="monitor"):
        make_trainer(max_epochs=1).fit(module)


def test_scheduler_monitor_not_logged_lists_logged_names(make_trainer: MakeTrainer) -> None:
    module = SchedModule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o), "monitor": "val/acc"}}, n=8, val_n=4)
    with pytest.raises(KeyError) as info:
        make_trainer(max_epochs=1).fit(module)
    assert "val/acc" in str(info.value) and "val/loss" in str(info.value)


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=lr)


def test_configure_optimizers_return_shapes() -> None:
    o1, o2 = _opt(), _opt()
    s1 = torch.optim.lr_scheduler.StepLR(o1, 1)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1)

    assert parse_optimizers(o1) == ([o1], [])
    opts, scheds = parse_optimizers((o1, s1))
    assert opts == [o1] and [s["scheduler"] for s in scheds] == [s1] and scheds[0]["interval"] == "epoch"
    opts, scheds = parse_optimizers(([o1, o2], [s1, s2]))
    assert opts == [o1, o2] and [s["scheduler"] for s in scheds] == [s1, s2]
    assert parse_optimizers([o1, o2]) == ([o1, o2], [])
    opts, scheds = parse_optimizers({"optimizer": o1, "lr_scheduler": {"scheduler": s1, "interval": "step"}})
    assert opts == [o1] and scheds[0]["interval"] == "step" and scheds[0]["frequency"] == 1
    opts, scheds = parse_optimizers([{"optimizer": o1, "lr_scheduler": s1}, {"optimizer": o2}])
    assert opts == [o1, o2] and [s["scheduler"] for s in scheds] == [s1]


@pytest.mark.parametrize(("value", "error"), [
    ("sgd", TypeError),
    ({"lr_scheduler": None}, ValueError),
])
def test_configure_optimizers_bad_shapes(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="optimizer"):
        parse_optimizers(value)


def test_scheduler_dict_validation() -> None:
    o = _opt()
    s = torch.optim.lr_scheduler.StepLR(o, 1)
    with pytest.raises(ValueError, match="interval"):
        parse_optimizers({"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "batch"}})
    with pytest.raises(ValueError, match="may have"):
        parse_optimizers({"optimizer": o, "lr_scheduler": {"scheduler": s, "intervall": "step"}})


class TwoOptimizers(TinyModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.head(x)

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net.parameters(), lr=0.05),
                torch.optim.Adam(self.head.parameters(), lr=0.01)]


def test_two_optimizers_both_step(make_trainer: MakeTrainer) -> None:
    module = TwoOptimizers(n=8, batch_size=4, val_n=None)
    net0, head0 = params_of(module.net), params_of(module.head)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module)
    assert len(trainer.strategy.optimizers) == 2
    assert not same(params_of(module.net), net0) and not same(params_of(module.head), head0)
    assert trainer.global_step == 2


# --------------------------------------------------------------------------- self.log


class LoggingModule(TinyModule):
    """Logs the batch's mean of feature 0 in every way the tests need."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = batch
        value = x[:, 0].mean()
        self.log("train/default", value)
        self.log("train/epoch_mean", value, on_step=False, on_epoch=True)
        self.log("train/both", value, on_step=True, on_epoch=True)
        self.log("train/bar", value, prog_bar=True, logger=False)
        if batch_idx == 0:
            self.log("train/first_only", 1.0)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = batch
        self.log("val/default", x[:, 0].mean())
        self.log("val/unweighted", x[:, 0].mean(), batch_size=1)


def test_log_defaults_step_epoch_and_weighting(make_trainer: MakeTrainer) -> None:
    module = LoggingModule(n=10, batch_size=4, val_n=10, lr=0.05)  # batches of 4, 4, 2
    recorder = LogRecorder()
    trainer = make_trainer(max_epochs=1, callbacks=[recorder])
    trainer.fit(module)

    x_train = module.train_ds.tensors[0][:, 0]
    x_val = module.val_ds.tensors[0][:, 0]
    batch_means = [x_train[i:i + 4].mean() for i in (0, 4, 8)]

    steps = [(s, m) for s, m in recorder.logs if "train/default" in m]
    assert [s for s, _ in steps] == [1, 2, 3]  # training: on_step by default, every logging step
    for (_, metrics), mean in zip(steps, batch_means, strict=True):
        assert metrics["train/default"] == pytest.approx(float(mean), abs=1e-6)
        assert "train/epoch_mean" not in metrics
    # A value logged on one batch only is published once, not repeated at every later step.
    assert sum("train/first_only" in m for m in recorder.names()) == 1

    cm = trainer.callback_metrics
    # Epoch values are sample-weighted: the uneven last batch counts for 2 samples, not 4.
    assert float(cm["train/epoch_mean"]) == pytest.approx(float(x_train.mean()), abs=1e-6)
    assert float(x_train.mean()) != pytest.approx(float(torch.stack(batch_means).mean()), abs=1e-4)
    assert float(cm["train/both"]) == pytest.approx(float(x_train.mean()), abs=1e-6)
    # Evaluation logs per epoch by default, also sample-weighted; batch_size=... overrides the weight.
    assert float(cm["val/default"]) == pytest.approx(float(x_val.mean()), abs=1e-6)
    val_batch_means = torch.stack([x_val[i:i + 4].mean() for i in (0, 4, 8)])
    assert float(cm["val/unweighted"]) == pytest.approx(float(val_batch_means.mean()), abs=1e-6)
    assert all("val/default" not in m for s, m in recorder.logs if "train/default" in m)

    # prog_bar metrics reach the bar; logger=False keeps them out of the loggers.
    assert "train/bar" in trainer.progress_bar_metrics
    assert "train/bar" not in trainer.logged_metrics
    assert "train/bar" in cm
    assert all("train/bar" not in m for m in recorder.names())
    assert "train/default" not in trainer.progress_bar_metrics


def test_log_every_n_steps(make_trainer: MakeTrainer) -> None:
    recorder = LogRecorder()
    make_trainer(max_epochs=2, log_every_n_steps=3, callbacks=[recorder]).fit(
        LoggingModule(n=16, batch_size=4, val_n=None, lr=0.05))
    assert [s for s, m in recorder.logs if "train/default" in m] == [3, 6]


def test_log_rejects_non_scalar(make_trainer: MakeTrainer) -> None:
    class Bad(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("train/vec", batch[0])
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="scalar"):
        make_trainer(max_epochs=1).fit(Bad(val_n=None))


# --------------------------------------------------------------------------- validate / test / predict


def manual_mse(module: torch.nn.Module, ds: Any) -> float:
    x, y = ds.tensors
    with torch.no_grad():
        return float(F.mse_loss(module(x), y))


def test_validate_returns_and_sets_callback_metrics(make_trainer: MakeTrainer) -> None:
    module = TinyModule(val_n=10, batch_size=4)
    trainer = make_trainer()
    result = trainer.validate(module)
    expected = manual_mse(module, module.val_ds)  # batch means weighted by size = overall mean
    assert result == [{"val/loss": pytest.approx(expected, rel=1e-5)}]
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(expected, rel=1e-5)


def test_validate_after_fit_uses_trained_weights(make_trainer: MakeTrainer) -> None:
    module = TinyModule(n=32, val_n=8, lr=0.05)
    trainer = make_trainer(max_epochs=3)
    before = manual_mse(module, module.val_ds)
    trainer.fit(module)
    after = trainer.validate(module)[0]["val/loss"]
    assert after == pytest.approx(manual_mse(module, module.val_ds), rel=1e-5)
    assert after != pytest.approx(before, rel=1e-3)  # the trained weights, not the initial ones


def test_test_returns_metrics(make_trainer: MakeTrainer) -> None:
    module = TinyModule(val_n=6, batch_size=4)
    result = make_trainer().test(module)
    assert result == [{"test/loss": pytest.approx(manual_mse(module, module.val_ds), rel=1e-5)}]


def test_test_with_explicit_dataloader_and_limit(make_trainer: MakeTrainer) -> None:
    module = TinyModule(val_n=None)
    ds = make_dataset(12, seed=5)
    loader = DataLoader(ds, batch_size=4)
    result = make_trainer(limit_test_batches=1).test(module, dataloaders=loader)
    first = type(ds)(*(t[:4] for t in ds.tensors))
    assert result[0]["test/loss"] == pytest.approx(manual_mse(module, first), rel=1e-5)


def test_predict_returns_outputs_in_order(make_trainer: MakeTrainer) -> None:
    module = TinyModule(val_n=10, batch_size=4)
    outputs = make_trainer().predict(module)
    assert [o.shape[0] for o in outputs] == [4, 4, 2]
    with torch.no_grad():
        expected = module(module.val_ds.tensors[0])
    torch.testing.assert_close(torch.cat(outputs), expected)
    limited = make_trainer(limit_predict_batches=2).predict(TinyModule(val_n=10, batch_size=4))
    assert len(limited) == 2


def test_eval_without_data_names_the_fix(make_trainer: MakeTrainer) -> None:
    with pytest.raises(ValueError, match="test_dataloader"):
        make_trainer().test(TinyModule(val_n=None))


# --------------------------------------------------------------------------- user errors and skips


class SkipOdd(TinyModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backwards = 0
        self.snapshots: list[list[torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.backwards += 1

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.snapshots.append(params_of(self))


@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_training_step_none_skips_the_step(make_trainer: MakeTrainer, precision: str) -> None:
    module = SkipOdd(n=16, batch_size=4, val_n=None, lr=0.05)
    start = params_of(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(max_epochs=1, precision=precision).fit(module)
    said = [str(w.message) for w in caught if "training_step returned None" in str(w.message)]
    assert said == ["training_step returned None for batch 1: that batch is skipped (no backward, no "
                    "optimizer step), as Lightning does; said once. Return the loss (or a dict with 'loss') "
                    "from training_step to train on it"]  # batch 3 skipped too, unsaid: once is enough
    assert module.backwards == 2
    snaps = [start, *module.snapshots]
    changed = [not same(snaps[i], snaps[i + 1]) for i in range(4)]
    assert not changed[1] and not changed[3]  # odd batches returned None: weights untouched
    if precision == "32":
        # (Under 16-mixed the GradScaler may itself skip the first steps while it finds its scale.)
        assert changed[0] and changed[2]


class TrainsOnly(TrainModule):
    """A val loader and no validation_step: nothing will read the loader."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)

    def val_dataloader(self) -> Any:
        raise AssertionError("a loader nothing reads is never built")


def test_a_val_loader_without_validation_step_is_said_and_skipped(make_trainer: MakeTrainer) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(max_epochs=2)
        trainer.fit(TrainsOnly())
    said = [str(w.message) for w in caught if "validation_step" in str(w.message)]
    assert said == ["You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop."]
    assert trainer.global_step == 4


def test_training_step_returning_dict(make_trainer: MakeTrainer) -> None:
    class DictStep(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return {"loss": super().training_step(batch, batch_idx), "extra": 1}

    module = DictStep(val_n=None, lr=0.05)
    start = params_of(module)
    make_trainer(max_epochs=1).fit(module)
    assert not same(params_of(module), start)


def test_module_without_training_step(make_trainer: MakeTrainer) -> None:
    class NoStep(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ConfigError) as info:
        make_trainer(max_epochs=1).fit(NoStep())
    assert "NoStep" in str(info.value) and "training_step(self, batch, batch_idx)" in str(info.value)


def test_empty_dataloader(make_trainer: MakeTrainer) -> None:
    module = TinyModule(n=3, batch_size=4, drop_last=True)
    with pytest.raises(EmptyDataError) as info:
        make_trainer(max_epochs=1).fit(module)
    msg = str(info.value)
    assert "drop_last" in msg and "batch_size=4" in msg and "3 samples" in msg


def test_no_training_data(make_trainer: MakeTrainer) -> None:
    class NoData(TinyModule):
        def train_dataloader(self) -> None:
            return None

    with pytest.raises(ValueError, match="train_dataloader"):
        make_trainer(max_epochs=1).fit(NoData())


def test_fit_with_explicit_dataloaders(make_trainer: MakeTrainer) -> None:
    module = CountingModule(val_n=None, lr=0.05)
    train = DataLoader(make_dataset(12), batch_size=4)
    val = DataLoader(make_dataset(4, seed=3), batch_size=4)
    make_trainer(max_epochs=1).fit(module, train_dataloaders=train, val_dataloaders=val)
    assert len(module.train_batches) == 3 and module.val_batches == 1


# --------------------------------------------------------------------------- precision


def test_bf16_true_converts_params_and_trains(make_trainer: MakeTrainer) -> None:
    module = TinyModule(n=16, val_n=8, lr=0.05)
    start = [p.to(torch.bfloat16) for p in params_of(module)]
    trainer = make_trainer(max_epochs=1, precision="bf16-true")
    trainer.fit(module)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert not same(params_of(module), start)
    assert torch.isfinite(trainer.callback_metrics["val/loss"])


def test_bf16_mixed_keeps_fp32_params(make_trainer: MakeTrainer) -> None:
    module = TinyModule(n=16, val_n=8, lr=0.05)
    trainer = make_trainer(max_epochs=1, precision="bf16-mixed")
    trainer.fit(module)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert torch.isfinite(trainer.callback_metrics["val/loss"])


def test_16_mixed_on_cpu_trains_and_checkpoints_scaler(make_trainer: MakeTrainer, run_dir: str) -> None:
    module = TinyModule(n=32, val_n=8, lr=0.05)
    before = manual_mse(module, module.val_ds)
    trainer = make_trainer(max_epochs=3, precision="16-mixed", enable_checkpointing=True)
    trainer.fit(module)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    val = float(trainer.callback_metrics["val/loss"])
    assert val == val and val < before  # finite (not NaN) and learned something
    scaler = trainer.strategy.precision.scaler
    assert scaler is not None
    ckpt = torch.load(os.path.join(run_dir, "version_0", "checkpoints", "last.ckpt"), weights_only=True)
    assert ckpt["precision"]["scale"] == pytest.approx(scaler.get_scale())
    assert "_growth_tracker" in ckpt["precision"]


# --------------------------------------------------------------------------- non-finite losses


class NaNAt(TinyModule):
    """The loss becomes NaN on the given (epoch-0) batch indices."""

    def __init__(self, bad: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad = bad
        self.seen: list[int] = []
        self.snapshots: list[list[torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(batch_idx)
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx in self.bad else loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.snapshots.append(params_of(self))


def test_nan_error_names_the_step(make_trainer: MakeTrainer) -> None:
    module = NaNAt({2}, n=24, batch_size=4, lr=0.05, val_n=None)
    with pytest.raises(NonFiniteError, match="non-finite loss at step 2 "):
        make_trainer(max_epochs=1, nan_policy="error").fit(module)
    assert module.seen == [0, 1, 2]  # stopped at the first logging step after the bad one


def test_nan_error_writes_no_checkpoint_after_bad_step(make_trainer: MakeTrainer, run_dir: str) -> None:
    from polytrain.callbacks import ModelCheckpoint

    module = NaNAt({2}, n=24, batch_size=4, lr=0.05, val_n=None)
    trainer = make_trainer(max_epochs=1, nan_policy="error", log_every_n_steps=50,
                           callbacks=[ModelCheckpoint(save_last=True, every_n_train_steps=1, save_top_k=-1)])
    with pytest.raises(NonFiniteError, match="step 2"):
        trainer.fit(module)
    ckpt_dir = os.path.join(run_dir, "version_0", "checkpoints")
    names = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".ckpt"))
    assert names == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
    last = torch.load(os.path.join(ckpt_dir, "last.ckpt"), weights_only=True)
    assert last["loop"]["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in last["model"].values())


def test_nan_error_inside_accumulation_window(make_trainer: MakeTrainer) -> None:
    # The NaN is in the first micro-batch of window 1; the window's last loss is finite.
    module = NaNAt({2}, n=32, batch_size=4, lr=0.05, val_n=None)
    with pytest.raises(NonFiniteError, match="at step 1 "):
        make_trainer(max_epochs=1, accumulate_grad_batches=2, nan_policy="error").fit(module)


def test_nan_skip_leaves_params_and_continues(make_trainer: MakeTrainer) -> None:
    module = NaNAt({2}, n=24, batch_size=4, lr=0.05, val_n=None)  # 6 batches
    start = params_of(module)
    trainer = make_trainer(max_epochs=1, nan_policy="skip")
    trainer.fit(module)
    assert module.seen == [0, 1, 2, 3, 4, 5]
    snaps = [start, *module.snapshots]
    assert same(snaps[2], snaps[3])  # the bad step changed nothing
    assert not same(snaps[3], snaps[4])  # and training went on
    assert trainer.global_step == 5 and trainer.guard.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_nan_skip_inside_accumulation_window(make_trainer: MakeTrainer) -> None:
    module = NaNAt({2}, n=32, batch_size=4, lr=0.05, val_n=None)  # windows (0,1) (2,3) (4,5) (6,7)
    start = params_of(module)
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2, nan_policy="skip")
    trainer.fit(module)
    snaps = [start, *module.snapshots]
    assert same(snaps[2], snaps[4])  # window (2, 3) was skipped even though batch 3's loss is finite
    assert trainer.guard.skipped_steps == 1 and trainer.global_step == 3
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_fit_twice_on_same_trainer_keeps_module(make_trainer: MakeTrainer) -> None:
    # A second stage on the same trainer reuses the set-up module instead of rebuilding it.
    module = TinyModule(val_n=8, lr=0.05)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module)
    snapshot = copy.deepcopy(module.state_dict())
    trainer.validate(module)
    for k, v in module.state_dict().items():
        assert torch.equal(v, snapshot[k])
