"""Run a function on N real gloo processes and collect what each returns.

Every call has a deadline: a rank that raises ends the run with its traceback, a rank that
hangs ends it at the timeout, and the survivors are killed either way. No test can hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

try:
    from ports import free_port
except ModuleNotFoundError:  # imported as ``tests.distributed`` by a script run from the repository root
    from tests.ports import free_port


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    for name in ("PL_GLOBAL_SEED", "POLYTRAIN_SEED"):  # a seed_everything of the process that started the
        os.environ.pop(name, None)  # fork server asks for Lightning's seeding: only fn's own call may
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle, not the queue's shared-memory tensor reduction: the child exits before the
        # parent reads, and shared storages would die with it.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank attached
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


class DistributedRunError(RuntimeError):
    pass


# Workers come from a fork server that has imported torch (and what the first optimizer pulls in)
# once: a fresh interpreter per rank costs 5-15 s of imports on a 2-core machine, a fork of the
# server a fraction of a second. The model libraries the tests build from (torchvision, and
# transformers' GPT-2 and Llama) are loaded there too: 1-2 s less for every test that trains one of
# their models; a library that is not installed is skipped by the server. The server never
# initialises a process group or an OpenMP pool, so forking it is safe.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo",
            "polytrain.trainer.trainer", "polytrain.trainer.loops", "polytrain.strategies.ddp",
            "polytrain.strategies.single", "polytrain.trainer.configuration.default_callbacks",
            "torchvision", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.llama.modeling_llama"]
_context: Any = None


def _get_context() -> Any:
    global _context
    if _context is None:
        if os.environ.get("POLYTRAIN_TEST_START_METHOD", "forkserver") == "spawn":
            _context = mp.get_context("spawn")
        else:
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # read once by the server's OpenMP runtime
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(_PRELOAD)
    return _context


PORT_ATTEMPTS = 3


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank. A port
    free when chosen may be taken by another job before rank 0 binds it (a busy machine): then the run
    starts again on another port."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except DistributedRunError as err:
            text = str(err).lower()
            if attempt == PORT_ATTEMPTS or not ("eaddrinuse" in text or "address already in use" in text):
                raise
    raise AssertionError("unreachable")


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    ctx = _get_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise DistributedRunError(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise DistributedRunError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting"
                    ) from None
                continue
            if status == "error":
                raise DistributedRunError(f"rank {rank} failed:\n{payload}")
            collected[rank] = pickle.loads(payload)
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[rank] for rank in range(world_size)]
