"""FSDP under a pipeline (strategy ``parallel``): how often a unit is gathered in a step."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from polytrain import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distributed import run_distributed  # noqa: E402
from test_composition import BATCH, GPT, SIZE, strategy  # noqa: E402 - the composition tests' model and layouts

pytestmark = pytest.mark.torch_api


def _gathers_in_one_step(rank: int, world: int, root: str, reshard: bool | None) -> int:
    """FSDP all-gathers (of a unit's parameters) this rank issues in one pp2 x dp_shard2 step of 4
    micro-batches."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    calls = [0]
    original = param_group.foreach_all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    param_group.foreach_all_gather = counting
    options = {**strategy("pp2_dp2"), **({} if reshard is None else {"reshard_after_forward": reshard})}
    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=options, max_steps=1, seed=0, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, run_dir=os.path.join(root, str(reshard)),
                      timeout=120.0)
    trainer.fit(GPT(batch_size=BATCH // 2, **SIZE))
    return calls[0]


@pytest.mark.timeout(300)
def test_a_pipeline_does_not_gather_fsdp_units_for_every_micro_batch(tmp_path: Any) -> None:
    """Under a pipeline FSDP keeps a unit gathered after its forward (PipelineStage keeps it gathered after
    backward anyway): one gather a step instead of one per micro-batch (m + 1), as torchtitan does; the
    option still turns resharding back on."""
    default = run_distributed(_gathers_in_one_step, 4, str(tmp_path), None, timeout=280)
    resharding = run_distributed(_gathers_in_one_step, 4, str(tmp_path), True, timeout=280)
    assert all(0 < d < r for d, r in zip(default, resharding)), (default, resharding)


def _validate_and_save(rank: int, world: int, root: str, reshard: bool | None) -> tuple[Any, float]:
    """pp2 x dp_shard2, validation after every step (units left gathered by a forward without backward),
    checkpoints written by ModelCheckpoint and after fit; the full weights on rank 0 and the last val loss."""
    options = {**strategy("pp2_dp2"), **({} if reshard is None else {"reshard_after_forward": reshard})}
    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=options, max_steps=3, seed=0, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                      limit_val_batches=1, val_check_interval=1, run_dir=os.path.join(root, str(reshard)),
                      timeout=120.0)
    trainer.fit(GPT(batch_size=BATCH // 2, **SIZE))
    trainer.save_checkpoint(os.path.join(root, f"{reshard}.ckpt"))
    state = trainer.strategy.module_state_dict()
    return (({k: v.detach().clone() for k, v in state.items()} or None),
            float(trainer.callback_metrics["val/loss"]))


@pytest.mark.timeout(300)
def test_validation_and_checkpoints_match_with_and_without_resharding(tmp_path: Any) -> None:
    kept = run_distributed(_validate_and_save, 4, str(tmp_path), None, timeout=280)
    resharded = run_distributed(_validate_and_save, 4, str(tmp_path), True, timeout=280)
    assert [r[1] for r in kept] == [r[1] for r in resharded]
    weights, reference = kept[0][0], resharded[0][0]
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in weights)
    assert os.listdir(os.path.join(tmp_path, "None", "version_0", "checkpoints"))  # ModelCheckpoint wrote
