"""``ModelSummary``: a table of the module's top-level children and their parameter counts."""

from __future__ import annotations

from typing import Any

from polytrain.callbacks.base import Callback


def _fmt(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def summarize(module: Any, max_depth: int = 1) -> str:
    """Parameters are counted on this rank: a sharded strategy shows the local shard's numbers."""
    rows = [("name", "type", "params")]
    for name, child in module.named_children():
        rows.append((name, type(child).__name__, _fmt(sum(p.numel() for p in child.parameters()))))
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"{_fmt(trainable)} trainable / {_fmt(total)} total parameters")
    return "\n".join(lines)


class ModelSummary(Callback):
    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if trainer.is_logging_rank:
            print(summarize(module), flush=True)
