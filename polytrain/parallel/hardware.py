"""Hardware figures the planner's cost model uses, with presets for common nodes.

Bandwidths are what one device's ring collective gets (bus bandwidth), per direction: inside a node
over NVLink, between nodes each GPU's share of the node's network (H100 nodes: one 400 Gb/s NIC per
GPU = 50 GB/s). Peak FLOPs are dense bf16 tensor-core figures from the vendors' sheets, and dense fp8
where the device has fp8 tensor cores (float8 training needs them); the ``efficiency`` (model FLOPs
utilisation reached by the kernels) is the user's to set and applies to both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from polytrain.core.errors import ConfigError

GiB = 1024**3


@dataclass(frozen=True)
class Hardware:
    nodes: int
    devices_per_node: int
    memory_bytes: int  # per device
    peak_flops: float  # per device, per second, in the compute dtype
    efficiency: float = 0.4  # fraction of peak the kernels reach (MFU)
    intra_bw: float = 450e9  # bytes/s per device inside a node
    inter_bw: float = 50e9  # bytes/s per device between nodes
    intra_latency: float = 5e-6  # seconds per collective step
    inter_latency: float = 15e-6
    usable_memory: float = 0.9  # allocator fragmentation, CUDA context, NCCL buffers take the rest
    # dense float8 tensor-core peak; None: no fp8 (float8 training refused)
    fp8_peak_flops: float | None = None
    # Device memory bytes/s (datasheet) and the fraction of it a memory-bound kernel reaches: float8's
    # casts and scale reductions run at this rate. None: not costed.
    memory_bandwidth: float | None = None
    memory_efficiency: float = 0.7

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


PRESETS: dict[str, Hardware] = {
    # H100 SXM 80GB: 989 TFLOP/s dense bf16, NVLink4 450 GB/s per direction, 8 x 400 Gb/s InfiniBand;
    # 1979 TFLOP/s dense FP8 (NVIDIA H100 Tensor Core GPU datasheet: 3958 "with sparsity", half dense);
    # HBM3 3.35 TB/s.
    "h100": Hardware(1, 8, 80 * GiB, 989e12, 0.4, 450e9, 50e9, 5e-6, 15e-6, fp8_peak_flops=1979e12,
                     memory_bandwidth=3.35e12),
    # A100 SXM 80GB: 312 TFLOP/s dense bf16, NVLink3 300 GB/s per direction, 8 x 200 Gb/s HDR; no FP8.
    "a100": Hardware(1, 8, 80 * GiB, 312e12, 0.4, 300e9, 25e9, 5e-6, 15e-6),
    # A CPU box running gloo: shared memory between processes, fp32 FLOPs of a few cores.
    "cpu": Hardware(1, 8, 16 * GiB, 50e9, 0.3, 2e9, 1e9, 50e-6, 100e-6),
}

_SIZE = re.compile(r"^\s*([0-9.]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1024, "mib": 1024**2, "gib": GiB, "tib": 1024**4}


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"40 GB"``, ``1e9`` -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"cannot read '{text}' as a memory size; write e.g. 80GiB, 40GB or 1073741824")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def hardware(preset: str, nodes: int, devices_per_node: int, **overrides: float | int | None) -> Hardware:
    """A preset scaled to ``nodes x devices_per_node``; overrides left ``None`` keep the preset's figure."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown hardware preset '{preset}'; choose one of {', '.join(PRESETS)}")
    if nodes < 1 or devices_per_node < 1:
        raise ConfigError(f"need at least one node and one device per node, got nodes={nodes}, "
                          f"devices_per_node={devices_per_node}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[preset], nodes=nodes, devices_per_node=devices_per_node, **given)
