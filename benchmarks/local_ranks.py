"""What the multi-process benchmarks share: a free loopback port and the launcher variables a worker
process sets before joining a gloo group on this machine (what torchrun would have exported)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def export_rank(rank: int, world: int, port: int) -> None:
    """Worker ``rank`` of ``world`` on one node, rendezvous at 127.0.0.1:``port``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
