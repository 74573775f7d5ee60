"""What the multi-process benchmarks share: a free loopback port and the launcher variables a worker
process sets before joining a gloo group on this machine (what torchrun would have exported)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def export_rank(rank: int, world: int, port: int) -> None:
    """Worker ``rank`` of ``world`` on one node, rendezvous at 127.0.0.1:``port``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")


def worker_context() -> Any:
    """Workers forked from a server that has imported torch and polytrain once, as ``polytrain fit`` starts
    its own (polytrain/strategies/launcher.py): a benchmark that starts ranks for every mode pays the imports
    once, not in every rank. Nothing timed includes them either way."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed", "torch.optim", "torch._dynamo",
                                "polytrain.trainer.trainer"])
    return ctx


def first_result(target: Callable[..., None], world: int, extra: tuple[Any, ...], timeout: float,
                 join_timeout: float = 30.0) -> Any:
    """``target(rank, world, port, *extra, results)`` in ``world`` worker processes; the first
    ``(status, payload)`` one puts on ``results`` is the answer (a failure raises with its traceback)."""
    ctx = worker_context()
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, *extra, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        status, payload = results.get(timeout=timeout)
    finally:
        for proc in procs:
            proc.join(timeout=join_timeout)
            if proc.is_alive():
                proc.terminate()
    if status != "ok":
        raise RuntimeError(f"benchmark worker failed:\n{payload}")
    return payload
