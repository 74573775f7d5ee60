"""``trainer.profiler``: ``simple`` (a table of hook and loop-phase times at fit end), ``torch``
(a ``torch.profiler`` trace of a window of steps on rank 0), and the default, which instruments
nothing."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pytest
from distributed import run_distributed

from polytrain import Trainer
from polytrain.core.batch import move_to_device
from polytrain.core.errors import ConfigError
from polytrain.trainer.observability.profiler import PassThroughProfiler, SimpleProfiler, TorchProfiler

pytestmark = pytest.mark.torch_api

STEPS = 8  # TinyModule(n=32, batch_size=4): 8 batches per epoch


def test_default_instruments_nothing(make_trainer: Any, tiny_module: Any) -> None:
    trainer = make_trainer(max_epochs=1, enable_progress_bar=True)
    assert type(trainer.profiler) is PassThroughProfiler and not trainer.profiler.enabled
    with trainer.profiler.profile("user code"):  # Lightning's API is there, and does nothing
        pass
    trainer.fit(tiny_module(n=32))
    before, after, module_hook = trainer.hooks.plan("on_train_batch_end")
    assert before and module_hook is None  # the progress bar's bound method itself, not a timing wrapper
    assert all(getattr(fn, "__self__", None) is not None for fn in before + after)
    strategy = trainer.strategy
    assert not {"forward_backward", "training_step", "backward"} & set(vars(strategy))


def test_simple_profiler_times_phases_and_hooks(make_trainer: Any, tiny_module: Any, capsys: Any) -> None:
    trainer = make_trainer(max_epochs=2, profiler={"name": "simple", "filename": "profile"},
                           enable_progress_bar=True, log_every_n_steps=4)
    assert isinstance(trainer.profiler, SimpleProfiler)
    module = tiny_module(n=32)

    class Timed(type(module)):  # the user's own block, through Lightning's trainer.profiler.profile
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            with self.trainer.profiler.profile("my loss"):
                return super().training_step(batch, batch_idx)

    module.__class__ = Timed
    trainer.fit(module)
    records = trainer.profiler.records
    calls = {name: int(r[1]) for name, r in records.items()}
    assert (calls["train epoch"] == 2 and calls["get batch"] == 2 * STEPS
            and calls["training batch"] == 2 * STEPS)
    assert calls["forward+backward"] == calls["training_step"] == calls["backward"] == 2 * STEPS
    assert calls["optimizer update"] == 2 * STEPS and calls["logging step"] == 2 * STEPS // 4
    assert calls["validation"] == 2 and calls["epoch end"] == 2 and calls["my loss"] == 2 * STEPS
    # hooks are named as Lightning's profilers name them, each call's time kept as Lightning keeps it
    assert calls["[Callback]ProgressBar.on_train_batch_end"] == 2 * STEPS
    durations = trainer.profiler.recorded_durations
    assert len(durations["[Callback]ProgressBar.on_train_batch_end"]) == 2 * STEPS
    assert sum(durations["training batch"]) == pytest.approx(records["training batch"][0])
    assert len(durations["my loss"]) == 2 * STEPS and durations["fit"] == [records["fit"][0]]
    assert records["training batch"][0] <= records["train epoch"][0] <= records["fit"][0]
    out = capsys.readouterr().out
    assert "simple profiler, rank 0" in out and "  [Callback]ProgressBar.on_train_batch_end" in out
    for row in ("get batch", "training batch", "forward+backward", "optimizer update", "validation"):
        assert row in out
    with open(os.path.join(trainer.log_dir, "profile-rank0.txt"), encoding="utf-8") as fh:
        assert fh.read().strip() == trainer.profiler.summary
    # Everything the profiler wrapped is back as it was.
    assert not {"forward_backward", "training_step", "backward"} & set(vars(trainer.strategy))
    # the strategy's mover bound at set-up (nothing to cast: move_to_device with the device), not a wrapper
    assert trainer.transfer_batch.func is move_to_device
    assert not trainer.strategy.optimizers[0]._optimizer_step_pre_hooks


def test_profiler_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['actve'\]"):
        Trainer(profiler={"name": "torch", "actve": 3})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['wait'\]"):
        Trainer(profiler={"name": "simple", "wait": 1})
    with pytest.raises(ConfigError, match="active=0"):
        Trainer(profiler={"name": "torch", "active": 0})
    with pytest.raises(ConfigError, match="choose one of: simple, torch"):
        Trainer(profiler="advanced")


def _check_trace(path: str, active: int) -> set[str]:
    """The trace opens with torch's own tools and holds the profiled steps and polytrain's ranges."""
    try:
        from torch.profiler._trace_validator import validate_trace  # torch >= 2.15
    except ImportError:
        validate_trace = None
    if validate_trace is not None:
        ok, violations = validate_trace(path)
        assert ok, violations
    else:
        from torch._inductor.analysis.profile_analysis import JsonProfile  # torch 2.11's trace reader

        assert JsonProfile(path).events
    try:  # TensorBoard's profiler plugin, when installed (it needs pandas)
        from torch_tb_profiler.profiler.data import RunProfileData
    except ImportError:
        pass
    else:
        assert RunProfileData.parse("rank0", None, path, os.path.dirname(path)).has_runtime is not None
    with open(path, encoding="utf-8") as fh:
        events = json.load(fh)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert len({n for n in names if n.startswith("ProfilerStep#")}) == active
    return names


def test_torch_profiler_writes_a_trace_of_the_window(make_trainer: Any, tiny_module: Any,
                                                     run_dir: str) -> None:
    trainer = make_trainer(max_epochs=1, profiler={"name": "torch", "wait": 1, "warmup": 1, "active": 2})
    assert isinstance(trainer.profiler, TorchProfiler)
    trainer.fit(tiny_module(n=32))
    traces = glob.glob(os.path.join(run_dir, "version_0", "profiler", "rank0.*.pt.trace.json"))
    assert len(traces) == 1, traces
    names = _check_trace(traces[0], active=2)
    for label in ("polytrain/training batch", "polytrain/forward+backward", "polytrain/batch to device"):
        assert label in names
    assert any(n.startswith("aten::") for n in names)


def _torch_profiled_ddp(rank: int, world: int, run_dir: str) -> list[str]:
    from conftest import TinyModule

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, run_dir=run_dir,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      num_sanity_val_steps=0, profiler={"name": "torch", "wait": 0, "warmup": 1, "active": 1})
    trainer.fit(TinyModule(n=32))
    trainer.strategy.barrier()
    return sorted(os.listdir(os.path.join(trainer.log_dir, "profiler")))


def test_torch_profiler_runs_on_rank_zero_only(tmp_path: Any) -> None:
    listings = run_distributed(_torch_profiled_ddp, 2, str(tmp_path), timeout=120)
    assert listings[0] == listings[1] and len(listings[0]) == 1 and listings[0][0].startswith("rank0.")
    _check_trace(str(tmp_path / "version_0" / "profiler" / listings[0][0]), active=1)


def test_a_profiled_fit_takes_the_path_an_unprofiled_one_takes(make_trainer: Any, tiny_module: Any,
                                                              sgd_closures: list[bool]) -> None:
    """The profiler times through the funnel and registers no optimizer step hook: a fit without a closure
    stays without one (torch's step gets no closure) with the profiler on."""
    closures = sgd_closures
    for profiler in (None, "simple"):
        trainer = make_trainer(max_epochs=1, profiler=profiler)
        trainer.fit(tiny_module(n=32))
        assert not trainer.strategy.executor.closure_needed, profiler
        assert closures == [False] * STEPS, (profiler, closures)
        closures.clear()
    assert trainer.profiler.records["optimizer update"][1] == STEPS


def test_a_datamodules_hooks_are_profiled_under_lightnings_names(make_trainer: Any) -> None:
    """``from polytrain.profilers.simple import SimpleProfiler`` (Lightning's path) is the profiler a
    ``profiler="simple"`` Trainer builds, and a DataModule's hooks are its rows, one duration per call."""
    from conftest import TinyModule, make_dataset
    from polytrain.profilers.simple import SimpleProfiler as FromModule
    from torch.utils.data import DataLoader

    from polytrain import DataModule
    from polytrain.profilers import SimpleProfiler as FromPackage

    class Numbers(DataModule):
        def prepare_data(self) -> None: ...

        def setup(self, stage: str) -> None:
            self.data = make_dataset(8)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=4)

        def state_dict(self) -> dict[str, Any]:
            return {"seen": 1}

    trainer = make_trainer(max_epochs=1, profiler="simple", enable_checkpointing=True)
    assert FromPackage is FromModule is SimpleProfiler and isinstance(trainer.profiler, FromModule)
    trainer.fit(TinyModule(n=8, val_n=None), datamodule=Numbers())
    durations = trainer.profiler.recorded_durations
    for hook in ("prepare_data", "setup", "train_dataloader", "state_dict", "teardown"):
        calls = durations[f"[LightningDataModule]Numbers.{hook}"]
        assert len(calls) == 1 and calls[0] > 0, hook
