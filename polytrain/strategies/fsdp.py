"""``fsdp``: FSDP2 (``fully_shard``). Parameters, gradients and optimizer state are sharded over the
data-parallel ranks; each block's parameters are all-gathered just before its forward/backward and
freed after. ``dp_replicate > 1`` (or several nodes) gives HSDP: shard within a group, replicate
across groups. See docs/strategies/fsdp.md.

A preset of ``parallel``: ``dp_shard`` = what ``dp_replicate`` leaves of the world, FSDP even on one
rank, layers built on the meta device in ``configure_model``.
"""

from __future__ import annotations

from typing import Any

from polytrain.parallel.apply import FSDPSettings, ParallelLayout
from polytrain.strategies.composed import ParallelStrategy
from polytrain.strategies.options import FSDPOptions
from polytrain.strategies.registry import register


@register
class FSDPStrategy(ParallelStrategy):
    name = "fsdp"
    Options = FSDPOptions

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> ParallelLayout:
        o = options
        replicas = o.dp_replicate if o.dp_replicate is not None else num_nodes
        return ParallelLayout(dp_replicate=replicas, dp_shard=-1, data_parallel="fsdp", backend=o.backend,
                              sync_batchnorm=o.sync_batchnorm,
                              fsdp=FSDPSettings(o.wrap_modules, o.reshard_after_forward, o.cpu_offload))
