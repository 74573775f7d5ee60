"""Step time of one pipeline stage of a layout: compute, tensor-parallel collectives, the data-parallel
collectives each FSDP unit exposes, the pipeline's schedule (docs/strategies/planner.md, "Time per step",
has every equation here, its defaults and where it is known to be wrong).

Two CUDA streams per rank are modelled: compute (with the tensor-parallel collectives on it; async TP
hides them behind the split matmuls) and communication (FSDP all-gathers and reduce-scatters, replica
all-reduces). A unit is one child of the Sequential: the strategy ``fully_shard``s each child that holds
parameters (``parallel/fully_shard.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polytrain.parallel.hardware import Hardware
from polytrain.parallel.planner.model_profile import ChildProfile

SCHEDULES = ("1f1b", "interleaved_1f1b")
DDP_FIRST_BUCKET = 1024**2  # torch's DDP: a 1 MiB first bucket, then bucket_cap_mb (the strategy's 25)
DDP_BUCKET = 25 * 1024**2


def link(hw: Hardware, span: int) -> tuple[float, float]:
    """(bandwidth, latency per ring step) of a group whose ranks span ``span`` consecutive ranks: NVLink
    inside a node, else each GPU's own NIC. A ring step waits for its slowest hop, so one hop across
    nodes makes every step an inter-node one."""
    if span <= hw.devices_per_node:
        return hw.intra_bw, hw.intra_latency
    return hw.inter_bw, hw.inter_latency


def ring_time(nbytes: float, ranks: int, bw: float, latency: float) -> float:
    """All-gather or reduce-scatter of ``nbytes`` (the whole tensor) over a ring of ``ranks``:
    ``ranks - 1`` steps, each moving ``nbytes / ranks`` and paying one latency."""
    if ranks <= 1:
        return 0.0
    return nbytes * (ranks - 1) / ranks / bw + (ranks - 1) * latency


def bubble_fraction(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a pipelined step: ``(p - 1) / (v m + p - 1)`` (1F1B is ``v = 1``; interleaving
    ``v`` stages per rank cuts the warm-up and cool-down to ``1/v``: Narayanan et al. 2021, sec. 2.2)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


def interleaved_rounds_ok(pp: int, n_microbatches: int) -> bool:
    """``ScheduleInterleaved1F1B`` runs ``max(1, m // p)`` rounds and needs ``m`` divisible by them."""
    return n_microbatches % max(1, n_microbatches // pp) == 0


def in_flight(pp: int, n_microbatches: int, stage: int, schedule: str, stages_per_rank: int) -> list[float]:
    """Micro-batches whose activations each of pipeline rank ``stage``'s stages holds at the rank's peak.
    1F1B: ``[min(p - s, m)]``. Interleaved (torch's ``_get_warmup_ops``): rank ``s`` runs ``W = min((v-1) r +
    2 (p-1-s) + 1, v m)`` forwards before its first backward, ``r = m // max(1, m // p)`` micro-batches a
    round, forward ``i`` on its stage ``(i // r) % v``."""
    if schedule != "interleaved_1f1b":
        return [float(min(pp - stage, n_microbatches))]
    v, m = stages_per_rank, n_microbatches
    per_round = m // max(1, m // pp)
    warm = min((v - 1) * per_round + 2 * (pp - 1 - stage) + 1, v * m)
    counts = [0.0] * v
    for i in range(warm):
        counts[(i // per_round) % v] += 1
    return counts


@dataclass(frozen=True)
class Units:
    """Seconds per micro-batch of each unit of a stage, in forward order."""

    fwd: list[float]  # forward compute + its tensor-parallel collectives (the compute stream)
    bwd: list[float]  # backward (+ recompute when checkpointed) + its collectives
    gather: list[float]  # FSDP all-gather of the unit's shard, in the compute dtype
    reduce: list[float]  # FSDP reduce-scatter of its gradient (+ the replicas' all-reduce)
    tp: float = 0.0  # of fwd + bwd, the tensor-parallel collectives' share (reported apart)
    ep: float = 0.0  # of fwd + bwd, expert parallel's all-to-alls (reported apart)


def forward_with_gathers(u: Units) -> float:
    """The first unit's gather is exposed; each later one overlaps the compute of the unit before it
    (FSDP2's CPU runs ahead and issues it early): ``g_0 + sum_i max(f_i, g_{i+1})``."""
    n = len(u.fwd)
    return u.gather[0] + sum(max(u.fwd[i], u.gather[i + 1] if i + 1 < n else 0.0) for i in range(n))


def backward_with_collectives(u: Units, gathers: bool = True, reduces: bool = True) -> float:
    """Backward runs units last to first. While unit ``i`` computes, the communication stream prefetches
    unit ``i-1``'s gather and reduces unit ``i+1``'s gradient: ``g_{n-1} + sum_i max(b_i, g_{i-1} +
    r_{i+1}) + r_0`` (every unit was resharded after forward, so the last one gathers again first)."""
    n = len(u.bwd)
    g = u.gather if gathers else [0.0] * n
    r = u.reduce if reduces else [0.0] * n
    total = g[n - 1] + r[0]
    for i in range(n):
        comm = (g[i - 1] if i > 0 else 0.0) + (r[i + 1] if i + 1 < n else 0.0)
        total += max(u.bwd[i], comm)
    return total


def tp_collectives(c: ChildProfile) -> int:
    """Row-parallel outputs a child all-reduces in forward. The profile holds their bytes, not their count;
    in a transformer each one is a residual-stream tensor, the size of the child's output."""
    if not c.tp_allreduce_bytes or not c.output_bytes:
        return 0
    return math.ceil(c.tp_allreduce_bytes / c.output_bytes)


def ddp_buckets(nbytes: list[float]) -> list[int]:
    """How many DDP buckets fill up (and launch their all-reduce) during each unit's backward; units in
    forward order, gradients arriving last unit first. The last, partly filled bucket goes with unit 0."""
    closes, filled, limit = [0] * len(nbytes), 0.0, DDP_FIRST_BUCKET
    for i in reversed(range(len(nbytes))):
        filled += nbytes[i]
        while filled >= limit:
            closes[i] += 1
            filled -= limit
            limit = DDP_BUCKET
    if filled > 0 and nbytes:
        closes[0] += 1
    return closes


@dataclass(frozen=True)
class Features:
    """Held-fixed run settings (``Training``) that change the per-unit times, applied to every layout alike.

    ``float8``: per unit, whether its Linear layers run torchao's float8 matmuls (forward and both backward
    matmuls at the fp8 peak; the rest of its FLOPs at the bf16 rate). ``fp8_gather``: FSDP all-gathers
    those Linear weights in float8 (``enable_fsdp_float8_all_gather``: 1 byte a parameter). Under
    sequence parallelism, float8 TP casts to float8 before each TP all-gather (forward and backward).
    ``async_tp``: the TP collectives are micro-pipelined with the split Linear layers' matmuls.
    """

    float8: tuple[bool, ...] = ()
    fp8_gather: bool = False
    async_tp: bool = False

    def f8(self, i: int) -> bool:
        return bool(self.float8) and self.float8[i]


def compute_time(c: ChildProfile, micro: int, cp: int, hw: Hardware, f8: bool) -> tuple[float, float]:
    """(forward seconds, of them the split Linear layers' matmuls): ``mb (FLOPs - L) / cp / R + mb L / cp
    / R8``, ``L`` the Linear FLOPs when they run in float8 (``R8 = fp8 peak x efficiency``), else 0."""
    rate = hw.peak_flops * hw.efficiency
    rate8 = (hw.fp8_peak_flops or hw.peak_flops) * hw.efficiency
    lin = c.linear_flops if f8 else 0
    f = micro * ((c.flops - lin) / rate + lin / rate8) / cp
    return f, micro * c.tp_linear_flops / cp / (rate8 if f8 else rate)


def float8_cast_time(c: ChildProfile, micro: int, cp: int, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of a float8 child's casts (torchao's dynamic tensorwise scaling), each a
    memory-bound pass over bf16 tensors: a tensor's scale is its absolute maximum (one read), then it is
    cast (one read, a float8 write). Forward casts every Linear input and weight (2 + 2 + 1 bytes an
    element); backward each output's gradient (5) and the transposed copies its two matmuls take of that
    gradient, the input and the weight (2 + 1 each). At ``memory_bandwidth x memory_efficiency``; 0 when
    the hardware gives no bandwidth. Without ``torch.compile`` torchao runs each step as its own kernel:
    more passes than counted here."""
    if hw.memory_bandwidth is None:
        return 0.0, 0.0
    rate = hw.memory_bandwidth * hw.memory_efficiency
    inputs, outputs = micro * c.linear_inputs / cp, micro * c.linear_outputs / cp
    forward = 5 * (inputs + c.linear_params)
    backward = 8 * outputs + 3 * (inputs + c.linear_params)
    return forward / rate, backward / rate


def recompute_time(c: ChildProfile, micro: int, cp: int, hw: Hardware, f8: bool,
                   tf: float) -> tuple[float, float]:
    """(compute, TP collective) seconds a per-op checkpointed child recomputes in backward: the FLOPs of the
    ops ``OpSelection`` does not keep (its matmuls at the fp8 rate under float8), and the TP collectives
    it runs again: the all-reduces, or under sequence parallelism the all-gathers (half the bytes; the
    reduce-scatters' outputs are kept)."""
    rate = hw.peak_flops * hw.efficiency
    rate8 = (hw.fp8_peak_flops or hw.peak_flops) * hw.efficiency
    mm = c.op_recompute_matmul_flops
    compute = micro * ((c.op_recompute_flops - mm) / rate + mm / (rate8 if f8 else rate)) / cp
    return compute, tf * (0.5 if c.sequence_parallel else 1.0)


def tp_pass_bytes(c: ChildProfile, micro: int, tp: int, f8: bool) -> float:
    """Bytes one rank sends in a pass of a child's TP collectives: ``2 (t-1)/t`` of the payload; x 3/4 under
    float8 with sequence parallelism (the all-gathers, half the bytes, in float8)."""
    return micro * c.tp_allreduce_bytes * 2 * (tp - 1) / tp * (0.75 if f8 and c.sequence_parallel else 1.0)


def gathered_bytes(c: ChildProfile, local: float, param_bytes: int, fp8_gather: bool) -> float:
    """Bytes of a unit's ``local`` parameters as FSDP gathers them: the compute dtype, its Linear weights at
    1 byte under the float8 all-gather."""
    return local * param_bytes - (c.linear_params * (param_bytes - 1) if fp8_gather else 0)


def tp_time(c: ChildProfile, micro: int, tp: int, hw: Hardware, f8: bool, async_tp: bool,
            matmul: float) -> tuple[float, float]:
    """(forward, backward) seconds of a child's TP collectives on the compute stream.

    Row-parallel outputs are all-reduced (or, sequence-parallel, reduce-scattered and gathered: the same
    bytes), ``2 (t-1)/t`` of the payload per rank, ``k`` rings of ``2 (t-1)`` steps. Float8 under
    sequence parallelism (torchao's float8 TP styles): each pass's all-gathers (half the bytes) move
    float8, 1 byte of bf16's 2, the reduce-scatters stay bf16: x 3/4. Async TP (sequence parallel only: it
    fuses all-gather + matmul and matmul + reduce-scatter): each pass exposes
    ``max(0, bytes time - M (t-1)/t)`` (``M`` the split Linear matmuls of the pass, forward and the
    backward's grad-input ones alike; one of ``t`` chunks has no transfer beside it) plus one step's latency
    per collective (``2 k``)."""
    if tp <= 1 or not c.tp_allreduce_bytes:
        return 0.0, 0.0
    bw, lat = link(hw, tp)
    k = tp_collectives(c)
    # Forward: the block's input cast before its gather (PrepareFloat8ModuleInput); backward: the gradient
    # of a row-parallel output cast before the gather that is its reduce-scatter's twin (_NoopFwToFloat8Bw).
    wire = tp_pass_bytes(c, micro, tp, f8) / bw
    if async_tp and c.sequence_parallel:
        exposed = max(0.0, wire - matmul * (tp - 1) / tp) + 2 * k * lat
        return exposed, exposed
    steps = k * 2 * (tp - 1) * lat
    return wire + steps, wire + steps


def fsdp_times(c: ChildProfile, tp: int, shard: int, replicate: int, param_bytes: int, master_bytes: int,
               links: tuple[tuple[float, float], tuple[float, float]], ddp: bool,
               fp8_gather: bool, experts: int = 0) -> tuple[float, float]:
    """(gather, reduce) seconds of one unit: its shard gathered in the compute dtype (float8 Linear
    weights at 1 byte under ``fp8_gather``), its gradient reduce-scattered in ``master_bytes``, then each
    shard all-reduced over the replicas (HSDP, DDP). ``experts``: parameters of it that are not in the
    unit (expert parallel's experts, units of their own: ``expert_fsdp_times``)."""
    local = c.tp_params / tp + (c.params - c.tp_params) - experts
    if not local:  # no parameters: not an FSDP unit, nothing to gather or reduce
        return 0.0, 0.0
    (dp_bw, dp_lat), (rep_bw, rep_lat) = links
    gathered = gathered_bytes(c, local, param_bytes, fp8_gather)
    r = ring_time(local * master_bytes, shard, dp_bw, dp_lat)
    if replicate > 1:
        r += 2 * ring_time(local / shard * master_bytes, replicate, rep_bw, 0.0 if ddp else rep_lat)
    return ring_time(gathered, shard, dp_bw, dp_lat), r


def expert_exchange_time(c: ChildProfile, micro: int, ep: int, hw: Hardware, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of a child's expert-parallel all-to-alls on the compute stream (the
    experts wait for their rows). Per experts module and pass, two exchanges (the rows to their experts'
    ranks, the results back), each sending ``(ep-1)/ep`` of ``micro x dispatch_bytes`` (every rank's rows
    spread evenly over the experts), one latency each; forward exchanges the rows' counts first (one
    latency more). An expert group is ``ep`` consecutive data-parallel ranks, ``ep x tp`` ranks apart."""
    if ep <= 1 or not c.expert_modules:
        return 0.0, 0.0
    bw, lat = link(hw, ep * tp)
    wire = 2 * micro * c.dispatch_bytes * (ep - 1) / ep / bw
    return wire + 3 * c.expert_modules * lat, wire + 2 * c.expert_modules * lat


def expert_fsdp_times(c: ChildProfile, ep: int, edp: int, param_bytes: int, master_bytes: int,
                      edp_link: tuple[float, float]) -> tuple[float, float]:
    """(gather, reduce) seconds of a child's experts units under expert parallel: its ``E / ep`` experts
    gathered over the ``edp = dp / ep`` ranks holding the same ones, their gradient reduce-scattered there
    (no replicas: those ranks are every data-parallel rank with these experts)."""
    held = c.expert_params / ep
    bw, lat = edp_link
    return ring_time(held * param_bytes, edp, bw, lat), ring_time(held * master_bytes, edp, bw, lat)


def unit_times(kids: tuple[ChildProfile, ...], ckpt: list[bool], micro: int, *, tp: int, fsdp: int,
               replicate: int, cp: int, param_bytes: int, master_bytes: int, hw: Hardware,
               ddp: bool = False, features: Features = Features(), op_checkpointing: bool = False,
               ep: int = 1) -> Units:
    """Per-unit seconds for a micro-batch of ``micro`` samples; the groups are laid out in mesh order
    ``pp, dp_replicate, dp_shard, cp, tp`` (tp innermost). ``ddp``: the replicas run DDP, which
    all-reduces gradients in buckets (a ring's latency per bucket, not per unit). ``ep``: expert parallel's
    degree (its all-to-alls, and the experts as FSDP units of their own over ``dp / ep`` ranks)."""
    shard = fsdp * cp  # FSDP shards over dp_shard x cp
    links = (link(hw, tp * shard), link(hw, tp * shard * replicate))
    edp = fsdp * replicate // ep
    edp_link = link(hw, tp * fsdp * replicate)  # every data-parallel rank holding the same experts
    fwd, bwd, gather, reduce, tp_total, ep_total = [], [], [], [], 0.0, 0.0
    for i, (c, k) in enumerate(zip(kids, ckpt)):
        f8 = features.f8(i)
        f, matmul = compute_time(c, micro, cp, hw, f8)
        cast_f, cast_b = float8_cast_time(c, micro, cp, hw) if f8 else (0.0, 0.0)
        tf, tb = tp_time(c, micro, tp, hw, f8, features.async_tp, matmul)
        again, tf_again = ((recompute_time(c, micro, cp, hw, f8, tf) if op_checkpointing
                            else (f + cast_f, tf)) if k else (0, 0))
        # A checkpointed block's recompute runs its experts again, their exchanges too
        ef, eb = expert_exchange_time(c, micro, ep, hw, tp)
        ef_again = ef if k else 0.0
        fwd.append(f + cast_f + tf + ef)
        # checkpointed: (part of) the forward again, collectives too
        bwd.append((2 * f + cast_b + tb) + again + tf_again + eb + ef_again)
        tp_total += tf + tb + tf_again
        ep_total += ef + eb + ef_again
        experts = c.expert_params if ep > 1 else 0
        g, r = fsdp_times(c, tp, shard, replicate, param_bytes, master_bytes, links, ddp,
                          features.fp8_gather and f8 and shard > 1, experts)
        if experts:
            eg, er = expert_fsdp_times(c, ep, edp, param_bytes, master_bytes, edp_link)
            g, r = g + eg, r + er
        gather.append(g)
        reduce.append(r)
    if ddp and replicate > 1:
        rep_lat = links[1][1]
        sizes = [(c.tp_params / tp + c.params - c.tp_params) * master_bytes for c in kids]
        reduce = [r + n * 2 * (replicate - 1) * rep_lat for r, n in zip(reduce, ddp_buckets(sizes))]
    return Units(fwd, bwd, gather, reduce, tp_total, ep_total)


def stage_time(u: Units, *, pp: int, stage: int, n_microbatches: int, stages_per_rank: int,
               p2p: float, reshard_after_forward: bool = True) -> dict[str, float]:
    """Seconds per step of one pipeline rank, by term; ``p2p`` is what the rank sends for one micro-batch
    (``boundary_sends``). Without a pipeline: one forward, one backward.

    Under a pipeline (torch's ``PipelineStage`` with FSDP2) gradients are not reduced until the last
    micro-batch, then once (exposed: the first rank finishes last), and a backward leaves the unit
    gathered: only an operation that follows a forward gathers, ``m + 1`` of the ``2 m`` (the warm-up
    forwards, ``min(m, p - s)``, and the backwards after them). Without resharding after forward a unit
    is gathered once a step: by the first forward."""
    m = n_microbatches
    # the compute stream's busy time, TP's collectives and expert parallel's all-to-alls included
    work = m * (sum(u.fwd) + sum(u.bwd))
    terms = {"compute": work - m * u.tp - m * u.ep, "tp": m * u.tp}
    if u.ep:
        terms["ep"] = m * u.ep
    if pp == 1:
        busy = forward_with_gathers(u) + backward_with_collectives(u, gathers=reshard_after_forward)
        return {**terms, "dp": busy - work, "pp": 0.0, "bubble": 0.0}
    f_gathers = min(m, pp - stage) if reshard_after_forward else 1
    b_gathers = m + 1 - f_gathers if reshard_after_forward else 0
    f_exposed = forward_with_gathers(u) - sum(u.fwd)
    b_exposed = backward_with_collectives(u, reduces=False) - sum(u.bwd)
    exposed = f_gathers * f_exposed + b_gathers * b_exposed + sum(u.reduce)
    bubble = work * (pp - 1) / (stages_per_rank * m)  # fraction / (1 - fraction) of the pipelined work
    return {**terms, "dp": exposed, "pp": m * p2p, "bubble": bubble}


def boundary_sends(children: tuple[ChildProfile, ...], chunks: list[tuple[int, int]]) -> list[int]:
    """Bytes a pipeline rank sends per sample for each micro-batch, one entry a send: per stage it holds,
    its output forward (not the last stage's: the loss stays) and its input's gradient backward (not the
    first stage's), each the size of the boundary activation."""
    sends = []
    for lo, hi in chunks:
        if hi < len(children):
            sends.append(children[hi - 1].output_bytes)
        if lo > 0:
            sends.append(children[lo - 1].output_bytes)
    return sends
