"""Cutting a module's ``nn.Sequential`` into pipeline stages, balanced by parameter count.

Stages keep the children's ORIGINAL names: stage 1 of ``net = Sequential(l0, l1, l2, l3)`` cut at
2 is ``Sequential({"2": l2, "3": l3})``, and the user's ``net`` is pruned in place (children of
other ranks deleted, never renumbered), so its ``state_dict`` keys stay ``net.2.weight``, ... and
checkpoints written under any strategy name every tensor the same way.

All functions here are local (no process group): errors surface before any communication.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from polytrain.core.errors import ConfigError, first_few


class PipelineSplitError(ConfigError):
    """The model cannot be cut as asked; the message names the numbers and the fix."""


def find_sequential(module: nn.Module, name: str | None) -> tuple[str, nn.Sequential]:
    """The ``nn.Sequential`` attribute to pipeline: ``name``, or the only Sequential child."""
    if name is not None:
        child = getattr(module, name, None)
        if not isinstance(child, nn.Sequential):
            found = type(child).__name__ if child is not None else "nothing"
            raise PipelineSplitError(
                f"strategy option sequential={name!r} names {found} on {type(module).__name__}, not an "
                f"nn.Sequential; keep the layers to pipeline in one nn.Sequential attribute and name it here"
            )
        return name, child
    candidates = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Sequential)]
    if len(candidates) != 1:
        names = ", ".join(n for n, _ in candidates) or "none"
        raise PipelineSplitError(
            f"{type(module).__name__} has {len(candidates)} nn.Sequential children ({names}); the pipeline "
            f"strategy needs exactly one, or set strategy option sequential=<attribute name>"
        )
    return candidates[0]


def check_params_inside(module: nn.Module, seq_name: str) -> None:
    """Parameters outside the pipelined Sequential would never be trained: refuse them."""
    outside = [n for n, _ in module.named_parameters() if not n.startswith(seq_name + ".")]
    if outside:
        shown = first_few(outside, 5)
        raise PipelineSplitError(
            f"{type(module).__name__} has {len(outside)} parameter(s) outside the pipelined nn.Sequential "
            f"'{seq_name}': {shown}. Under pipeline parallelism every trained layer must be a child of "
            f"'{seq_name}' (put embeddings first and the head last in it), or cut the module as it is at "
            f"module paths: strategy option split_points: [{seq_name}.<index>, ...]"
        )


def child_costs(seq: nn.Sequential) -> list[int]:
    """Parameter count of each child (shared parameters counted once, where first seen)."""
    seen: set[int] = set()
    costs = []
    for child in seq:
        total = 0
        for p in child.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        costs.append(total)
    return costs


def _fits(costs: Sequence[int], limit: int, parts: int) -> bool:
    used, current = 1, 0
    for c in costs:
        if current + c > limit:
            used, current = used + 1, c
        else:
            current += c
    return used <= parts


def balance(costs: Sequence[int], n_stages: int) -> list[int]:
    """Split points (first child index of stages 1..n-1) minimising the largest stage's cost.

    Each child weighs its parameter count plus one, so parameter-free layers (activations) still
    count a little and a parameter-free model splits evenly by layer count. Among optimal splits,
    stages are filled from the front, so an activation stays with the layer before it.
    """
    check_stage_count(len(costs), n_stages)
    weights = [c + 1 for c in costs]
    lo, hi = max(weights), sum(weights)
    while lo < hi:  # smallest feasible max-stage cost
        mid = (lo + hi) // 2
        if _fits(weights, mid, n_stages):
            hi = mid
        else:
            lo = mid + 1
    points: list[int] = []
    current = 0
    for i, w in enumerate(weights):
        left = len(weights) - i  # children not yet placed, this one included
        to_open = n_stages - len(points) - 1  # stages after the one being filled
        if current and to_open and (current + w > lo or left == to_open):
            points.append(i)
            current = 0
        current += w
    return points


def check_stage_count(n_children: int, n_stages: int) -> None:
    if n_stages < 1:
        raise PipelineSplitError(f"cannot split into {n_stages} stages; need at least 1")
    if n_children < n_stages:
        raise PipelineSplitError(
            f"cannot split an nn.Sequential of {n_children} children into {n_stages} stages: at least "
            f"{n_stages - n_children} stage(s) would be empty. Lower pp or stages_per_rank (stages = pp x "
            f"stages_per_rank), or give the Sequential more children"
        )


def check_split_points(points: Sequence[int], n_children: int, n_stages: int) -> list[int]:
    """Validate user-given split points; every stage must hold at least one child."""
    check_stage_count(n_children, n_stages)
    points = [int(p) for p in points]
    if len(points) != n_stages - 1:
        raise PipelineSplitError(
            f"split_points={points} gives {len(points) + 1} stages but the pipeline has {n_stages} "
            f"(pp x stages_per_rank); give exactly {n_stages - 1} child indices"
        )
    bounds = [0, *points, n_children]
    for stage, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end <= start:
            raise PipelineSplitError(
                f"split_points={points} leave stage {stage} empty (children {start}..{end - 1} of "
                f"{n_children}); "
                f"split points must be strictly increasing child indices in 1..{n_children - 1}"
            )
    return points


def stage_children(seq: nn.Sequential, points: Sequence[int]) -> list[list[str]]:
    """Names of the children of each stage, in order."""
    names = list(seq._modules)
    bounds = [0, *points, len(names)]
    return [names[start:end] for start, end in zip(bounds, bounds[1:])]


def check_no_shared_across_ranks(seq_name: str, seq: nn.Sequential, children: list[list[str]],
                                 owner: dict[int, int]) -> None:
    """A parameter used by stages on different ranks (tied embedding/head) would be two copies
    trained apart; refuse it. Stages on the same rank share it correctly."""
    first: dict[int, tuple[str, int]] = {}
    for stage, names in enumerate(children):
        for name in names:
            for pname, p in seq._modules[name].named_parameters():
                seen = first.setdefault(id(p), (f"{seq_name}.{name}.{pname}", stage))
                if owner[seen[1]] != owner[stage]:
                    raise PipelineSplitError(
                        f"{seen[0]} (stage {seen[1]}, rank {owner[seen[1]]}) is the same parameter as "
                        f"{seq_name}.{name}.{pname} (stage {stage}, rank {owner[stage]}): "
                        f"tied weights cannot span pipeline ranks. "
                        f"Untie them, or choose split_points that keep both on one rank"
                    )


def stage_module(seq: nn.Sequential, names: Sequence[str]) -> nn.Sequential:
    """A Sequential of the named children (the same module objects) under their original names."""
    return nn.Sequential(OrderedDict((n, seq._modules[n]) for n in names))


def prune(seq: nn.Sequential, keep: set[str]) -> None:
    """Delete the children not in ``keep``, without renumbering the others (``del seq[i]`` would)."""
    for name in list(seq._modules):
        if name not in keep:
            del seq._modules[name]


def describe(seq_name: str, children: list[list[str]], costs: Sequence[int]) -> str:
    """``stage 0: net.0-1 (1,234 params); stage 1: ...`` for logs and error messages."""
    index = {}
    position = 0
    for names in children:
        for n in names:
            index[n] = position
            position += 1
    parts = []
    for s, names in enumerate(children):
        params = sum(costs[index[n]] for n in names)
        span = names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}"
        parts.append(f"stage {s}: {seq_name}.{span} ({params:,} params)")
    return "; ".join(parts)
