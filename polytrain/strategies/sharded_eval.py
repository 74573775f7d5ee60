"""Evaluation through a sharded root, shared by the strategies whose forward runs collectives
over the data-parallel group (fsdp; model_parallel tensor mode with a data-parallel dimension)."""

from __future__ import annotations

from typing import Any

from polytrain.core.protocol import muted_logs
from polytrain.data.padding import PaddingState
from polytrain.strategies.router import PADDING_BATCH, step_args


def padded_eval_step(strategy: Any, padding: PaddingState, stage: str, batch: Any,
                     batch_idx: int, dataloader_idx: int | None = None) -> Any:
    """An evaluation step through the sharded root (its forward gathers parameters, so every rank
    must run it); on a padding batch the step still runs, its logs are dropped and the loops are
    told with ``PADDING_BATCH``."""
    with strategy.precision.forward_context():
        args = step_args(batch, batch_idx, dataloader_idx)
        if not padding.active:
            return strategy.model(f"{stage}_step", *args)
        with muted_logs(strategy.module):
            strategy.model(f"{stage}_step", *args)
        return PADDING_BATCH
