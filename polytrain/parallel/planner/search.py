"""Every layout of a world size, each estimated or rejected with its reason, ranked by throughput.

Searched: ``tp`` (within a node), ``pp``, ``dp_replicate x dp_shard`` for the rest, the pipeline's
micro-batch count, activation checkpointing off, full or per-op (``op``), and for a model with experts
``ep`` (borrowed from the data-parallel ranks: every divisor of ``dp`` that divides each experts module's
expert count). ``cp`` stays 1 (CUDA-only ring
attention; a pinned ``cp`` is honoured). Ranking: tokens (or samples) per second, then less memory, then the
label, so the same inputs always give the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polytrain.core.errors import ConfigError
from polytrain.parallel.dims import ParallelDims
from polytrain.parallel.hardware import GiB, Hardware
from polytrain.parallel.planner.estimate import Estimate, Layout, Training, estimate, rank_chunks
from polytrain.parallel.planner.model_profile import ModelProfile
from polytrain.parallel.planner.timing import bubble_fraction, interleaved_rounds_ok

TIE = 0.01  # relative throughput difference treated as a tie
MAX_BUBBLE = 0.5  # a pipeline idling over half the step is never worth it here


@dataclass(frozen=True)
class Rejected:
    layout: Layout
    reason: str


@dataclass
class Plan:
    ranked: list[Estimate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            reasons = "; ".join(f"{r.layout.label()}: {r.reason}" for r in self.rejected[:5])
            raise ConfigError(f"no layout fits: {reasons}. "
                              f"Add devices, lower the batch or the sequence length")
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rejection(lay: Layout, hw: Hardware, train: Training, n_children: int, whole: str | None,
               pieces: str = "layers of the Sequential") -> str | None:
    """Why ``lay`` cannot run at all (before any estimate), or None. ``whole``: why the model was profiled
    whole (no Sequential to cut), which rules out a pipeline; ``pieces``: what a pipeline cuts between."""
    if lay.tp > hw.devices_per_node or hw.devices_per_node % lay.tp:
        return f"tp={lay.tp} crosses the node boundary ({hw.devices_per_node} devices per node)"
    if whole is not None and lay.pp > 1:
        return whole
    if train.float8 and not train.float8_tp and lay.tp > 1:
        return ("trainer.float8 with tensor parallelism (tp > 1) needs recipe: tensorwise (the strategy "
                "refuses per-row scaling under tp)")
    if whole is not None and lay.activation_checkpointing:
        return ("activation checkpointing is costed per child of an nn.Sequential, and this model is "
                "profiled whole: pin the degrees and trainer.activation_checkpointing to run it without "
                "the planner")
    v = train.stages_per_rank if lay.pp > 1 else 1
    if lay.pp * v > n_children:
        stages = f"pp={lay.pp}" + (f" x {v} stages per rank" if v > 1 else "")
        return f"{stages} exceeds the {n_children} {pieces}"
    if train.global_batch % lay.dp:
        return f"global batch {train.global_batch} is not divisible by dp={lay.dp}"
    if (train.global_batch // lay.dp) % lay.n_microbatches:
        return (f"local batch {train.global_batch // lay.dp} is not divisible by "
                f"{lay.n_microbatches} micro-batches")
    # torch's Schedule1F1B refuses it
    if lay.pp > 1 and train.pp_schedule == "1f1b" and lay.n_microbatches < lay.pp:
        return f"1F1B: {lay.n_microbatches} micro-batches are fewer than the pp={lay.pp} stages"
    if (lay.pp > 1 and train.pp_schedule == "interleaved_1f1b"
            and not interleaved_rounds_ok(lay.pp, lay.n_microbatches)):
        return f"interleaved 1F1B: {lay.n_microbatches} micro-batches do not split into rounds of pp={lay.pp}"
    if lay.ep > 1:  # what the strategy refuses of ep (not dividing dp, with pp or cp), in its words
        try:
            ParallelDims(lay.world_size, lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.cp, ep=lay.ep)
        except ConfigError as err:
            return str(err)
    bubble = bubble_fraction(lay.pp, lay.n_microbatches, v)
    if bubble > MAX_BUBBLE:
        return (f"pipeline bubble {bubble:.0%} over the {MAX_BUBBLE:.0%} bound "
                f"(local batch {train.global_batch // lay.dp})")
    return None


def _tie_across_ranks(lay: Layout, train: Training, prof: ModelProfile) -> str | None:
    """The pipeline strategy refuses a parameter shared by stages on different ranks (a tied embedding
    and head: two copies trained apart); so does the planner, in the strategy's words."""
    owner = {}
    for pp_rank, chunks in enumerate(rank_chunks(prof, lay.pp, train.stages_per_rank)):
        for first, end in chunks:
            owner.update({index: pp_rank for index in range(first, end)})
    for a, b in prof.ties:
        if owner[a] != owner[b]:
            names = prof.children[a].name, prof.children[b].name
            return (f"children {names[0]} (pp rank {owner[a]}) and {names[1]} (pp rank {owner[b]}) share a "
                    f"parameter: tied weights cannot span pipeline ranks")
    return None


def expert_degrees(dp: int, expert_counts: tuple[int, ...], pinned: dict[str, int]) -> list[int]:
    """The ``ep`` degrees a layout of ``dp`` data-parallel ranks is tried with: a pinned one (checked when
    ranked); for a model with experts every divisor of ``dp`` dividing each experts module's count (each
    rank holds whole experts); else 1."""
    if "ep" in pinned:
        return [pinned["ep"]]
    if not expert_counts:
        return [1]
    return [d for d in divisors(dp) if all(count % d == 0 for count in expert_counts)]


def candidates(hw: Hardware, train: Training, pinned: dict[str, int] | None = None,
               expert_counts: tuple[int, ...] = ()) -> list[Layout]:
    """Every layout of the world size agreeing with ``pinned`` degrees (e.g. ``{"tp": 8}``); with
    ``expert_counts`` (the model's experts modules' counts, ``ModelProfile.expert_counts``) each also with
    every ``ep`` that splits them (``expert_degrees``)."""
    pinned = pinned or {}
    world = hw.world_size
    found = []
    for cp in ([pinned["cp"]] if "cp" in pinned else [1]):
        for tp in divisors(world // cp) if world % cp == 0 else []:
            for pp in divisors(world // cp // tp):
                rest = world // cp // tp // pp
                for rep in divisors(rest):
                    shard = rest // rep
                    micro = divisors(max(train.global_batch // (rep * shard), 1)) if pp > 1 else [1]
                    for ep in expert_degrees(rest, expert_counts, pinned):
                        for m in micro:
                            for ac in (False, True, "op"):
                                lay = Layout(rep, shard, tp, pp, cp, m, ac, pinned.get("checkpoint_every", 1),
                                             ep)
                                if all(getattr(lay, k) == v for k, v in pinned.items()):
                                    found.append(lay)
    return found


def rank_layouts(hw: Hardware, train: Training, profile_at: Callable[[int], ModelProfile],
         pinned: dict[str, int] | None = None) -> Plan:
    """Estimate every candidate (``profile_at(tp)`` gives the model's profile at that degree)."""
    if train.float8 and not hw.fp8_peak_flops:
        raise ConfigError("float8 training needs fp8 tensor cores: this hardware has no fp8 peak "
                          "(the h100 preset has one; a100 and cpu do not)")
    plan = Plan()
    profiles: dict[int, ModelProfile | str] = {1: profile_at(1)}
    # What a pipeline can cut: the children, or the units of a model profiled block by block
    n_children = len(profiles[1].units or profiles[1].children)  # type: ignore[union-attr]
    units = profiles[1].units  # type: ignore[union-attr]
    pieces = "repeated blocks of the model" if units else "layers of the Sequential"
    whole = profiles[1].whole  # type: ignore[union-attr]
    pipeline_refused = profiles[1].pipeline_refused  # type: ignore[union-attr]
    experts_at_1: ModelProfile = profiles[1]  # type: ignore[assignment]
    usable = int(hw.memory_bytes * hw.usable_memory)
    for lay in candidates(hw, train, pinned, experts_at_1.expert_counts):
        prof = profiles.get(lay.tp)
        reason = _rejection(lay, hw, train, n_children, whole, pieces)
        if reason is None and lay.pp > 1 and pipeline_refused:
            reason = pipeline_refused
        if reason is None:  # the strategy's ExpertParallelPlanError, in its words
            reason = experts_at_1.expert_refusal(lay.ep, lay.dp)
        if reason is None and prof is None:
            try:
                prof = profiles[lay.tp] = profile_at(lay.tp)
            except (ConfigError, RuntimeError, ValueError) as err:  # the forward does not run split tp-ways
                prof = profiles[lay.tp] = (f"tp={lay.tp} does not split the model: "
                                           f"{' '.join(str(err).split())[:160]}")
        if reason is None and isinstance(prof, str):
            reason = prof
        if reason is None and lay.pp > 1 and not prof.units:  # cut at module paths, a tie spans stages
            reason = _tie_across_ranks(lay, train, prof)
        if reason is None:
            est = estimate(lay, train, prof, hw)
            if est.total_memory > usable:
                over = (est.total_memory - usable) / GiB
                reason = (f"out of memory by {over:.2f} GiB ({est.total_memory / GiB:.2f} GiB of "
                          f"{usable / GiB:.2f} usable)")
            else:
                plan.ranked.append(est)
        if reason is not None:
            plan.rejected.append(Rejected(lay, reason))
    # Throughputs within TIE of each other rank as equal (below the model's accuracy): less memory first.
    plan.ranked.sort(key=lambda e: (-math.floor(math.log(e.samples_per_s) / math.log1p(TIE)), e.total_memory,
                                    e.layout.label()))
    return plan


def best_per_degrees(plan: Plan) -> list[Estimate]:
    """The fastest variant (micro-batches, checkpointing) of each set of degrees, in rank order."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for est in plan.ranked:
        lay = est.layout
        key = (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.ep)
        if key not in seen:
            seen.add(key)
            out.append(est)
    return out


# The memory bar: one letter per term, each cell a BAR_WIDTH-th of a device's memory.
BAR_TERMS = (("params", "P"), ("grads", "G"), ("optimizer", "O"), ("fsdp_buffers", "F"), ("activations", "A"),
             ("transients", "T"))
BAR_WIDTH = 20


def memory_bar(memory: dict[str, int], capacity: float, width: int = BAR_WIDTH) -> str:
    """A rank's memory by term drawn as ``width`` cells of ``capacity / width`` bytes: ``P`` parameters,
    ``G`` gradients, ``O`` optimizer state, ``F`` FSDP's gathered buffers, ``A`` activations, ``T`` the
    busiest phase's transients, ``.`` free.
    Cells are rounded on the running total, so the bar's length is the total's, to half a cell."""
    cells: list[str] = []
    used = 0.0
    for key, letter in BAR_TERMS:
        used += memory.get(key, 0) / capacity * width
        cells.extend(letter * max(0, min(width, round(used)) - len(cells)))
    return "".join(cells) + "." * (width - len(cells))


def format_table(plan: Plan, top: int = 10, show_rejected: int = 20, capacity: float | None = None) -> str:
    """The ranked layouts, per-rank memory by term (GiB, or MiB for small models; with ``capacity``, a
    device's memory in bytes, also drawn as a bar), then the rejected ones."""
    fitting = best_per_degrees(plan)
    shown = fitting[:top]
    big = any(e.total_memory >= GiB for e in shown)
    unit, div = ("GiB", GiB) if big else ("MiB", 1024**2)
    bar_head = "  memory of a device" if capacity else ""
    head = (f"{'#':>3}  {'layout':<40} {'params':>7} {'grads':>7} {'optim':>7} {'fsdp':>6} {'activ':>7} "
            f"{'trans':>6} {'total':>7}  {'step s':>9} {'bubble':>6}  {'tokens/s':>11} {'samples/s':>10} "
            f"{'sent/step':>10}{bar_head}")
    reasons = _rejections(plan)
    # Counted as listed: sets of degrees, each shown once in its fastest variant (micro-batches,
    # checkpointing).
    lines = [f"{len(fitting)} sets of degrees fit (the fastest of their {len(plan.ranked)} variants shown, "
             f"first {len(shown)}), {len(reasons)} rejected; per-rank memory in {unit}", head]
    for i, est in enumerate(shown, 1):
        m = est.memory
        bar = f"  {memory_bar(m, capacity)}" if capacity else ""
        lines.append(
            f"{i:>3}  {est.layout.label():<40} {m['params'] / div:>7.2f} {m['grads'] / div:>7.2f} "
            f"{m['optimizer'] / div:>7.2f} {m['fsdp_buffers'] / div:>6.2f} {m['activations'] / div:>7.2f} "
            f"{m.get('transients', 0) / div:>6.2f} {est.total_memory / div:>7.2f}  {est.step_time:>9.4g} "
            f"{est.bubble:>6.0%}  {est.tokens_per_s:>11.4g} {est.samples_per_s:>10.4g} "
            f"{_bytes(sum(est.traffic.values())):>10}{bar}")
    if shown:
        lines.append("     columns: memory a rank holds by term (parameters, gradients, optimizer state, "
                     "FSDP's gathered buffers, activations kept for backward, the busiest phase's "
                     "transients: what a backward allocates beside a block's recompute, the loss's "
                     "logits-sized gradients, or the optimizer step's temporaries) and in total, its "
                     "peak; step s: predicted "
                     "seconds per optimizer step; bubble: a pipeline's idle share; tokens/s and samples/s "
                     "for the whole job; sent/step: bytes the busiest rank sends per step")
    if capacity and shown:
        lines.append(f"     memory bar: {BAR_WIDTH} cells of {capacity / BAR_WIDTH / GiB:.3g} GiB each: "
                     f"P params, G grads, O optimizer state, F FSDP's gathered buffers, A activations, "
                     f"T transients, . free")
    if reasons and show_rejected:
        lines.append(f"rejected (first {min(show_rejected, len(reasons))} of {len(reasons)}):")
        lines += [f"     {label:<40} {key[-1]}" for key, label in list(reasons.items())[:show_rejected]]
    return "\n".join(lines)


def _rejections(plan: Plan) -> dict[tuple[Any, ...], str]:
    """Each rejected layout with its reason, a reason its checkpointing variants share listed once."""
    reasons: dict[tuple[Any, ...], str] = {}
    for r in plan.rejected:
        lay = r.layout
        key = (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.n_microbatches, lay.ep, r.reason)
        first = reasons.setdefault(key, lay.label())
        if first != lay.label():
            reasons[key] = Layout(*key[:6], ep=lay.ep).label()
    return reasons


def describe_time(est: Estimate) -> str:
    parts = ", ".join(f"{k} {v:.4g}s" for k, v in est.time.items() if v > 0 or k == "compute")
    sent = ", ".join(f"{k} {_bytes(v)}" for k, v in est.traffic.items())
    return (f"{est.layout.label()}: step {est.step_time:.4g}s = {parts}; bubble {est.bubble:.0%}"
            + (f"; sent per rank and step: {sent}" if sent else ""))


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def world_check(hw: Hardware, pinned: dict[str, int]) -> None:
    # ep borrows from the data-parallel ranks: not a factor of the world size
    product = math.prod(v for k, v in pinned.items() if v > 0 and k != "ep")
    if hw.world_size % product:
        raise ConfigError(f"pinned degrees {pinned} (product {product}) do not divide the world size "
                          f"{hw.nodes} x {hw.devices_per_node} = {hw.world_size}")
