"""Checkpoint I/O objects: a format, and who writes it. Nothing else.

A strategy produces its checkpoint state (``Strategy.checkpoint_state``: model and optimizer state in
its layout, full on rank 0 or sharded) and hands the whole state to ``save(state, path)``; ``load(path,
into)`` gives back a ``Loaded`` checkpoint, which the strategy applies (``Strategy.load_checkpoint``). The
I/O object never sees the strategy. ``save`` and ``load`` are collectives: every rank calls them, and a
failure on any rank (a full disk, an unreadable file) raises the same error on every rank.

- ``ReplicatedCheckpointIO``: one ``.ckpt`` file written atomically by global rank 0 (every rank holds
  the whole model); every rank reads the whole file.
- ``ShardedCheckpointIO``: a ``torch.distributed.checkpoint`` directory; every rank writes and reads its
  own shards (``into`` is the live state they are read into).

Both read both formats: any strategy loads any other's checkpoint (``polytrain.checkpoint.sharded``
and ``replicated`` describe the formats). ``replicated`` is read by whoever names files after it
(``ModelCheckpoint``).

``async_save`` stages the state and writes it in the background (``async_writer``); ``finish`` waits for
that write and raises on every rank if it failed. A synchronous ``save`` and every ``load`` finish first,
so one save at most is ever in flight. ``after_write(action)`` runs an action on global rank 0 once the
latest save is complete on disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from polytrain.checkpoint.async_writer import AsyncCheckpointWriter
from polytrain.checkpoint.replicated import load_file, save_file
from polytrain.checkpoint.sharded import load_sharded, save_sharded
from polytrain.checkpoint.state import Loaded


class CheckpointIO:
    """Writes and reads checkpoints in one format; ``save``/``load`` are collectives (every rank calls)."""

    replicated: bool = True

    def save(self, state: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def async_save(self, state: dict[str, Any], path: str, updated_by: list[Any] | None = None) -> None:
        """A format without a background writer saves synchronously. ``updated_by``: the optimizers whose
        tensors a background writer may still be copying until ``wait_staged`` returns."""
        self.save(state, path)

    def wait_staged(self) -> None:
        """Return once the last async save no longer needs the live tensors; called before every optimizer
        update."""

    def staging_waited(self) -> float:
        """Seconds optimizer updates have waited for async saves' background copies, in total."""
        return 0.0

    @contextlib.contextmanager
    def updates_wait_for_staging(self) -> Iterator[None]:
        """Within it (a fit's training), every optimizer update calls ``wait_staged`` first, so an async
        save may copy what the optimizers update in the background; outside it, it copies before returning."""
        yield

    def finish(self, before: str | None = None) -> None:
        """Wait for the save in flight (none here); every rank calls it. ``before``: the save that waits."""

    def abandon(self) -> None:
        """After a failed fit: let this rank's write in flight end, without a collective."""

    def after_write(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the latest save is on disk (here: it is)."""
        action()

    def load(self, path: str, into: dict[str, Any] | None = None) -> Loaded:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _Background(CheckpointIO):
    """The background writer the two built-in formats share (made on first use: one per I/O object)."""

    @property
    def writer(self) -> AsyncCheckpointWriter:
        if "_writer" not in self.__dict__:
            self.__dict__["_writer"] = AsyncCheckpointWriter()
        return self.__dict__["_writer"]

    def finish(self, before: str | None = None) -> None:
        self.writer.finish(before)

    def wait_staged(self) -> None:
        writer = self.__dict__.get("_writer")  # on every optimizer update: no writer made for nothing
        if writer is not None:
            writer.wait_staged()

    def staging_waited(self) -> float:
        writer = self.__dict__.get("_writer")
        return sum(writer.staging_waits) if writer is not None else 0.0

    @contextlib.contextmanager
    def updates_wait_for_staging(self) -> Iterator[None]:
        self.__dict__["_defer"] = True
        try:
            yield
        finally:
            self.__dict__["_defer"] = False

    def _deferrable(self, updated_by: list[Any] | None) -> list[Any] | None:
        return updated_by if self.__dict__.get("_defer") else None

    def abandon(self) -> None:
        writer = self.__dict__.get("_writer")
        if writer is not None:
            writer.abandon()

    def after_write(self, action: Callable[[], None]) -> None:
        self.writer.after_write(action)


class ReplicatedCheckpointIO(_Background):
    """One ``.ckpt`` file written by global rank 0 (the whole model is on every rank); every rank reads it."""

    replicated = True

    def save(self, state: dict[str, Any], path: str) -> None:
        self.finish(before=path)
        save_file(state, path)

    def async_save(self, state: dict[str, Any], path: str, updated_by: list[Any] | None = None) -> None:
        self.writer.save_file(state, path, self._deferrable(updated_by))

    def load(self, path: str, into: dict[str, Any] | None = None) -> Loaded:
        self.finish()
        return load_file(path)


class ShardedCheckpointIO(_Background):
    """A ``torch.distributed.checkpoint`` directory: every rank writes and reads its own shards."""

    replicated = False

    def save(self, state: dict[str, Any], path: str) -> None:
        self.finish(before=path)
        save_sharded(state, path)

    def async_save(self, state: dict[str, Any], path: str, updated_by: list[Any] | None = None) -> None:
        self.writer.save_sharded(state, path, self._deferrable(updated_by))

    def load(self, path: str, into: dict[str, Any] | None = None) -> Loaded:
        self.finish()
        return load_sharded(path, into)
