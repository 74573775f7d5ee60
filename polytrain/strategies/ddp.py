"""``ddp``: one process per device, full replicas, gradients all-reduced during backward.

A preset of ``parallel``: ``dp_replicate`` = every process, through DDP's wrapper (``parallel.ddp_wrapping``).
"""

from __future__ import annotations

from typing import Any

from polytrain.parallel.apply import ParallelLayout
from polytrain.strategies.composed import ParallelStrategy
from polytrain.strategies.options import DDPOptions
from polytrain.strategies.registry import register


@register
class DDPStrategy(ParallelStrategy):
    name = "ddp"
    Options = DDPOptions

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> ParallelLayout:
        o = options
        wrapper = dict(find_unused_parameters=o.find_unused_parameters, static_graph=o.static_graph,
                       bucket_cap_mb=o.bucket_cap_mb, gradient_as_bucket_view=o.gradient_as_bucket_view,
                       broadcast_buffers=o.broadcast_buffers)
        return ParallelLayout(dp_replicate=-1, dp_shard=1, data_parallel="ddp", backend=o.backend,
                              sync_batchnorm=o.sync_batchnorm, ddp=wrapper)
