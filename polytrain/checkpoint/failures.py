"""Why a checkpoint write failed, said in one line, and the same line raised on every rank.

A full disk does not reach Python as "No space left on device": ``torch.save`` turns the ``OSError`` its
file object raised into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...``, and
DCP wraps each rank's error in a ``CheckpointException`` (a ``BaseException``, so ``except Exception``
never sees it) whose text is a traceback per rank. ``describe_write_failure`` digs out the operating
system's error (its ``__context__``/``__cause__`` chain, or DCP's failures by rank) and says what it
means: the errno, the path, how many bytes the checkpoint needs against what the disk has free or the
file-size limit allows, and the fix. DCP pickles each rank's error to gather it, which drops the chain:
then the failing rank asks the operating system again, by reserving as many bytes as it was writing
next to the checkpoint (``posix_fallocate``, removed at once), and reports the error that meets.

``agree_on_error`` is the collective that turns one rank's failure into the same ``CheckpointError`` on
every rank, naming the rank that failed. A failure may be known on every rank at once (DCP reports every
rank's error to all of them): it is then passed as a ``Failure`` naming the rank it happened on, so the
message never says rank 0 for an error of rank 1.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.core import collectives as C
from polytrain.core.errors import CheckpointError

FILE = "checkpoint file"
SHARDED = "sharded checkpoint"


@dataclass(frozen=True)
class Failure:
    """A failure on ``rank`` (which may be another rank than the one holding it)."""

    rank: int
    message: str


def agree_on_error(error: str | Failure | None, device: torch.device | None = None,
                   group: Any = None) -> None:
    """Every rank raises if any rank failed, with the first failing rank's message. ``error``: this rank's
    own failure (a string), a failure it knows of on another rank (a ``Failure``), or None. ``device``:
    where the agreement's tensor lives (default: what the default group's backend takes)."""
    failed = C.any_rank(error is not None, device if device is not None else C.default_device(), group)
    if failed:
        reports = C.all_gather_object(error, group)
        first = next((i, r) for i, r in enumerate(reports) if r is not None)
        raise checkpoint_error(first[1] if isinstance(first[1], Failure) else Failure(*first))


def checkpoint_error(failure: Failure) -> CheckpointError:
    return CheckpointError(f"checkpoint failed on rank {failure.rank}: {failure.message}")


def first_failure(reports: list[str | None]) -> Failure | None:
    """The first rank's own failure among every rank's reports (as ``all_gather_object`` returns them)."""
    return next((Failure(i, r) for i, r in enumerate(reports) if r is not None), None)


def own_error(err: BaseException, rank: int) -> BaseException | None:
    """This rank's part of ``err``: DCP reports every rank's failure to all of them (keyed by rank); a rank
    whose own write went through has none. Any other error is this rank's."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and type(err).__name__ == "CheckpointException":
        found = failures.get(rank)
        return found[0] if found is not None else None
    return err


def os_error_of(err: BaseException) -> OSError | None:
    """The operating system's error behind ``err``: itself, or what it was raised from or during."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # DCP: {rank: (exception, traceback)}
            todo.extend(pair[0] for pair in failures.values())
        todo.extend([current.__cause__, current.__context__])
    return None


def payload_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (a DTensor counts its local shard): about what writing it takes."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def _size(n: float) -> str:
    units = ("bytes", "KiB", "MiB", "GiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} bytes" if i == 0 else f"{n:.2f} {units[i]}"


def _existing_directory(path: str) -> str:
    """The nearest directory above ``path`` that exists (a failed save may have removed its own)."""
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    return directory


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(_existing_directory(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _why(os_err: OSError, path: str, kind: str, needed: int | None) -> str:
    code = os_err.errno
    name = errno.errorcode.get(code, str(code))
    reason = f"{os_err.strerror or os.strerror(code)} ({name})"
    need = f"it needs about {_size(needed)}" if needed else "its size is not known"
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(path)
        room = f", {_size(free)} free there" if free is not None else ""
        return f"{reason}: {need}{room}. Free some space or point trainer.run_dir at a disk with room"
    if code == errno.EFBIG:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft == resource.RLIM_INFINITY:
            limit = "no file-size limit is set"
        else:
            limit = f"this process may write files of at most {_size(soft)} (ulimit -f)"
        shard = " or shard the checkpoint (a sharded strategy writes a file per rank)" if kind == FILE else ""
        return f"{reason}: {need}, {limit}. Raise the limit (ulimit -f unlimited){shard}"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{reason}. Point trainer.run_dir at a writable directory"
    return f"{reason}. Point trainer.run_dir at a writable directory with free space"


def _probe(path: str, needed: int) -> OSError | None:
    """The operating system's error a write of ``needed`` bytes meets next to ``path`` now, or None."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".space-probe-", dir=_existing_directory(path))
    except OSError as err:
        return err
    try:
        os.posix_fallocate(fd, 0, max(needed, 1))
        return None
    except OSError as err:  # a file system without fallocate says nothing about space
        return None if err.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS) else err
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def describe_write_failure(err: BaseException, path: str, kind: str, needed: int | None = None) -> str:
    """One line: what could not be written, and why (the OS error when there is one), and the fix.
    ``kind``: ``FILE`` or ``SHARDED``; ``needed``: the bytes the write takes, when known."""
    os_err = os_error_of(err)
    if os_err is None and needed:
        os_err = _probe(path, needed)
    if os_err is not None:
        return f"cannot write {kind} {path}: {_why(os_err, path, kind, needed)}"
    text = str(err).strip().splitlines()
    return f"cannot write {kind} {path}: {type(err).__name__}: {text[0] if text else '(no message)'}"
