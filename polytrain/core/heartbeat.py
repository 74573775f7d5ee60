"""Heartbeats: turn "a collective timed out" into "rank 1 stopped responding at step 7".

A collective that times out (gloo/NCCL) says which operation waited, not which peer never came.
Each rank therefore keeps a tiny position record -- optimizer step, the place in the loop
(``training_step``, ``backward``, ``optimizer_step``, ``on_train_batch_end``, ``validation``,
...) and a sequence number that advances in lockstep on every rank -- and a daemon thread
publishes it to the job's c10d key-value store about once a second. The training thread only
assigns three attributes per position (no store traffic, no device sync on the hot path).

When a collective raises (a timeout, or a peer's connection closed), ``explain(exc)`` reads every
peer's record and names the rank(s) that fell behind: the smallest sequence number, or a record
the peer's thread stopped refreshing (the process died). A peer on this host whose process has
exited is named as dead even while its record is fresh (killed within one publish interval). A
rank that raises (its own error, not a failed collective) publishes at once, synchronously, that
it raised, what and at which step (``failed``): its thread publishes only about once a second, so
a rank that fails quickly would otherwise leave a record of where it was a second earlier (even
"step 0, in setup"), and its peers would report it as lagging there. The Trainer re-raises a
failed collective as ``RankUnresponsiveError`` chained to the original error, so the launcher's
failure summary says who stopped responding and where, e.g.::

    rank 1 stopped responding at step 7 (last seen in training_step, 10.2 s ago); rank 0 waited
    in backward at step 7 until the collective timed out (trainer.timeout=10s)

Enabled for every multi-process run (``Trainer`` starts it after the process group is up).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from polytrain.core.errors import DivergenceError, RankUnresponsiveError

_PREFIX = "polytrain/heartbeat/"
_HOST = socket.gethostname()
_COLLECTIVE_ERROR_HINTS = (
    "timed out", "timeout", "connection closed", "connection reset", "broken pipe", "socket",
    "nccl", "gloo", "watchdog", "connection refused", "peer",
)


class _Heartbeat:
    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, interval_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.step = 0
        self.where = "setup"
        self.seq = 0
        self.error: str | None = None  # set once this rank raised (``failed``)
        self.changed_at = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="polytrain-heartbeat", daemon=True)

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "where": self.where, "seq": self.seq,
                "changed_at": self.changed_at, "pushed_at": time.time(), "pid": os.getpid(),
                "host": _HOST, "error": self.error}

    def push(self) -> None:
        self.store.set(f"{_PREFIX}{self.rank}", json.dumps(self.record()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.push()
            except Exception:  # noqa: BLE001 - the store went away (job ending): stop quietly
                return

    def start(self) -> None:
        with contextlib.suppress(Exception):
            self.push()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)


_current: _Heartbeat | None = None
_atexit_registered = False


def start(rank: int, world_size: int, timeout_s: float, store: Any = None,
          interval_s: float | None = None) -> None:
    """Begin publishing this rank's position (no-op for a single process)."""
    global _current, _atexit_registered
    stop()
    if world_size < 2:
        return
    if store is None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        store = dist.distributed_c10d._get_default_store()
    interval = interval_s if interval_s is not None else max(0.2, min(1.0, timeout_s / 10))
    _current = _Heartbeat(store, rank, world_size, timeout_s, interval)
    _current.start()
    if not _atexit_registered:
        atexit.register(stop)  # join the thread before the interpreter (and the store) shut down
        _atexit_registered = True


def stop() -> None:
    global _current
    hb, _current = _current, None
    if hb is not None:
        hb.stop()


def marker() -> Callable[[str], None] | None:
    """``at`` while this process publishes heartbeats (a multi-process run, after ``start``), else None: a
    hot path fixes it once per run and skips the call entirely on one process."""
    return at if _current is not None else None


def beat(step: int, where: str) -> None:
    """Mark this rank's position. Cheap: attribute assignments only; the thread publishes."""
    hb = _current
    if hb is None:
        return
    hb.seq += 1
    hb.step = step
    hb.where = where
    hb.changed_at = time.time()


def at(where: str) -> None:
    """Like ``beat`` at the current step (for places that do not know the step)."""
    hb = _current
    if hb is not None:
        beat(hb.step, where)


def failed(exc: BaseException, step: int | None = None) -> None:
    """This rank is leaving with ``exc`` (at optimizer step ``step``): publish that now, so peers
    waiting for it in a collective name the error instead of a stale position. A failed collective
    is not this rank's own error (``explain`` names the peer behind it) and is not published."""
    hb = _current
    if (hb is None or hb.error is not None or isinstance(exc, RankUnresponsiveError)
            or looks_like_collective_failure(exc)):
        return
    hb.error = _first_line(exc)
    if step is not None:
        hb.step = step
    with contextlib.suppress(Exception):  # the store may be gone (rank 0 died first): nothing to tell
        hb.push()


def looks_like_collective_failure(exc: BaseException) -> bool:
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(exc, backend_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(hint in text for hint in _COLLECTIVE_ERROR_HINTS)


def _read(store: Any, rank: int) -> dict[str, Any] | None:
    key = f"{_PREFIX}{rank}"
    if not store.check([key]):
        return None
    return json.loads(store.get(key).decode())


def describe_peers(now: float | None = None) -> tuple[list[str], dict[int, dict[str, Any] | None]]:
    """(sentences naming the ranks that fell behind, every rank's record)."""
    hb = _current
    if hb is None:
        return [], {}
    if now is None:
        # A live peer publishes within one interval: wait for it, so a stuck rank's record shows
        # where it is stuck (a dead one's record stays stale, which tells that it died).
        time.sleep(min(1.5 * hb.interval_s, 3.0))
    now = time.time() if now is None else now
    records: dict[int, dict[str, Any] | None] = {}
    for r in range(hb.world_size):
        records[r] = hb.record() if r == hb.rank else _read(hb.store, r)
    stale_after = max(3 * hb.interval_s, 3.0)
    culprits: list[str] = []
    min_seq = min((rec["seq"] for rec in records.values() if rec is not None and not rec.get("error")),
                  default=hb.seq)
    for r, rec in records.items():
        if r == hb.rank:
            continue
        if rec is None:
            culprits.append(f"rank {r} never published a heartbeat (it did not finish starting up)")
            continue
        if rec.get("error"):
            culprits.append(f"rank {r} raised at step {rec['step']} (its last position: {rec['where']}): "
                            f"{rec['error']}")
            continue
        silent = now - rec["pushed_at"]
        idle = now - rec["changed_at"]
        where = f"step {rec['step']} (last seen in {rec['where']}, {idle:.1f} s ago)"
        if _exited(rec):
            # Killed (SIGKILL, the OOM killer) before its record aged: its last report may lag what it ran
            # by up to one interval, so the step is a lower bound.
            culprits.append(f"rank {r} died: its process (pid {rec['pid']}, this host) has exited; it last "
                            f"reported step {rec['step']} (in {rec['where']}, {idle:.1f} s ago; reports come "
                            f"every {hb.interval_s:g} s, so it may have got further)")
        elif silent > stale_after:
            culprits.append(f"rank {r} stopped responding at {where}; its heartbeat stopped {silent:.1f} s "
                            f"ago (the process died or is frozen)")
        elif rec["seq"] < hb.seq and rec["seq"] == min_seq:
            culprits.append(f"rank {r} stopped responding at {where}")
    return culprits, records


def _exited(record: dict[str, Any]) -> bool:
    """Whether the process behind a peer's record is gone: only answerable on this host (Linux's /proc
    shows a killed child its launcher has not reaped yet as a zombie)."""
    pid = record.get("pid")
    if record.get("host") != _HOST or not isinstance(pid, int) or pid == os.getpid():
        return False
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
        except OSError:
            return False
    try:  # no /proc (macOS): signal 0 only checks that the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def explain(exc: BaseException) -> RankUnresponsiveError | None:
    """A clearer error for a failed collective, or None if this does not look like one."""
    hb = _current
    if (hb is None or isinstance(exc, (RankUnresponsiveError, DivergenceError))
            or not looks_like_collective_failure(exc)):
        return None
    try:
        culprits, records = describe_peers()
    except Exception as err:  # noqa: BLE001 - e.g. rank 0 (the store's host) is gone
        return RankUnresponsiveError(
            f"a collective failed on rank {hb.rank} at step {hb.step} (in {hb.where}) and the job's "
            f"key-value store is unreachable ({type(err).__name__}: {err}): the rank hosting it (rank 0) "
            f"has probably died. "
            f"Original error: {_first_line(exc)}")
    me = f"rank {hb.rank} waited in {hb.where} at step {hb.step}"
    if culprits:
        return RankUnresponsiveError(
            f"{'; '.join(culprits)}; {me} until the collective failed (trainer.timeout={hb.timeout_s:g}s). "
            f"Original error: {_first_line(exc)}")
    where = ", ".join(f"rank {r}: step {rec['step']} {rec['where']}" for r, rec in records.items() if rec)
    return RankUnresponsiveError(
        f"a collective failed on rank {hb.rank} while every rank had reached the same point ({where}); "
        f"no rank fell behind, so suspect the network or a peer that exited. Original error: "
        f"{_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
