"""Requirement 4: checkpoint integrity.

- A writer SIGKILLed mid-write, between write and rename, or between rename and the ``latest``
  pointer update never leaves a checkpoint that ``resume: last`` would pick and fail to load;
  resuming from what it picks ends BITWISE equal to an uninterrupted run.
- A truncated newest checkpoint: resume falls back to the previous complete one, and says so.
- An unwritable destination (as root ``chmod`` stops nothing, so: a run_dir *under a regular file*
  -> ENOTDIR, and a regular file where ``checkpoints/`` should be -> EEXIST; both fail for root)
  makes EVERY rank of a 2-rank job exit non-zero with a clear message: no silent skip, no hang.
- Retention never deletes the only complete checkpoint: with ``save_top_k=1`` a failed write
  (ENOSPC) leaves the previous checkpoint in place and loadable.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from polytrain import Trainer
from polytrain.callbacks.base import Callback
from polytrain.callbacks.model_checkpoint import ModelCheckpoint
from polytrain.checkpoint.layout import find_resumable, is_complete
from polytrain.checkpoint.reading import read_checkpoint

from .conftest import CKPT_KILL_MODES
from .helpers import Done, bitwise_equal, figure, pick, rel_module

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]

MAX_STEPS = 8


def _module() -> Any:
    return rel_module().RelModule(n=32, batch_size=4)


def _fit(run_dir: str, ckpt_path: str | None = None, max_steps: int = MAX_STEPS,
         callbacks: list | None = None, every_n: int = 1, top_k: int = 1) -> tuple[Any, Trainer]:
    module = _module()
    trainer = Trainer(strategy="single", accelerator="cpu", devices=1, max_steps=max_steps, run_dir=run_dir,
                      seed=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[*(callbacks or []),
                                 ModelCheckpoint(every_n_train_steps=every_n, save_top_k=top_k,
                                                 save_on_fit_end=False)])
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def _weights(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    module, _ = _fit(str(tmp_path_factory.mktemp("ckpt-reference") / "run"))
    return _weights(module)


@pytest.mark.timeout(1800)
def test_writer_killed_mid_save_never_yields_a_corrupt_load(jobs: dict[str, Done], reference: dict,
                                                            tmp_path: Path) -> None:
    results: dict[str, list[str]] = {mode: [] for mode in CKPT_KILL_MODES}
    corrupt, exact, total = 0, 0, 0
    for done in pick(jobs, "ckpt/"):
        mode = done.job.meta.get("mode")
        if mode not in CKPT_KILL_MODES:
            continue
        total += 1
        assert done.returncode == -9, (done.returncode, done.output[-2000:])  # it really was SIGKILLed
        ckpt_dir = os.path.join(done.job.out_dir, "run", "version_0", "checkpoints")
        k = done.job.meta["save_number"]
        path = find_resumable(ckpt_dir)
        try:
            payload = read_checkpoint(path)
            step = int(payload["loop"]["global_step"])
        except Exception as err:  # noqa: BLE001 - counted: this is what must never happen
            corrupt += 1
            results[mode].append(f"save {k}: CORRUPT {err}")
            continue
        # Killed during save k (at step k): the newest complete checkpoint is step k-1, or step k
        # once renamed into place (the pointer may still name k-1: both are complete and exact).
        allowed = {k - 1, k} if mode == "after_rename" else {k - 1}
        assert step in allowed, (mode, k, step, sorted(os.listdir(ckpt_dir)))
        hidden = [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-")]
        if mode in ("mid_write", "before_rename"):
            assert hidden, "the killed write should have left its temporary file behind"
            assert not is_complete(os.path.join(ckpt_dir, hidden[0])) or mode == "before_rename"
        work = tmp_path / f"{mode}-{k}-{total}"
        shutil.copytree(os.path.dirname(ckpt_dir), work / "run" / "version_0")
        module, trainer = _fit(str(work / "run"), ckpt_path="last")
        same = bitwise_equal(_weights(module), reference) and trainer.global_step == MAX_STEPS
        exact += same
        results[mode].append(f"save {k}: resumed from step {step}, bitwise={same}")
    figure("checkpoint writer SIGKILLed mid-save",
           f"corrupt loads {corrupt}/{total}; resumed runs bitwise equal "
           f"{exact}/{total} ({results})", corrupt=corrupt, trials=total)
    assert corrupt == 0 and exact == total, results


@pytest.mark.timeout(600)
def test_truncated_newest_checkpoint_falls_back_to_previous(tmp_path: Path, reference: dict,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    run_dir = str(tmp_path / "run")
    _fit(run_dir, max_steps=6, every_n=2, top_k=-1)
    ckpt_dir = os.path.join(run_dir, "version_0", "checkpoints")
    newest = os.path.join(ckpt_dir, "epoch=0-step=6.ckpt")
    size = os.path.getsize(newest)
    with open(newest, "r+b") as fh:
        fh.truncate(size // 3)  # last.ckpt is a hard link to it: torn as well
    caplog.set_level(logging.WARNING, logger="polytrain")
    module, trainer = _fit(run_dir, ckpt_path="last", every_n=2, top_k=-1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    fell_back = [w for w in warnings
                 if "resuming from" in w and "step=4" in w and "incomplete or corrupt" in w]
    same = bitwise_equal(_weights(module), reference)
    figure("truncated newest checkpoint", f"resume fell back to step 4 with a warning: {bool(fell_back)}; "
                                          f"final weights bitwise equal: {same}")
    assert fell_back, warnings
    assert any("epoch=0-step=6.ckpt is incomplete or corrupt" in w for w in warnings), warnings
    assert same and trainer.global_step == MAX_STEPS


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", ["run_dir", "checkpoints"])
def test_unwritable_checkpoint_destination_fails_every_rank_clearly(jobs: dict[str, Done], case: str) -> None:
    done = pick(jobs, f"unwritable/{case}")[0]
    assert not done.timed_out, done.output[-3000:]
    expected = {"run_dir": "cannot write trainer.run_dir=",
                "checkpoints": "checkpoint failed on rank 0: cannot write"}[case]
    reason = {"run_dir": "Not a directory", "checkpoints": "File exists"}[case]
    per_rank = [(code, expected in err and reason in err) for code, err in zip(done.returncode, done.stderr)]
    figure(f"unwritable checkpoint destination ({case}, 2 ranks)",
           f"ranks exiting non-zero with the message: {sum(c != 0 and ok for c, ok in per_rank)}/2 "
           f"(exit codes {done.returncode}, {done.seconds:.0f}s)")
    for rank, (code, ok) in enumerate(per_rank):
        assert code != 0 and ok, (rank, code, done.stderr[rank][-2000:])
    assert "CheckpointError" in done.stderr[0] and "CheckpointError" in done.stderr[1]


@pytest.mark.timeout(1800)
def test_failed_write_never_leaves_zero_complete_checkpoints(jobs: dict[str, Done]) -> None:
    done = pick(jobs, "ckpt/enospc")[0]
    assert done.returncode not in (0, None) and "No space left on device" in done.output, done.output[-2000:]
    assert "CheckpointError" in done.output
    ckpt_dir = os.path.join(done.job.out_dir, "run", "version_0", "checkpoints")
    complete = [n for n in sorted(os.listdir(ckpt_dir)) if not n.startswith(".") and n != "latest"
                and is_complete(os.path.join(ckpt_dir, n))]
    path = find_resumable(ckpt_dir)
    step = int(read_checkpoint(path)["loop"]["global_step"]) if path else None
    figure("retention after a failed write (save_top_k=1, ENOSPC on save 4)",
           f"complete checkpoints left: {len(complete)} ({complete}); resume picks step {step}")
    assert step == done.job.meta["save_number"] - 1
    assert [n for n in complete if n != "last.ckpt"] == ["epoch=0-step=3.ckpt"]
    assert not [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-")]  # the failed temp file was removed


class _AlwaysOneComplete(Callback):
    """Runs before ModelCheckpoint each step: sees the directory as the previous save left it."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        d = os.path.join(trainer.run_dir, "version_0", "checkpoints")
        if os.path.isdir(d):
            self.counts.append(sum(1 for n in os.listdir(d) if n.endswith(".ckpt") and n != "last.ckpt"
                                   and is_complete(os.path.join(d, n))))


@pytest.mark.timeout(600)
def test_retention_keeps_exactly_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    watcher = _AlwaysOneComplete()
    _fit(str(tmp_path / "run"), callbacks=[watcher], top_k=1)
    figure("retention save_top_k=1", f"complete checkpoints seen between saves: min {min(watcher.counts)}, "
                                     f"max {max(watcher.counts)} over {len(watcher.counts)} steps")
    assert watcher.counts and min(watcher.counts) == 1 and max(watcher.counts) == 1
