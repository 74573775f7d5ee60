"""``ModelSummary``: a table of the module's top-level children and their parameter counts."""

from __future__ import annotations

from typing import Any

from polytrain.callbacks.base import Callback


def _fmt(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def parameter_counts(module: Any) -> dict[str, Any]:
    """This rank's counts: ``children`` as (name, type, parameters), and the module's ``total`` and
    ``trainable`` (a parameter shared by two children counted once). A sharded parameter (a DTensor) counts
    whole; a pipeline stage holds only its own layers (``Strategy.counts_over_stages`` adds the others)."""
    children = [(name, type(child).__name__, sum(p.numel() for p in child.parameters()))
                for name, child in module.named_children()]
    return {"children": children, "total": sum(p.numel() for p in module.parameters()),
            "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)}


def summarize(module: Any, counts: dict[str, Any] | None = None) -> str:
    """The table for ``module``, from ``counts`` when given (the whole model's, over a pipeline's stages)."""
    counts = counts if counts is not None else parameter_counts(module)
    rows = [("name", "type", "params")]
    rows += [(name, kind, _fmt(n)) for name, kind, n in counts["children"]]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"{_fmt(counts['trainable'])} trainable / {_fmt(counts['total'])} total parameters")
    return "\n".join(lines)


class ModelSummary(Callback):
    def on_fit_start(self, trainer: Any, module: Any) -> None:
        # Every rank counts: under a pipeline the stages' counts are gathered (a collective) for the table.
        counts = trainer.strategy.counts_over_stages(parameter_counts(module))
        if trainer.is_logging_rank:
            print(summarize(module, counts), flush=True)
