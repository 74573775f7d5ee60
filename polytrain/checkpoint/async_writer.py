"""Asynchronous checkpoint writes: training pauses only to *stage* the state (a CPU copy), the write
runs in a background thread.

Guarantees (``docs/reliability.md``):

- At most one save in flight: every save (sync or async) and every load first waits for the previous
  one, logging how long it waited.
- ``after_write`` actions (``ModelCheckpoint``'s ``latest`` pointer, ``last.ckpt`` link and top-k
  pruning) run on global rank 0 only once the checkpoint is complete on disk, so ``resume: last``
  never sees a partial one; a failed write runs none of them.
- The staged copy is taken before ``save`` returns, so optimizer steps after it never reach the file.
- A background failure is agreed on by every rank at the next point every rank reaches (the next save
  or load, or ``finish`` at the end of fit) and raised there on all of them, never dropped.

Replicated files: global rank 0 stages (tensors cloned to CPU, pinned where CUDA is present) and its
thread does the same atomic write as a synchronous save. Sharded directories: every rank calls
``torch.distributed.checkpoint.async_save`` (its stager copies this rank's shards to CPU) over a gloo
group of its own: DCP's collectives then run in a background thread, and on the default group they
could interleave with the training step's collectives in a different order on each rank.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from polytrain.checkpoint.reading import META_FILE, quiet_single_process
from polytrain.checkpoint.replicated import agree_on_error, atomic_save
from polytrain.checkpoint.sharded import commit_dir, temporary_dir_for, write_error
from polytrain.checkpoint.state import TENSOR_KEYS
from polytrain.core import collectives as C
from polytrain.core import lazy

log = logging.getLogger("polytrain")

# Test-only hooks (subprocess tests cannot monkeypatch): the background write first sleeps this many
# seconds, and on the rank named by the second it raises, as a full disk would.
DELAY_ENV = "POLYTRAIN_TEST_ASYNC_CHECKPOINT_DELAY"
FAIL_RANK_ENV = "POLYTRAIN_TEST_ASYNC_CHECKPOINT_FAIL_RANK"


def stage(obj: Any, buffers: list[torch.Tensor] | None = None) -> Any:
    """A copy of ``obj`` whose tensors live in CPU memory of their own (pinned where CUDA is present, so the
    device-to-host copy is fast); containers are rebuilt so later changes to the live ones don't leak.
    ``buffers``: the previous save's staging tensors, reused where shape and dtype match (fresh memory is
    page-faulted in on every touch: several times slower than the copy itself) and updated in place.
    Only safe once the previous write has finished with them (at most one save is in flight)."""
    pin = torch.cuda.is_available()
    copies: list[torch.Tensor] = []

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            i, pinned = len(copies), pin and value.device.type != "cpu"
            old = buffers[i] if buffers is not None and i < len(buffers) else None
            reuse = old is not None and old.shape == value.shape and old.dtype == value.dtype and old.is_pinned() == pinned
            out = old if reuse else torch.empty(value.shape, dtype=value.dtype, pin_memory=pinned)
            copies.append(out.copy_(value.detach(), non_blocking=pinned))
            return out
        if isinstance(value, dict):
            out = {k: copy(v) for k, v in value.items()}
            if type(value) is dict:
                return out
            rebuilt = type(value)(out)  # an OrderedDict state_dict keeps its type and version _metadata
            if hasattr(value, "_metadata"):
                rebuilt._metadata = value._metadata
            return rebuilt
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(copy(v) for v in value)
        return value

    staged = copy(obj)
    if pin and any(t.is_pinned() for t in copies):
        torch.cuda.synchronize()  # the non-blocking copies have landed before the thread reads them
    if buffers is not None:
        buffers[:] = copies
    return staged


def _test_hooks() -> None:
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)
    if os.environ.get(FAIL_RANK_ENV) == str(C.rank()):
        raise OSError(28, f"No space left on device (injected by {FAIL_RANK_ENV})")


class AsyncCheckpointWriter:
    """One background write at a time. ``save_file``/``save_sharded`` and ``finish`` are collectives:
    every rank calls them in the same order."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._path: str | None = None
        self._error: str | None = None
        self._pending = False  # set on every rank by an async save: `finish` then agrees (a collective)
        self._done = False  # this rank's write finished without error (guarded by _lock)
        self._after: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._group: Any = None
        self._buffers: list[torch.Tensor] = []  # the staged copy of the last file save, reused by the next
        self._group_of: Any = None

    # ------------------------------------------------------------------ waiting
    def finish(self, before: str | None = None) -> None:
        """Wait for the save in flight, then raise on every rank if it failed on any. Every rank calls it;
        without an async save since the last call it returns at once, with no collective. ``before``: the
        save that has to wait (a wait there means saves come faster than the disk writes them)."""
        if not self._pending:
            return
        thread = self._thread
        if thread is not None and thread.is_alive():
            start = time.monotonic()
            thread.join()
            waited = time.monotonic() - start
            if before is not None:
                log.warning("checkpoint %s waited %.2f s for the asynchronous save of %s to finish writing: saves "
                            "come faster than the disk takes them; save less often to keep training unblocked",
                            before, waited, self._path)
            else:
                log.info("checkpoint: waited %.2f s for the asynchronous save of %s to finish", waited, self._path)
        error = self._error
        self._thread, self._error, self._pending = None, None, False
        agree_on_error(error)

    def after_write(self, action: Callable[[], None]) -> None:
        """Run ``action`` (file operations only, no collectives) once the save in flight is complete on
        disk: in the writer thread, or now if it already is. Dropped if the save fails."""
        with self._lock:
            if self._thread is not None and not self._done:
                if self._error is None:
                    self._after.append(action)
                return
        action()

    # ------------------------------------------------------------------ saving
    def save_file(self, state: dict[str, Any], path: str) -> None:
        """Global rank 0 stages ``state`` and writes it in the background (``replicated.save_file``)."""
        self.finish(before=path)
        if C.rank() == 0:
            staged = stage(state, self._buffers)
            self._start(path, lambda: atomic_save(staged, path))
        self._pending = True

    def save_sharded(self, state: dict[str, Any], path: str) -> None:
        """Every rank stages its shards with DCP's ``async_save``; rank 0 commits the directory once
        DCP has finished on every rank (``sharded.save_sharded``'s layout)."""
        self.finish(before=path)
        dcp = lazy.dcp()
        path = os.path.abspath(path)
        tmp = temporary_dir_for(path)
        group = self._save_group()
        tensors = {k: state.get(k, {}) for k in ("model", "optimizer")}
        # cache_staged_state_dict makes DCP's stager use pinned memory; only worth it where CUDA is present.
        writer = dcp.FileSystemWriter(tmp, cache_staged_state_dict=torch.cuda.is_available())
        with quiet_single_process():
            future = dcp.async_save(tensors, storage_writer=writer, process_group=group, no_dist=group is None)
        meta = stage({k: v for k, v in state.items() if k not in TENSOR_KEYS}) if C.rank() == 0 else None

        def write() -> None:
            future.result()  # DCP's last collective has run: every rank's shards are on disk
            if meta is not None:
                atomic_save(meta, os.path.join(tmp, META_FILE))
                commit_dir(tmp, path)

        self._start(path, write, cleanup=tmp if C.rank() == 0 else None)
        self._pending = True

    def _save_group(self) -> Any:
        """A gloo group for DCP's collectives in the writer thread (made once per process group; a
        collective, so every rank makes it here, at a save every rank calls)."""
        if not C.active():
            return None
        default = dist.distributed_c10d._get_default_group()
        if self._group is None or self._group_of is not default:
            self._group, self._group_of = dist.new_group(backend="gloo"), default
        return self._group

    def _start(self, path: str, write: Callable[[], None], cleanup: str | None = None) -> None:
        self._path, self._error, self._done, self._after = path, None, False, []

        def run() -> None:
            try:
                _test_hooks()
                write()
                with self._lock:
                    self._done, actions = True, self._after
                for action in actions:
                    action()
            except BaseException as err:  # noqa: BLE001 - agreed on and raised by every rank in finish()
                self._error = write_error(path, err)
                if cleanup is not None and os.path.isdir(cleanup):
                    shutil.rmtree(cleanup, ignore_errors=True)

        self._thread = threading.Thread(target=run, name="polytrain-checkpoint-writer", daemon=False)
        self._thread.start()
