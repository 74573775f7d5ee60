"""The heavy parts of ``torch.distributed``, imported on first use.

``import polytrain`` plus a single-device ``Trainer`` must stay cheap (benchmarks/import_time.py),
and validating a config in the launching process must not pay for what only the workers of a
sharded run need. Seconds to import each on top of ``import torch`` (torch 2.15, 2-core CPU):

    torch.distributed.tensor          0.4    DTensor: fsdp, tensor parallel, sharded checkpoints
    torch.distributed.checkpoint      0.6    DCP: every checkpoint's optimizer state, sharded files
    torch.distributed.fsdp            0.5    fully_shard
    torch.distributed.pipelining      1.3    pipeline schedules and stages
    torch.utils.flop_counter          0.08   the planner's FLOP counts (it imports triton where installed)

Every function-level import of them in the package goes through here, so the dependency on each
is one grep away.
"""

from __future__ import annotations

from types import ModuleType


def dtensor() -> ModuleType:
    """``torch.distributed.tensor`` with its ``parallel`` (tensor-parallel styles) and ``experimental``
    (``context_parallel``) submodules."""
    import torch.distributed.tensor.experimental  # late: 0.4 s, see the module docstring

    return torch.distributed.tensor


def dcp() -> ModuleType:
    """``torch.distributed.checkpoint`` (its ``state_dict``, ``default_planner``, ``metadata``,
    ``filesystem`` and ``state_dict_loader`` submodules come with it)."""
    import torch.distributed.checkpoint as module  # late: 0.6 s, see the module docstring
    import torch.distributed.checkpoint.state_dict  # noqa: F401 # late: not loaded by the package itself

    return module


def fsdp() -> ModuleType:
    import torch.distributed.fsdp as module  # late: 0.5 s, see the module docstring

    return module


def pipelining() -> ModuleType:
    """``torch.distributed.pipelining`` with its ``schedules`` and ``_utils`` submodules."""
    import torch.distributed.pipelining as module  # late: 1.3 s, see the module docstring

    return module


def flop_counter() -> ModuleType:
    """``torch.utils.flop_counter`` (``FlopCounterMode``, ``flop_registry``): only a traced model needs it,
    and with CUDA's torch it loads triton, most of what ``from polytrain import Trainer`` would cost."""
    import torch.utils.flop_counter as module  # late: 0.08 s, see the module docstring

    return module
