"""``polytrain.utilities.types``: the type names Lightning code annotates its steps and hooks with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

STEP_OUTPUT = torch.Tensor | Mapping[str, Any]
EVAL_DATALOADERS = Any
TRAIN_DATALOADERS = Any
OptimizerLRScheduler = Any
LRSchedulerTypeUnion = Any

__all__ = ["EVAL_DATALOADERS", "LRSchedulerTypeUnion", "OptimizerLRScheduler", "STEP_OUTPUT",
           "TRAIN_DATALOADERS"]
