"""Asynchronous checkpoints on 2 gloo ranks: ddp (one file from rank 0) and fsdp (DCP's async_save over
a gloo group of its own). A failed background write raises on every rank; staged weights are the
save step's; async-saved checkpoints resume across world sizes (ddp x2 -> 1 process -> ddp x2) and
under fsdp x2."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from async_ckpt_module import Lin, StepAtStart, WeightsAt, set_hooks, trainer
from distributed import run_distributed

from polytrain.checkpoint.layout import find_resumable
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.core.errors import CheckpointError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _failing(rank: int, world: int, root: str, strategy: str, fail_rank: int) -> str:
    set_hooks(delay=0.2, fail_rank=fail_rank)
    t = trainer(root, strategy=strategy, devices=world, max_steps=6)
    try:
        t.fit(Lin())
    except CheckpointError as err:
        return f"{t.global_step}: {err}"
    return "no error"


@pytest.mark.parametrize("strategy,fail_rank", [("ddp", 0), ("fsdp", 1)])
def test_a_failed_background_write_raises_on_every_rank(tmp_path: Path, strategy: str, fail_rank: int) -> None:
    results = run_distributed(_failing, 2, str(tmp_path), strategy, fail_rank, timeout=240)
    for message in results:  # both ranks, at the next save (step 4), with the failing rank's reason
        assert message.startswith("4: checkpoint failed on rank"), results
        assert "No space left on device (injected" in message, results


def _train_and_record(rank: int, world: int, root: str, strategy: str, ckpt: str | None, steps: int,
                      stage_delay: float = 0.0) -> Any:
    # Steps after each save run while it is written (or, with stage_delay, while it is still being staged).
    set_hooks(delay=0.0 if stage_delay else 0.4, stage_delay=stage_delay)
    weights, start = WeightsAt({4, steps}), StepAtStart()
    t = trainer(root, strategy=strategy, devices=world, max_steps=steps, callbacks=[weights, start])
    t.fit(Lin(), ckpt_path=ckpt)
    return {"weights": weights.weights, "start": start.step, "dir": os.path.dirname(t.checkpoint_callback.last_model_path)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_async_checkpoints_resume_on_one_process_and_back(tmp_path: Path) -> None:
    first = run_distributed(_train_and_record, 2, str(tmp_path / "ddp"), "ddp", None, 8, timeout=240)[0]
    step4 = os.path.join(first["dir"], "epoch=0-step=4.ckpt")
    assert _equal(read_checkpoint(step4)["model"], first["weights"][4])  # staged at step 4, not later
    single = _train_and_record(0, 1, str(tmp_path / "one"), "single", step4, 8)
    assert single["start"] == 4
    back = run_distributed(_train_and_record, 2, str(tmp_path / "two"), "ddp", find_resumable(single["dir"]), 10,
                           timeout=240)[0]
    assert back["start"] == 8


def test_fsdp_async_dcp_checkpoint_holds_the_save_steps_weights_and_resumes(tmp_path: Path) -> None:
    # The shards are copied by the writer threads after a delay: the next update must wait for them.
    first = run_distributed(_train_and_record, 2, str(tmp_path / "a"), "fsdp", None, 8, 0.4, timeout=240)[0]
    step4 = os.path.join(first["dir"], "epoch=0-step=4")
    assert os.path.isdir(step4)
    saved = read_checkpoint(step4)["model"]
    assert _equal(saved, first["weights"][4]) and not _equal(saved, first["weights"][8])
    resumed = run_distributed(_train_and_record, 2, str(tmp_path / "b"), "fsdp", step4, 8, timeout=240)[0]
    assert resumed["start"] == 4
    for key, value in resumed["weights"][8].items():  # the resumed run ends where the uninterrupted one did
        torch.testing.assert_close(value, first["weights"][8][key])
