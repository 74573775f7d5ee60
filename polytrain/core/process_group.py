"""Process-group start-up shared by the multi-process strategies."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from polytrain.core.environment import ClusterEnvironment, export_for_torch

# ``trainer.devices=[i, j, ...]``: the GPU each local rank uses (set by the launch plan of this process).
_cuda_indices: tuple[int, ...] | None = None


def select_cuda_devices(indices: list[int] | tuple[int, ...] | None) -> None:
    """Local rank r uses ``cuda:indices[r]`` (None: ``cuda:r``)."""
    global _cuda_indices
    _cuda_indices = tuple(indices) if indices is not None else None


def cuda_index(local_rank: int) -> int:
    if _cuda_indices is None:
        return local_rank
    if local_rank >= len(_cuda_indices):
        raise RuntimeError(f"local rank {local_rank} has no GPU in trainer.devices={list(_cuda_indices)}: "
                           f"list one GPU index per process of this node")
    return _cuda_indices[local_rank]


def resolve_device(accelerator: str, local_rank: int) -> torch.device:
    if accelerator in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.accelerator='cuda' but no CUDA device is visible; "
                               "use accelerator=cpu")
        count = torch.cuda.device_count()
        index = cuda_index(local_rank)
        if index >= count:
            raise RuntimeError(
                f"local rank {local_rank} needs cuda:{index} but only {count} GPU(s) are visible; "
                f"lower trainer.devices to {count} or fewer"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(env: ClusterEnvironment, backend: str, timeout_s: float) -> None:
    """Join the job's process group (idempotent: a user may have initialised it already)."""
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} already exists, but the launcher "
                f"says WORLD_SIZE={env.world_size}"
            )
        return
    # Bounded waits: a dead peer surfaces as an error after `timeout_s`, not as a hang.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if env.world_size == 1 and "MASTER_PORT" not in os.environ:
        # One process that no launcher started (fsdp or tp on one device, in a script or a notebook): its
        # group meets in memory. A TCP store would take port 29500, and a second such job on the machine
        # would fail on it.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return
    export_for_torch(env)
    dist.init_process_group(
        backend=backend,
        rank=env.global_rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
