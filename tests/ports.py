"""Ports for the jobs the tests start, chosen so that two tests running at once cannot take the same one.

A port the kernel hands out for ``bind(("", 0))`` lies in the ephemeral range (32768-60999 on Linux),
the same range it hands to every client socket and to every gloo pair another test opens. Between our
probe and the moment the job's rank 0 listens on it, a parallel test's connection can take it; the
job's ranks then talk to a stranger, and the launch ends at its timeout. So the tests take ports
below that range instead, from a block of their own per pytest-xdist worker, and probe each one
before handing it out.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

_FIRST = 20_000  # below the kernel's ephemeral range, above the well-known services
_BLOCK = 1_000  # ports per pytest-xdist worker: gw0 takes 20000-20999, gw1 21000-21999, ...
_WORKERS = 12  # blocks available before 32768

_lock = threading.Lock()
_offsets = itertools.count(os.getpid() % _BLOCK)  # a later pytest session starts elsewhere in the block


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"; unset when tests run in one process
    digits = worker.removeprefix("gw")
    return int(digits) % _WORKERS if digits.isdigit() else 0


def _is_free(port: int) -> bool:
    """Nobody listens on, or is connected from, ``port`` on any local address right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port in this worker's block that nothing holds now; the next call returns a different one."""
    base = _FIRST + _worker_index() * _BLOCK
    with _lock:
        for _ in range(_BLOCK):
            port = base + next(_offsets) % _BLOCK
            if _is_free(port):
                return port
    raise RuntimeError(f"every port in {base}-{base + _BLOCK - 1} is taken; the test machine is out of "
                       f"ports for test jobs")
