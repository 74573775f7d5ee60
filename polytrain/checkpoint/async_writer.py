"""Asynchronous checkpoint writes: training pauses only to *stage* the state (a CPU copy), the write
runs in a background thread. During a fit on CPU the staging copy of what the optimizers update
(parameters and their state) runs in that thread too, while the next forward and backward run (they only
read those tensors): the next optimizer update waits for it (``wait_staged``, which the fit's
optimisation calls before every update), so the copy costs the step only what the forward and backward
do not cover.

Guarantees (``docs/reliability.md``):

- At most one save in flight: every save (sync or async) and every load first waits for the previous
  one, logging how long it waited.
- ``after_write`` actions (``ModelCheckpoint``'s ``latest`` pointer, ``last.ckpt`` link and top-k
  pruning) run on global rank 0 only once the checkpoint is complete on disk, so ``resume: last``
  never sees a partial one; a failed write runs none of them.
- The staged copy is complete before the next optimizer update (taken before ``save`` returns, or in the
  background and awaited by ``wait_staged``), so later updates never reach the file. A tensor changed in
  place outside an optimizer step between a save and the next update would: use synchronous saves then.
- A background failure is agreed on by every rank at the next point every rank reaches (the next save
  or load, or ``finish`` at the end of fit) and raised there on all of them, never dropped.

Replicated files: global rank 0 stages (tensors cloned to CPU, pinned where CUDA is present) and its
thread does the same atomic write as a synchronous save. Sharded directories: every rank stages its
shards (on a device, DCP's own ``async_save`` stager does) and its thread runs DCP's save over a gloo
group of its own: DCP's collectives then run in a background thread, and on the default group they
could interleave with the training step's collectives in a different order on each rank.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from polytrain.checkpoint.failures import (
    FILE,
    SHARDED,
    Failure,
    agree_on_error,
    describe_write_failure,
    payload_bytes,
)
from polytrain.checkpoint.reading import quiet_single_process
from polytrain.checkpoint.replicated import atomic_save, with_weights_under_state_dict
from polytrain.checkpoint.sharded import complete_directory, dcp_failure, temporary_dir_for
from polytrain.checkpoint.state import TENSOR_KEYS
from polytrain.core import collectives as C
from polytrain.core import lazy

log = logging.getLogger("polytrain")

Copies = list[tuple[torch.Tensor, torch.Tensor]]


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own (sparse, functional wrappers)
        return None


def updated_storages(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """The storages an optimizer step changes in place: its parameters' and its state's."""
    keys: set[int] = set()
    for opt in optimizers:
        tensors = [p for group in opt.param_groups for p in group["params"]]
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        keys.update(_storage(t.to_local() if hasattr(t, "to_local") else t) for t in tensors)
    keys.discard(None)
    return keys


def stage(obj: Any, buffers: list[torch.Tensor] | None = None, deferred: Copies | None = None,
          updated: set[int] | None = None) -> Any:
    """A copy of ``obj`` whose tensors live in CPU memory of their own (pinned where CUDA is present, so the
    device-to-host copy is fast); containers are rebuilt so later changes to the live ones don't leak.
    ``buffers``: the previous save's staging tensors, reused where shape and dtype match (fresh memory is
    page-faulted in on every touch: several times slower than the copy itself) and updated in place.
    Only safe once the previous write has finished with them (at most one save is in flight).
    ``deferred``: CPU tensors whose storage is in ``updated`` are not copied now; ``(staging, live)`` pairs
    are appended for the caller to copy before those storages change. A DTensor is staged as a DTensor
    over a copy of its local shard."""
    pin = torch.cuda.is_available()
    copies: list[torch.Tensor] = []
    dtensor = lazy.dtensor().DTensor if any(isinstance(t, torch.Tensor) and hasattr(t, "to_local")
                                            for t in _tensors(obj)) else None

    def copy(value: Any) -> Any:
        if dtensor is not None and isinstance(value, dtensor):
            local = copy(value.detach().to_local())
            return dtensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            i, pinned, value = len(copies), pin and value.device.type != "cpu", value.detach()
            old = buffers[i] if buffers is not None and i < len(buffers) else None
            reuse = (old is not None and old.shape == value.shape and old.dtype == value.dtype
                     and old.is_pinned() == pinned)
            out = old if reuse else torch.empty(value.shape, dtype=value.dtype, pin_memory=pinned)
            if deferred is not None and updated and not pinned and _storage(value) in updated:
                deferred.append((out, value))
            else:
                out.copy_(value, non_blocking=pinned)
            copies.append(out)
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


def _tensors(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    else:
        yield obj


def finish_staging(deferred: Copies) -> None:
    """The part of staging left to the writer thread: copy what the next optimizer update changes into
    the staging tensors. What it raises is this rank's write error (nothing is written then)."""
    with torch.no_grad():
        for out, live in deferred:
            out.copy_(live)


def _failing_planner(error: BaseException) -> Any:
    """A DCP save planner that raises ``error`` while planning, which DCP reports on every rank."""

    class FailingPlanner(lazy.dcp().DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            raise error

    return FailingPlanner()


class _Failed(Exception):
    """A background save whose failure is already described (possibly another rank's)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class SaveState(enum.Enum):
    """Where an asynchronous save stands on this rank."""

    STAGING = "staging"  # the writer thread still copies what the next optimizer update changes
    WRITING = "writing"
    WRITTEN = "written"  # complete on disk; its after-write actions ran
    FAILED = "failed"  # this rank's failure, or another rank's it knows of: raised at `finish`
    ELSEWHERE = "elsewhere"  # a file save another rank (global rank 0) writes


@dataclass(eq=False)  # one save, compared by identity
class SaveInFlight:
    """The one asynchronous save a writer has, from the save that starts it until ``finish`` (or
    ``abandon``) ends it. It exists on every rank: ``finish`` then agrees on it (a collective)."""

    path: str
    thread: threading.Thread | None = None  # None: this rank writes nothing (a file save off rank 0)
    staging: threading.Event | None = None  # set once the background staging copy is done
    error: str | Failure | None = None
    done: bool = False  # this rank's write finished without error (guarded by the writer's lock)
    after: list[Callable[[], None]] = field(default_factory=list)  # run once written (after_write)

    @property
    def state(self) -> SaveState:
        if self.error is not None:
            return SaveState.FAILED
        if self.thread is None:
            return SaveState.ELSEWHERE
        if self.done:
            return SaveState.WRITTEN
        return (SaveState.STAGING if self.staging is not None and not self.staging.is_set()
                else SaveState.WRITING)


class AsyncCheckpointWriter:
    """One background write at a time (``SaveInFlight``). ``save_file``/``save_sharded`` and ``finish``
    are collectives: every rank calls them in the same order."""

    def __init__(self) -> None:
        self._save: SaveInFlight | None = None
        self._lock = threading.Lock()
        self._group: Any = None
        self._buffers: list[torch.Tensor] = []  # the staged copy of the last file save, reused by the next
        self._shard_buffers: list[torch.Tensor] = []  # the same for sharded saves
        self._group_of: Any = None
        # Per async save: seconds the next optimizer update waited for its background staging copy.
        self.staging_waits: list[float] = []

    def wait_staged(self) -> None:
        """Return once the last save's staged copy is complete. Called before every optimizer update (the
        tensors it changes may still be being copied); at once when nothing is being staged."""
        save = self._save
        if save is None or save.staging is None:
            return
        event = save.staging
        if not event.is_set():
            start = time.monotonic()
            event.wait()
            self.staging_waits[-1] += time.monotonic() - start
        save.staging = None

    def abandon(self, timeout: float = 300.0) -> None:
        """After an error: wait (up to ``timeout`` s) for this rank's write in flight to end, without the
        agreement ``finish`` makes (the other ranks may be gone), so a checkpoint being written when the
        fit failed is still completed (and pointed at) rather than cut off by the process exiting."""
        save = self._save
        if save is None:
            return
        thread = save.thread
        if thread is not None and thread.is_alive():
            log.info("checkpoint: the fit failed; waiting up to %.0f s for the save of %s to finish", timeout,
                     save.path)
            thread.join(timeout)
        save.staging = None
        if thread is None or not thread.is_alive():
            self._save = None

    # ------------------------------------------------------------------ waiting
    def finish(self, before: str | None = None) -> None:
        """Wait for the save in flight, then raise on every rank if it failed on any. Every rank calls it;
        without an async save since the last call it returns at once, with no collective. ``before``: the
        save that has to wait (a wait there means saves come faster than the disk writes them)."""
        save = self._save
        if save is None:
            return
        thread = save.thread
        if thread is not None and thread.is_alive():
            start = time.monotonic()
            thread.join()
            waited = time.monotonic() - start
            if before is not None and waited >= 0.05:  # a wait shorter than that is the thread's last moments
                log.warning("checkpoint %s waited %.2f s for the asynchronous save of %s to finish writing: "
                            "saves come faster than the disk takes them; "
                            "save less often to keep training unblocked",
                            before, waited, save.path)
            else:
                log.info("checkpoint: waited %.2f s for the asynchronous save of %s to finish", waited,
                         save.path)
        self._save = None
        agree_on_error(save.error)

    def after_write(self, action: Callable[[], None]) -> None:
        """Run ``action`` (file operations only, no collectives) once the save in flight is complete on
        disk: in the writer thread, or now if it already is. Dropped if the save fails."""
        with self._lock:
            save = self._save
            state = save.state if save is not None else None
            if state in (SaveState.STAGING, SaveState.WRITING):
                save.after.append(action)
                return
            if state is SaveState.FAILED:
                return
        action()

    # ------------------------------------------------------------------ saving
    def save_file(self, state: dict[str, Any], path: str,
                  updated_by: list[torch.optim.Optimizer] | None = None) -> None:
        """Global rank 0 stages ``state`` and writes it in the background (``replicated.save_file``).
        ``updated_by``: the optimizers whose tensors may be copied in the background (``wait_staged``)."""
        self.finish(before=path)
        if C.rank() == 0:
            deferred: Copies = []
            staged = stage(state, self._buffers, deferred, updated_storages(updated_by or []))

            def write(local_error: BaseException | None) -> None:
                if local_error is not None:
                    raise local_error
                atomic_save(with_weights_under_state_dict(staged), path)

            self._start(path, write, deferred, FILE, payload_bytes(staged))
        else:
            self._save = SaveInFlight(path)  # rank 0 writes; this rank agrees on the outcome at `finish`

    def save_sharded(self, state: dict[str, Any], path: str,
                     updated_by: list[torch.optim.Optimizer] | None = None) -> None:
        """Every rank stages its shards and DCP writes them from the writer thread; rank 0 commits the
        directory once DCP has finished on every rank (``sharded.save_sharded``'s layout). Shards on a
        device are staged by DCP's own ``async_save`` (pinned memory), synchronously."""
        self.finish(before=path)
        dcp = lazy.dcp()
        path = os.path.abspath(path)
        tmp = temporary_dir_for(path)
        group = self._save_group()
        tensors = {k: state.get(k, {}) for k in ("model", "optimizer")}
        writer = dcp.FileSystemWriter(tmp, cache_staged_state_dict=torch.cuda.is_available())
        deferred: Copies = []
        if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in _tensors(tensors)):
            with quiet_single_process():
                future = dcp.async_save(tensors, storage_writer=writer, process_group=group,
                                        no_dist=group is None)

            def save_shards(local_error: BaseException | None) -> str | None:
                """This rank's failure, in one line (None: none here)."""
                try:
                    future.result()
                except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - gathered after
                    return dcp_failure(err, path, tensors)
                if local_error is not None:
                    return describe_write_failure(local_error, path, SHARDED, payload_bytes(tensors))
                return None
        else:
            staged = stage(tensors, self._shard_buffers, deferred, updated_storages(updated_by or []))

            def save_shards(local_error: BaseException | None) -> str | None:
                # Every rank enters DCP's collectives, a rank whose staging failed too: its planner raises,
                # and DCP fails the save on every rank (no rank is left waiting for it).
                planner = None if local_error is None else _failing_planner(local_error)
                try:
                    with quiet_single_process():
                        dcp.save(staged, storage_writer=writer, planner=planner, process_group=group,
                                 no_dist=group is None)
                except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - gathered after
                    return dcp_failure(err, path, staged)
                return None
        meta = stage({k: v for k, v in state.items() if k not in TENSOR_KEYS}) if C.rank() == 0 else None

        def write(local_error: BaseException | None) -> None:
            own = save_shards(local_error)  # DCP's last collective has run: every rank's shards are on disk
            failure = complete_directory(tmp, path, meta, own, background_group=group)
            if failure is not None:
                raise _Failed(failure)

        self._start(path, write, deferred, SHARDED, None, cleanup=tmp if C.rank() == 0 else None)

    def _save_group(self) -> Any:
        """A gloo group for DCP's collectives in the writer thread (made once per process group; a
        collective, so every rank makes it here, at a save every rank calls)."""
        if not C.active():
            return None
        default = dist.distributed_c10d._get_default_group()
        if self._group is None or self._group_of is not default:
            self._group, self._group_of = dist.new_group(backend="gloo"), default
        return self._group

    def _start(self, path: str, write: Callable[[BaseException | None], None], deferred: Copies, kind: str,
               needed: int | None, cleanup: str | None = None) -> None:
        """Run ``write`` in the writer thread after the deferred copies (``finish_staging``); it gets the
        error of those and must raise it, after any collective the other ranks' writes enter."""
        staging = threading.Event()
        save = SaveInFlight(path, staging=staging if deferred else None)
        self.staging_waits.append(0.0)

        def run() -> None:
            try:
                local_error = None
                try:
                    finish_staging(deferred)
                except BaseException as err:  # noqa: BLE001 - handed to write(), which raises it
                    local_error = err
                finally:
                    staging.set()  # a failed copy is never written; the update need not wait for it
                write(local_error)
                with self._lock:
                    save.done = True
                    actions = save.after
                for action in actions:
                    action()
            except BaseException as err:  # noqa: BLE001 - agreed on and raised by every rank in finish()
                if isinstance(err, _Failed):
                    save.error = err.failure
                else:
                    save.error = describe_write_failure(err, path, kind, needed)
                if cleanup is not None and os.path.isdir(cleanup):
                    shutil.rmtree(cleanup, ignore_errors=True)

        save.thread = threading.Thread(target=run, name="polytrain-checkpoint-writer", daemon=False)
        self._save = save
        save.thread.start()
