"""Asynchronous checkpoints on one process (``polytrain.checkpoint.async_writer``): each guarantee of
docs/reliability.md has a test here; the 2-rank ones are in test_async_checkpoints_distributed.py.

``async_ckpt_module.set_hooks`` wraps the writer thread's staging step (``async_writer.finish_staging``)
so that every background write sleeps first, so training really goes on while a save is in flight."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from async_ckpt_module import Lin, LinManual, StepAtStart, WeightsAt, set_hooks, trainer

from polytrain.callbacks.base import Callback
from polytrain.checkpoint.layout import LATEST_POINTER, find_resumable, is_complete
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.core.errors import CheckpointError

pytestmark = [pytest.mark.torch_api, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _no_hooks() -> Any:
    yield
    set_hooks()


def _ckpt_dir(t: Any) -> str:
    return os.path.dirname(t.checkpoint_callback.last_model_path)


def test_at_most_one_save_in_flight_the_next_waits_and_logs_it(tmp_path: Path, caplog: Any) -> None:
    t = trainer(str(tmp_path), max_steps=2)
    t.fit(Lin())
    set_hooks(delay=0.6)
    first, second = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    t.save_checkpoint(first, async_save=True)
    assert not os.path.exists(first)  # training goes on while it is written
    with caplog.at_level(logging.WARNING, logger="polytrain"):
        t.save_checkpoint(second, async_save=True)
    assert is_complete(first)  # the second save waited for the first
    assert re.search(r"b\.ckpt waited [0-9.]+ s for the asynchronous save of .*a\.ckpt",
                     caplog.text), caplog.text
    assert not os.path.exists(second)
    t.strategy.checkpoint_io.finish()
    assert is_complete(second)


class DiskObserver(Callback):
    """After every step (while the previous async save may be in flight) reads what resume would see."""

    def __init__(self) -> None:
        self.seen_in_flight = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        saver = trainer.checkpoint_callback
        directory = saver.dirpath
        if saver.last_model_path and not os.path.exists(saver.last_model_path):
            self.seen_in_flight += 1
        pointer = os.path.join(directory, LATEST_POINTER)
        if os.path.exists(pointer):
            named = _named(pointer)
            # The writer thread may move the pointer on and prune the file it named between our read and
            # our check: only a file the pointer still names must be complete.
            assert is_complete(named) or _named(pointer) != named, (
                f"latest names {named}, which is not complete")
        last = os.path.join(directory, "last.ckpt")
        if os.path.exists(last):
            assert is_complete(last), "last.ckpt links to an incomplete file"
        if os.path.isdir(directory) and os.path.exists(pointer):
            # A listing is not a snapshot: one taken while the writer thread renames the new file in and
            # prunes the old one can miss both. List again before concluding.
            for _ in range(3):
                complete = [n for n in os.listdir(directory)
                            if n.startswith("epoch") and is_complete(os.path.join(directory, n))]
                if complete:
                    break
            assert complete, ("pruning removed the only complete checkpoint while the next one was being "
                              "written")


def _named(pointer: str) -> str:
    with open(pointer, encoding="utf-8") as fh:
        return os.path.join(os.path.dirname(pointer), fh.read().strip())


def test_pointer_link_and_pruning_see_only_complete_checkpoints(tmp_path: Path) -> None:
    set_hooks(delay=0.3)
    observer = DiskObserver()
    t = trainer(str(tmp_path), max_steps=10, callbacks=[observer], save_top_k=1)
    t.fit(Lin())
    assert observer.seen_in_flight >= 2  # the checks ran while saves were being written
    directory = _ckpt_dir(t)
    assert sorted(os.listdir(directory)) == ["epoch=0-step=10.ckpt", "last.ckpt", LATEST_POINTER]
    assert read_checkpoint(os.path.join(directory, "last.ckpt"))["global_step"] == 10


def test_weights_changed_after_staging_never_reach_the_file(tmp_path: Path) -> None:
    set_hooks(delay=0.5)  # steps 3..6 run while step 2's file is written
    weights = WeightsAt({2, 4, 6})
    t = trainer(str(tmp_path), max_steps=6, callbacks=[weights])
    t.fit(Lin())
    for step in (2, 4):  # step 4 is staged into step 2's reused buffers
        saved = read_checkpoint(os.path.join(_ckpt_dir(t), f"epoch=0-step={step}.ckpt"))["model"]
        for name, value in weights.weights[step].items():
            assert torch.equal(saved[name], value), (step, name)
            assert not torch.equal(saved[name], weights.weights[6][name]), (
                f"{name} did not change after step {step}")


@pytest.mark.parametrize("path", ["plain", "closure", "manual"])
def test_the_next_update_waits_for_the_background_staging_copy(tmp_path: Path, path: str) -> None:
    """On CPU the writer thread copies what the optimizer updates while the next forward and backward
    run; every way a batch reaches the update (a plain fit, the closure path that gradient clipping
    takes, manual optimisation) waits for that copy first. Without the wait the copy, delayed by the
    hook, would read weights the next update already changed."""
    set_hooks(stage_delay=0.4)
    weights = WeightsAt({2, 4, 6})
    kwargs = {"gradient_clip_val": 10.0} if path == "closure" else {}
    t = trainer(str(tmp_path), max_steps=6, callbacks=[weights], trainer_kwargs=kwargs)
    t.fit(LinManual() if path == "manual" else Lin())
    for step in (2, 4):
        saved = read_checkpoint(os.path.join(_ckpt_dir(t), f"epoch=0-step={step}.ckpt"))
        for name, value in weights.weights[step].items():
            assert torch.equal(saved["model"][name], value), (step, name)
        moments = weights.optimizer[step]
        assert moments and all(torch.equal(saved["optimizer"][k], v) for k, v in moments.items()), step
    waits = t.strategy.checkpoint_io.writer.staging_waits
    assert len(waits) == 3 and waits[0] > 0 and waits[1] > 0, waits  # the updates after steps 2 and 4 waited
    # goodput counts those waits as checkpoint time
    assert t.fit_loop.goodput.last["checkpoint"] >= sum(waits)


def test_a_save_outside_fit_copies_before_it_returns(tmp_path: Path) -> None:
    """No optimizer update follows a save made after fit, so nothing would wait for a background copy:
    the staged copy is complete when ``save_checkpoint`` returns, and changing the weights then is safe."""
    set_hooks(stage_delay=0.4)
    t = trainer(str(tmp_path), max_steps=2)
    module = Lin()
    t.fit(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    path = str(tmp_path / "after-fit.ckpt")
    t.save_checkpoint(path, async_save=True)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    t.strategy.checkpoint_io.finish()
    saved = read_checkpoint(path)["model"]
    assert all(torch.equal(saved[k], v) for k, v in before.items())


class FailAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("the user's code failed")


def test_a_fit_that_fails_still_completes_the_save_in_flight(tmp_path: Path) -> None:
    """The error propagates only once the checkpoint being written is on disk (and pointed at), so the
    run resumes from it rather than from the one before."""
    set_hooks(delay=0.5)
    t = trainer(str(tmp_path), max_steps=6, callbacks=[FailAt(3)])
    with pytest.raises(RuntimeError, match="the user's code failed"):
        t.fit(Lin())
    assert is_complete(os.path.join(_ckpt_dir(t), "epoch=0-step=2.ckpt"))
    assert find_resumable(_ckpt_dir(t)).endswith("epoch=0-step=2.ckpt")


def test_fit_returns_only_after_the_last_save_is_complete(tmp_path: Path) -> None:
    set_hooks(delay=0.5)
    t = trainer(str(tmp_path), max_steps=3)  # the save at fit end (step 3) is the one in flight
    t.fit(Lin())
    assert is_complete(os.path.join(_ckpt_dir(t), "epoch=0-step=3.ckpt"))
    assert find_resumable(_ckpt_dir(t)).endswith("epoch=0-step=3.ckpt")


class SaveAtFitEnd(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        trainer.save_checkpoint(self.path, async_save=True)


def test_fit_waits_for_a_users_async_save(tmp_path: Path) -> None:
    set_hooks(delay=0.5)
    path = str(tmp_path / "mine.ckpt")
    # ModelCheckpoint saves nothing here, so only the fit's own end waits for the user's save.
    trainer(str(tmp_path / "run"), max_steps=2, callbacks=[SaveAtFitEnd(path)], every_n=100,
            save_on_fit_end=False).fit(Lin())
    assert is_complete(path)


class BadSave(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path, async_save=True)


def test_a_failed_background_write_raises_at_the_end_of_fit(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "c.ckpt")  # under a regular file: ENOTDIR, even for root
    t = trainer(str(tmp_path / "run"), max_steps=3, callbacks=[BadSave(bad)], every_n=100,
                save_on_fit_end=False)
    with pytest.raises(CheckpointError, match=r"checkpoint failed on rank 0: cannot write .*c\.ckpt"):
        t.fit(Lin())


def test_a_failed_background_write_raises_at_the_next_save(tmp_path: Path) -> None:
    set_hooks(fail_rank=0)
    t = trainer(str(tmp_path), max_steps=6, every_n=2)
    with pytest.raises(CheckpointError, match=r"No space left on device \(injected"):
        t.fit(Lin())
    assert t.global_step == 4  # raised by the save at step 4, not at the end
    assert find_resumable(os.path.join(str(tmp_path), "version_0", "checkpoints")) is None
    saver = t.checkpoint_callback  # the failed file is not remembered as kept, best or last
    assert saver.kept == [] and saver.best_model_path == "" and saver.last_model_path == "", saver.kept


_KILLED = """
import sys
sys.path.insert(0, {tests!r})
from async_ckpt_module import Lin, set_hooks, trainer
from polytrain.callbacks.model_checkpoint import ModelCheckpoint

class Announce(ModelCheckpoint):
    def _save(self, trainer):
        super()._save(trainer)
        print("staged", trainer.global_step, flush=True)

set_hooks(delay=2.0)
trainer({root!r}, max_steps=40, save_top_k=1, save_last=False, saver_class=Announce).fit(Lin())
"""


def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint_to_resume(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(_KILLED.format(tests=os.path.dirname(__file__), root=root)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # "staged 4": step 2's file is complete (step 4 waited), step 4's in flight
            if line.split() == ["staged", "4"]:
                proc.kill()
                break
        assert proc.wait(timeout=60) == -9
    finally:
        proc.kill()
    ckpt_dir = os.path.join(root, "version_0", "checkpoints")
    assert find_resumable(ckpt_dir).endswith("epoch=0-step=2.ckpt"), os.listdir(ckpt_dir)
    start = StepAtStart()
    resumed = trainer(root, max_steps=6, save_top_k=1, callbacks=[start])
    resumed.fit(Lin(), ckpt_path="last")
    assert (start.step, resumed.global_step) == (2, 6)
