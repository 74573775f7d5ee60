"""``model_parallel``: a model too big for one device, split two ways.

``mode: tensor`` — every process holds a slice of each large layer (Megatron-style tensor
parallelism over the ``tp`` dimension of a ``DeviceMesh``), following the module's plan:
``tensor_parallel_plan(self) -> {submodule name: ColwiseParallel(), ...}`` or
``parallelize(self, tp_mesh)``, else the plan of a Hugging Face model it holds
(``parallel/library_plans.py``). With ``dp_shard > 1`` the result is also sharded with FSDP2 over
the data-parallel dimension (2D). Data follows the mesh: ranks of one tensor-parallel group see
the same batch; the sampler splits over the data-parallel dimension only. A preset of ``parallel``.

``mode: layers`` — the layers of the module's ``nn.Sequential`` spread over the devices one process
drives (``strategies.layer_placement``: not a mesh degree, so its own class, which this one hands it to).
"""

from __future__ import annotations

from typing import Any

from polytrain.parallel.apply import ParallelLayout
from polytrain.strategies.composed import ParallelStrategy
from polytrain.strategies.layer_placement import LayerPlacementStrategy, find_sequential, processes_for
from polytrain.strategies.options import ModelParallelOptions
from polytrain.strategies.registry import register

__all__ = ["ModelParallelOptions", "ModelParallelStrategy", "find_sequential"]

def _option(options: Any, name: str) -> Any:
    if isinstance(options, dict):
        return options.get(name, getattr(ModelParallelOptions, name))
    return getattr(options, name, getattr(ModelParallelOptions, name))


@register
class ModelParallelStrategy(ParallelStrategy):
    """Tensor mode (a preset of ``parallel``); the registry's ``build`` hands ``mode: layers`` to
    ``LayerPlacementStrategy``, so both modes keep the one name."""

    name = "model_parallel"
    Options = ModelParallelOptions

    @classmethod
    def build(cls, options: Any, **kwargs: Any) -> Any:
        if options.mode == "layers":
            return LayerPlacementStrategy.build(options, **kwargs)
        return super().build(options, **kwargs)

    @classmethod
    def processes_per_node(cls, devices: int, options: Any = None) -> int:
        if _option(options, "mode") != "layers":
            return devices
        return processes_for(devices, _option(options, "devices_per_process"))

    @classmethod
    def parallel_dims(cls, options: Any, env: Any, num_nodes: int) -> Any:
        return None if options.mode == "layers" else super().parallel_dims(options, env, num_nodes)

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> ParallelLayout:
        o = options
        # tp None: whatever the data-parallel degrees leave (dp_shard -1 then means 1: one -1 at a time).
        tp, dp_shard = (o.tp, o.dp_shard) if o.tp is not None else (-1, max(o.dp_shard, 1))
        return ParallelLayout(tp=tp, dp_shard=dp_shard, dp_replicate=o.dp_replicate, backend=o.backend,
                              tensor_parallel=True)  # the plan is applied (and checked) even at tp=1
