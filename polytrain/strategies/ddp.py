"""``ddp``: one process per device, full replicas, gradients all-reduced during backward.

A preset of ``parallel``: ``dp_replicate`` = every process, through DDP's wrapper (``parallel.ddp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.parallel.apply import Layout
from polytrain.strategies.parallel import ParallelStrategy
from polytrain.strategies.registry import register


@dataclass
class DDPOptions:
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False


@register
class DDPStrategy(ParallelStrategy):
    name = "ddp"
    Options = DDPOptions
    aliases = {  # Lightning's strategy strings
        "ddp_find_unused_parameters_true": {"find_unused_parameters": True},
        "ddp_find_unused_parameters_false": {"find_unused_parameters": False},
    }

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> Layout:
        o = options
        return Layout(dp_replicate=-1, dp_shard=1, data_parallel="ddp", backend=o.backend,
                      sync_batchnorm=o.sync_batchnorm,
                      ddp=dict(find_unused_parameters=o.find_unused_parameters, static_graph=o.static_graph,
                               bucket_cap_mb=o.bucket_cap_mb, gradient_as_bucket_view=o.gradient_as_bucket_view,
                               broadcast_buffers=o.broadcast_buffers))
