"""Checkpoint I/O objects: how a strategy's checkpoints are written and read, handed to it.

A strategy never decides between file formats itself: it is given one of these (the registry asks
the strategy class which kind its layout needs, see ``Strategy.default_checkpoint_io``), calls
``save``/``load`` from ``save_checkpoint``/``load_checkpoint``, and ``replicated`` (every rank
holds the whole model, so rank 0 writes one ``.ckpt`` file) is a property of the object, read by
whoever needs to know (``ModelCheckpoint`` names files after it).

Both kinds read both formats: any strategy loads any other's checkpoint (``polytrain.checkpoint.
sharded`` and ``replicated`` describe the formats).
"""

from __future__ import annotations

from typing import Any

from polytrain.checkpoint.replicated import load_replicated, save_replicated
from polytrain.checkpoint.sharded import load_sharded, save_sharded


class CheckpointIO:
    """Writes and reads a strategy's checkpoint; ``save``/``load`` are collectives (every rank calls)."""

    replicated: bool = True

    def save(self, strategy: Any, payload: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def load(self, strategy: Any, path: str) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReplicatedCheckpointIO(CheckpointIO):
    """One ``.ckpt`` file written by rank 0 (the whole model is on every rank); every rank reads it."""

    replicated = True

    def save(self, strategy: Any, payload: dict[str, Any], path: str) -> None:
        save_replicated(strategy, payload, path)

    def load(self, strategy: Any, path: str) -> dict[str, Any]:
        return load_replicated(strategy, path)


class ShardedCheckpointIO(CheckpointIO):
    """A ``torch.distributed.checkpoint`` directory: every rank writes and reads its own shards."""

    replicated = False

    def save(self, strategy: Any, payload: dict[str, Any], path: str) -> None:
        save_sharded(strategy, payload, path)

    def load(self, strategy: Any, path: str) -> dict[str, Any]:
        return load_sharded(strategy, path)
