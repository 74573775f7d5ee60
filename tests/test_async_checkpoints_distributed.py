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

pytestmark = [pytest.mark.torch_api, pytest.mark.distributed, pytest.mark.timeout(300)]


def _failing(rank: int, world: int, root: str, strategy: str, fail_rank: int) -> str:
    set_hooks(delay=0.2, fail_rank=fail_rank)
    t = trainer(root, strategy=strategy, devices=world, max_steps=6)
    try:
        t.fit(Lin())
    except CheckpointError as err:
        return f"{t.global_step}: {err}"
    return "no error"


@pytest.mark.parametrize("strategy,fail_rank", [("ddp", 0), ("fsdp", 1)])
def test_a_failed_background_write_raises_on_every_rank(tmp_path: Path, strategy: str,
                                                        fail_rank: int) -> None:
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
    return {"weights": weights.weights, "start": start.step,
            "dir": os.path.dirname(t.checkpoint_callback.last_model_path)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_async_checkpoints_resume_on_one_process_and_back(tmp_path: Path) -> None:
    first = run_distributed(_train_and_record, 2, str(tmp_path / "ddp"), "ddp", None, 8, timeout=240)[0]
    step4 = os.path.join(first["dir"], "epoch=0-step=4.ckpt")
    assert _equal(read_checkpoint(step4)["model"], first["weights"][4])  # staged at step 4, not later
    single = _train_and_record(0, 1, str(tmp_path / "one"), "single", step4, 8)
    assert single["start"] == 4
    back = run_distributed(_train_and_record, 2, str(tmp_path / "two"), "ddp", find_resumable(single["dir"]),
                           10, timeout=240)[0]
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


class _Stack(Lin):
    """Lin with what the pipeline and tensor-parallel layouts ask of a module."""

    def pipeline_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, y)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}


def _staged_under(rank: int, world: int, root: str, strategy: Any) -> tuple[bool | None, list[float]]:
    set_hooks(stage_delay=0.3)  # the background copy starts late: the next update must wait for it
    weights = WeightsAt({4, 8})
    t = trainer(root, strategy=strategy, devices=world, max_steps=8, callbacks=[weights])
    t.fit(_Stack())
    name = "epoch=0-step=4" + (".ckpt" if t.strategy.replicated else "")
    saved = read_checkpoint(os.path.join(os.path.dirname(t.checkpoint_callback.last_model_path),
                                         name))["model"]
    io = t.strategy.checkpoint_io
    waits = io.writer.staging_waits if "_writer" in io.__dict__ else []
    # Where the whole model is gathered (pipeline, tp), global rank 0 alone holds it: the others record
    # nothing.
    mine = weights.weights[4]
    return (all(torch.equal(saved[k], v) for k, v in mine.items()) if mine else None), waits


@pytest.mark.parametrize("strategy", ["ddp", "pipeline", {"name": "parallel", "tp": 2, "dp_shard": 1}],
                         ids=["ddp", "pipeline", "tp2"])
def test_the_background_copy_is_awaited_under_every_layout(tmp_path: Path, strategy: Any) -> None:
    """Each layout's updates wait for the delayed background copy: the file holds the save step's weights
    (fsdp: the test above); the ranks that stage (rank 0 of a file, every rank of a directory) waited."""
    results = run_distributed(_staged_under, 2, str(tmp_path), strategy, timeout=240)
    assert results[0][0] is True and all(equal is not False for equal, _ in results), results
    assert results[0][1] and results[0][1][0] > 0, results
