"""``trainer.num_nodes``: a fixed count, or a ``"min:max"`` range for elastic training.

A range works as torchrun's ``--nnodes=MIN:MAX``: the job starts with as many nodes as have joined
(at least MIN), keeps training when nodes are lost (down to MIN), and takes in nodes that (re)join
(up to MAX) at the next rendezvous, each time resuming from the newest checkpoint.
"""

from __future__ import annotations

from typing import Any

from polytrain.core.errors import ConfigError

_FIX = ('use a positive integer (e.g. num_nodes: 2) or a range "MIN:MAX" with 1 <= MIN <= MAX '
        '(e.g. num_nodes: "1:4")')


def node_range(value: Any) -> tuple[int, int]:
    """``(min_nodes, max_nodes)`` of a ``num_nodes`` value; equal for a fixed count. Raises ``ConfigError``
    naming the value and the fix."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"trainer.num_nodes={value} must be at least 1; {_FIX}")
        return value, value
    if isinstance(value, str):
        parts = value.strip().split(":")
        if len(parts) == 1 and parts[0].strip().isdigit():
            return node_range(int(parts[0]))
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            low, high = (int(p) for p in parts)
            if 1 <= low <= high:
                return low, high
            raise ConfigError(f"trainer.num_nodes={value!r}: MIN={low}, MAX={high}; {_FIX}")
    raise ConfigError(f"trainer.num_nodes={value!r} is not a node count; {_FIX}")


def is_elastic_range(value: Any) -> bool:
    """Whether ``num_nodes`` is given as a ``"MIN:MAX"`` range (started through c10d rendezvous)."""
    return isinstance(value, str) and ":" in value
