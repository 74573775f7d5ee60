"""Checkpoint I/O objects: a format, and who writes it. Nothing else.

A strategy produces its checkpoint state (``Strategy.checkpoint_state``: model and optimizer state in
its layout, full on rank 0 or sharded) and hands the whole state to ``save(state, path)``; ``load(path,
into)`` gives back a ``Loaded`` checkpoint, which the strategy applies (``load_checkpoint_state``). The
I/O object never sees the strategy. ``save`` and ``load`` are collectives: every rank calls them, and a
failure on any rank (a full disk, an unreadable file) raises the same error on every rank.

- ``ReplicatedCheckpointIO``: one ``.ckpt`` file written atomically by global rank 0 (every rank holds
  the whole model); every rank reads the whole file.
- ``ShardedCheckpointIO``: a ``torch.distributed.checkpoint`` directory; every rank writes and reads its
  own shards (``into`` is the live state they are read into).

Both read both formats: any strategy loads any other's checkpoint (``polytrain.checkpoint.sharded``
and ``replicated`` describe the formats). ``replicated`` is read by whoever names files after it
(``ModelCheckpoint``).
"""

from __future__ import annotations

from typing import Any

from polytrain.checkpoint.replicated import load_file, save_file
from polytrain.checkpoint.sharded import load_sharded, save_sharded
from polytrain.checkpoint.state import Loaded


class CheckpointIO:
    """Writes and reads checkpoints in one format; ``save``/``load`` are collectives (every rank calls)."""

    replicated: bool = True

    def save(self, state: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def load(self, path: str, into: dict[str, Any] | None = None) -> Loaded:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReplicatedCheckpointIO(CheckpointIO):
    """One ``.ckpt`` file written by global rank 0 (the whole model is on every rank); every rank reads it."""

    replicated = True

    def save(self, state: dict[str, Any], path: str) -> None:
        save_file(state, path)

    def load(self, path: str, into: dict[str, Any] | None = None) -> Loaded:
        return load_file(path)


class ShardedCheckpointIO(CheckpointIO):
    """A ``torch.distributed.checkpoint`` directory: every rank writes and reads its own shards."""

    replicated = False

    def save(self, state: dict[str, Any], path: str) -> None:
        save_sharded(state, path)

    def load(self, path: str, into: dict[str, Any] | None = None) -> Loaded:
        return load_sharded(path, into)
