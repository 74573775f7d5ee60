"""Lightning's ``rank_zero_*`` helpers: code that runs, and messages that print, on global rank 0 only.

``rank_zero_only.rank`` starts from the launcher's environment (``RANK``, ``SLURM_PROCID``,
``LOCAL_RANK``; 0 outside any launcher) and the Trainer sets it to its strategy's global rank, so a
function decorated at import time in a user's module knows its rank once a job has started.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger("polytrain")


def _rank_from_environment() -> int:
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(key)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def rank_zero_only(fn: Callable[..., Any] | None = None, default: Any = None) -> Any:
    """``@rank_zero_only``: ``fn`` runs on global rank 0 and returns ``default`` elsewhere (Lightning's).
    Never put a collective inside: the other ranks would wait for rank 0 forever."""
    if fn is None:
        return functools.partial(rank_zero_only, default=default)

    @functools.wraps(fn)
    def on_rank_zero(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if rank_zero_only.rank == 0 else default

    return on_rank_zero


rank_zero_only.rank = _rank_from_environment()  # type: ignore[attr-defined]


def rank_zero_info(*args: Any, stacklevel: int = 2, **kwargs: Any) -> None:
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
        log.info(*args, stacklevel=stacklevel, **kwargs)


def rank_zero_debug(*args: Any, stacklevel: int = 2, **kwargs: Any) -> None:
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
        log.debug(*args, stacklevel=stacklevel, **kwargs)


def rank_zero_warn(message: str | Warning, category: type[Warning] = UserWarning, stacklevel: int = 2,
                   **kwargs: Any) -> None:
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
        warnings.warn(message, category, stacklevel=stacklevel + 1, **kwargs)
