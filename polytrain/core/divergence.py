"""Divergence guard: every framework collective checks in first, so mismatched ranks get an error
that names them and their call sites instead of a hang.

Enabled by ``trainer.detect_divergence: true``. Before each collective in
``polytrain.core.collectives``, a rank writes ``(sequence number, op, call site)`` to the
job's key-value store and waits for every peer's entry of the same sequence number:

- a peer that reached a *different* collective (another op or another line) -> ``DivergenceError``
  naming both ranks and both call sites;
- a peer that never arrives within the timeout -> ``DivergenceError`` naming the missing rank(s)
  and the last collective each of them checked in at.

The store, not a collective, carries the check-in, so the check itself cannot pair up with a
mismatched collective. It costs a few store round trips per collective: a debug mode. It also
sets ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (unless set), so torch checks its own collectives too.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch.distributed as dist

from polytrain.core.errors import DivergenceError

_state: dict[str, Any] = {"enabled": False, "timeout": 300.0, "seq": {}}
_THIS_FILE_PARTS = ("polytrain/core/collectives.py", "polytrain/core/divergence.py",
                    "polytrain/strategies/base.py", "polytrain/strategies/collective_verbs.py")


def enable(timeout_s: float) -> None:
    """Turn the guard on in this process; call before the process group starts to also get torch's
    own checks (``TORCH_DISTRIBUTED_DEBUG``)."""
    os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    _state.update(enabled=True, timeout=float(timeout_s), seq={})


def disable() -> None:
    _state.update(enabled=False, seq={})


def is_enabled() -> bool:
    return bool(_state["enabled"])


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith(_THIS_FILE_PARTS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _group_ranks(group: Any) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def check_in(op: str, group: Any = None) -> None:
    """Called by every framework collective before it runs (a no-op unless enabled)."""
    if not _state["enabled"] or not (dist.is_available() and dist.is_initialized()):
        return
    ranks = _group_ranks(group)
    if len(ranks) < 2:
        return
    key = "-".join(map(str, ranks))
    seq = _state["seq"].get(key, 0) + 1
    _state["seq"][key] = seq
    me = dist.get_rank()
    entry = f"{op}@{_call_site()}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"polytrain/div/{key}/last/{me}", f"#{seq} {entry}")
    store.set(f"polytrain/div/{key}/{seq}/{me}", entry)
    peers = [r for r in ranks if r != me]
    wanted = [f"polytrain/div/{key}/{seq}/{r}" for r in peers]
    try:
        store.wait(wanted, datetime.timedelta(seconds=_state["timeout"]))
    except Exception as err:  # noqa: BLE001 - a store timeout; report who is missing instead
        try:
            missing = [r for r, k in zip(peers, wanted) if not store.check([k])]
        except Exception:  # noqa: BLE001 - the store itself is gone, not just slow
            raise DivergenceError(
                f"rank {me} lost the job's key-value store while waiting at collective #{seq} {entry} "
                f"({type(err).__name__}); the rank hosting it (rank 0) has probably failed: see its error"
            ) from None
        where = "; ".join(f"rank {r} last checked in at {_last(store, key, r)}" for r in missing)
        raise DivergenceError(
            f"rank {me} waited {_state['timeout']:.0f}s at collective #{seq} {entry} but rank(s) {missing} "
            f"never reached it ({where})"
        ) from None
    for r, k in zip(peers, wanted):
        theirs = store.get(k).decode()
        if theirs != entry:
            raise DivergenceError(
                f"ranks disagree at collective #{seq}: rank {me} is at {entry}, rank {r} is at {theirs}. "
                f"A collective inside a rank-dependent branch? Every rank must call the same collectives "
                f"in the same order"
            )
    if seq > 2:
        # Keep the store small: entries two collectives back are no longer read by anyone.
        store.delete_key(f"polytrain/div/{key}/{seq - 2}/{me}")


def _last(store: Any, key: str, rank: int) -> str:
    k = f"polytrain/div/{key}/last/{rank}"
    return store.get(k).decode() if store.check([k]) else "(none: no collective yet)"
