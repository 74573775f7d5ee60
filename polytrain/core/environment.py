"""Where this process sits in the job: read from torchrun's or SLURM's variables, never guessed."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterEnvironment:
    global_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "none"  # "torchrun", "slurm", or "none" (a plain single process)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is required by this launcher but is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} must be an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """``node[003-005,9],other`` -> ``node003``: the first host of a SLURM node list."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_is_batch_job() -> bool:
    # An interactive `srun --pty bash` sets SLURM_NTASKS too; its tasks are not our workers.
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def detect_environment() -> ClusterEnvironment:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world_size = _int("WORLD_SIZE")
        return ClusterEnvironment(
            global_rank=_int("RANK"),
            local_rank=_int("LOCAL_RANK", 0),
            world_size=world_size,
            local_world_size=_int("LOCAL_WORLD_SIZE", world_size),
            node_rank=_int("GROUP_RANK", _int("NODE_RANK", 0)),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int("MASTER_PORT", 29500),
            source="torchrun",
        )
    if _slurm_is_batch_job() and _int("SLURM_NTASKS") > 1:
        job_id = _int("SLURM_JOB_ID", 0)
        return ClusterEnvironment(
            global_rank=_int("SLURM_PROCID"),
            local_rank=_int("SLURM_LOCALID"),
            world_size=_int("SLURM_NTASKS"),
            local_world_size=_int("SLURM_NTASKS_PER_NODE", _int("SLURM_NTASKS")) if os.environ.get(
                "SLURM_NTASKS_PER_NODE", "").isdigit() else _int("SLURM_NTASKS"),
            node_rank=_int("SLURM_NODEID", 0),
            master_addr=(os.environ.get("MASTER_ADDR")
                         or _first_slurm_host(os.environ.get("SLURM_NODELIST", ""))),
            # Derived from the job id so that concurrent jobs on one node do not collide.
            master_port=_int("MASTER_PORT", 10000 + job_id % 10000),
            source="slurm",
        )
    return ClusterEnvironment()


def export_for_torch(env: ClusterEnvironment) -> None:
    """torch's ``env://`` init reads these; SLURM jobs do not set them, so we do."""
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    os.environ.setdefault("RANK", str(env.global_rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
