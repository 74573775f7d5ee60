"""The loop adds no host-device sync of its own (DESIGN §7): on a step that logs nothing, nothing
reads a tensor's value on the host.

On CPU nothing syncs, so the test counts the calls that *would* sync on a GPU: reading a value
(``item``, ``float()``, ``int()``, ``bool()``, ``tolist``, ``numpy``, formatting), ``nonzero``
(a data-dependent shape), and copies to the host (``cpu()``, ``.to("cpu")``). Counting runs from each
training batch's ``on_train_batch_start`` to the next one's (or validation, or the epoch's end), so a
window holds the whole step: forward, backward, optimizer, the logging step when there is one, every
callback's batch-end hook, then fetching and moving the next batch. With SGD: Adam keeps its step
count in a CPU tensor and reads it with ``.item()`` (a host read even on CUDA, not a sync).

CUDA pieces are exercised by simulation: a loader pins when the strategy computes on CUDA
(unless the user chose), and batches move with ``non_blocking=True``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer
from polytrain.callbacks import LearningRateMonitor, ThroughputMonitor
from polytrain.core.batch import move_to_device
from polytrain.data.loaders import PIN_CHOSEN, distribute_dataloader, record_pin_memory_choice

pytestmark = pytest.mark.torch_api

READS = ("item", "tolist", "numpy", "cpu", "nonzero", "__float__", "__int__", "__bool__", "__index__",
         "__complex__", "__array__", "__format__", "__repr__")
LOG_EVERY = 4


class SyncCounter:
    """Counts would-be syncs while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.hits: list[tuple[str, str]] = []
        self._inside = False

    def _hit(self, name: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if any("torch/utils/data/" in f.filename for f in stack[-4:]):
            return  # a DataLoader drawing its base seed from a CPU generator: a host read, never a sync
        frames = [f for f in stack if "polytrain" in f.filename or "test_" in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        self.hits.append((name, where))

    def wrap(self, name: str, fn: Callable[..., Any], is_host_copy: Callable[..., bool] | None = None) -> Any:
        counter = self

        def patched(*args: Any, **kwargs: Any) -> Any:
            if (counter.active and not counter._inside
                    and (is_host_copy is None or is_host_copy(*args, **kwargs))):
                counter._hit(name)
            counter._inside, outer = True, counter._inside  # what torch calls inside one read is not another
            try:
                return fn(*args, **kwargs)
            finally:
                counter._inside = outer

        return patched

    @staticmethod
    def _to_host(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        # Only a literal "cpu": torch's own code moves to a device taken from a tensor (clip_grad_norm_
        # gathers per-device norms), which on a GPU is a device-to-device move.
        target = kwargs.get("device", args[0] if args else None)
        return isinstance(target, str) and torch.device(target).type == "cpu"

    def install(self, monkeypatch: Any) -> None:
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self.wrap(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self.wrap("torch.nonzero", torch.nonzero))
        monkeypatch.setattr(torch.Tensor, "to", self.wrap("to(cpu)", torch.Tensor.to, self._to_host))


class Windows(Callback):
    """Per training batch: the would-be syncs from its start to the next batch's start."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter
        self.windows: list[tuple[bool, list[tuple[str, str]]]] = []  # (a logging step?, hits)
        self._logging = False

    def _close(self) -> None:
        if self.counter.active:
            self.counter.active = False
            self.windows.append((self._logging, self.counter.hits))

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._close()
        self.counter.hits, self.counter.active = [], True

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._logging = (trainer.batches_stepped % trainer.config.log_every_n_steps == 0
                         and trainer.batch_in_epoch % trainer.config.accumulate_grad_batches == 0)

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self._close()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self._close()


def regression_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :2] * 0.5 + 0.1 * torch.randn(n, 2, generator=g))


def make_module(scheduler: bool = False, sync_dist: bool = False) -> Any:
    from polytrain import TrainModule

    class Regressor(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train/loss", loss, prog_bar=True, sync_dist=sync_dist)
            self.log("train/mean_out", self.net(x).mean(), on_epoch=True)
            return {"loss": loss, "detached": loss.detach()}

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("val/loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]), prog_bar=True)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if not scheduler:
                return opt
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3),
                                                        "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            return DataLoader(regression_data(), batch_size=4, shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(regression_data(16), batch_size=4)

    return Regressor()


VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},  # progress bar, TensorBoard + CSV, checkpoints, summary
    "bf16-mixed": {"precision": "bf16-mixed"},
    "accumulate-clip-schedule-monitors": {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0,
                                          "scheduler": True, "callbacks": "monitors"},
    "mid-epoch-validation": {"val_check_interval": 6},
}


def fit_counting(monkeypatch: Any, run_dir: str, strategy: str = "single", devices: int = 1,
                 **options: Any) -> Windows:
    counter = SyncCounter()
    windows = Windows(counter)
    callbacks: list[Any] = [windows]
    if options.pop("callbacks", None) == "monitors":
        callbacks += [LearningRateMonitor(), ThroughputMonitor()]
    module = make_module(options.pop("scheduler", False), options.pop("sync_dist", False))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2, run_dir=run_dir,
                      log_every_n_steps=LOG_EVERY, callbacks=callbacks, **options)
    counter.install(monkeypatch)
    trainer.fit(module)
    return windows


def check(windows: Windows) -> None:
    quiet = [hits for logging, hits in windows.windows if not logging]
    loud = [hits for logging, hits in windows.windows if logging]
    assert len(quiet) >= 8 and loud, windows.windows  # both kinds of step ran
    bad = [h for hits in quiet for h in hits]
    assert not bad, "host reads on a step that logs nothing:\n" + "\n".join(f"  {n}: {w}" for n, w in bad)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_host_sync_on_steps_that_do_not_log(variant: str, monkeypatch: Any, run_dir: str) -> None:
    check(fit_counting(monkeypatch, run_dir, **dict(VARIANTS[variant])))


def test_the_counter_sees_host_reads(monkeypatch: Any, run_dir: str) -> None:
    """nan_policy=skip agrees on every step by design (one host read per step): the counter must see it."""
    windows = fit_counting(monkeypatch, run_dir, nan_policy="skip")
    assert all(hits for _, hits in windows.windows), windows.windows


def _ddp_counting(rank: int, world: int, run_dir: str) -> list[tuple[bool, list[tuple[str, str]]]]:
    monkeypatch = pytest.MonkeyPatch()
    try:
        return fit_counting(monkeypatch, run_dir, "ddp", 2, sync_dist=True).windows
    finally:
        monkeypatch.undo()


def test_no_host_sync_ddp(tmp_path: Any) -> None:
    for windows in run_distributed(_ddp_counting, 2, str(tmp_path), timeout=120):
        holder = Windows(SyncCounter())
        holder.windows = windows
        check(holder)


# --------------------------------------------------------------------------- CUDA paths, simulated


def test_rebuilt_loaders_pin_on_cuda_unless_the_user_chose() -> None:
    ds = regression_data(16)
    with record_pin_memory_choice():
        unchosen = DataLoader(ds, batch_size=4, shuffle=True)
        chosen_off = DataLoader(ds, batch_size=4, shuffle=True, pin_memory=False)
        positional = DataLoader(ds, 4, True, None, None, 0, None, False)
    outside = DataLoader(ds, batch_size=4)
    assert not unchosen.__dict__.get(PIN_CHOSEN) and chosen_off.__dict__[PIN_CHOSEN]
    assert positional.__dict__[PIN_CHOSEN] and not outside.__dict__.get(PIN_CHOSEN)
    assert DataLoader.__init__.__qualname__ == "DataLoader.__init__"  # put back
    assert distribute_dataloader(unchosen, 1, 0, 0, "train", pin_memory=True).pin_memory
    assert not distribute_dataloader(chosen_off, 1, 0, 0, "train", pin_memory=True).pin_memory
    assert not distribute_dataloader(unchosen, 1, 0, 0, "train", pin_memory=False).pin_memory
    assert distribute_dataloader(outside, 2, 0, 0, "val", pin_memory=True).pin_memory


def test_strategy_pins_and_copies_non_blocking_on_cuda(monkeypatch: Any) -> None:
    from polytrain.strategies.launcher import plan_launch

    trainer = Trainer(strategy="single", accelerator="cpu")
    trainer._setup_strategy(plan_launch(trainer.config))
    strategy = trainer.strategy
    strategy._device = torch.device("cuda", 0)  # what setup_environment sets on a GPU
    with record_pin_memory_choice():
        loader = DataLoader(regression_data(16), batch_size=4, shuffle=True)
    assert strategy.process_dataloader(loader, "train", 0, True).pin_memory
    strategy._device = torch.device("cpu")
    assert not strategy.process_dataloader(loader, "train", 0, True).pin_memory
    calls: list[dict[str, Any]] = []

    def fake_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append({"args": args, **kwargs})
        return self

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    batch = {"x": torch.zeros(2), "pair": (torch.zeros(1), torch.ones(1))}
    move_to_device(batch, torch.device("cuda", 0))
    assert len(calls) == 3 and all(c["non_blocking"] is True for c in calls)


@pytest.mark.gpu
def test_no_implicit_sync_on_cuda(run_dir: str) -> None:
    """On a GPU: torch's own sync detector raises on any implicit sync in steps that do not log."""
    module = make_module()
    errors: list[str] = []

    class Strict(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            quiet = (trainer.batches_stepped + 1) % LOG_EVERY != 0
            torch.cuda.set_sync_debug_mode("error" if quiet else 0)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            torch.cuda.set_sync_debug_mode(0)

    trainer = Trainer(strategy="single", accelerator="cuda", devices=1, max_epochs=1, run_dir=run_dir,
                      log_every_n_steps=LOG_EVERY, callbacks=[Strict()], enable_progress_bar=False)
    try:
        trainer.fit(module)
    except RuntimeError as err:  # pragma: no cover - the failure being tested for
        errors.append(str(err))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not errors, errors
