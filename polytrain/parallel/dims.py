"""``ParallelDims``: one object owns the parallel degrees and the device mesh built from them.

Dimension order (outermost first) is ``pp, dp_replicate, dp_shard, tp``: tensor parallel ranks
are neighbours (on a GPU node they share NVLink), pipeline stages are furthest apart. The data-
parallel group is ``dp_replicate x dp_shard``; ranks in one tp/pp group see the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

from polytrain.core.errors import ConfigError


@dataclass
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world after the other degrees
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel degree {name}={getattr(self, name)} must be >= 1 ({self._numbers()})")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.tp * self.pp
            if self.world_size % rest:
                raise ConfigError(
                    f"cannot infer dp_shard: world_size={self.world_size} is not divisible by "
                    f"dp_replicate={self.dp_replicate} x tp={self.tp} x pp={self.pp} = {rest}"
                )
            self.dp_shard = self.world_size // rest
        if self.dp_shard < 1:
            raise ConfigError(f"parallel degree dp_shard={self.dp_shard} must be >= 1 or -1 ({self._numbers()})")
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees do not multiply to the world size: pp={self.pp} x dp_replicate="
                f"{self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} = {product}, but "
                f"world_size={self.world_size}"
            )

    def _numbers(self) -> str:
        return (f"world_size={self.world_size}, pp={self.pp}, dp_replicate={self.dp_replicate}, "
                f"dp_shard={self.dp_shard}, tp={self.tp}")

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dims(self) -> list[tuple[str, int]]:
        """Named dimensions of the mesh, outermost first; degree-1 dims are kept (cheap, uniform)."""
        return [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)]

    def build_mesh(self, device_type: str) -> Any:
        """An N-D ``DeviceMesh``; ``self.dp_mesh`` is its flattened data-parallel (replicate x shard)
        sub-mesh, kept here because slicing a flattened dim from the root mesh is deprecated."""
        names = [n for n, _ in self.dims()]
        self.mesh = init_device_mesh(device_type, tuple(d for _, d in self.dims()), mesh_dim_names=tuple(names))
        self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return self.mesh
