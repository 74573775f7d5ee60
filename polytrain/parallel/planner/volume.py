"""Bytes one rank sends per optimizer step, by parallel axis (``Estimate.traffic``): what the time
equations of docs/strategies/planner.md move, before bandwidth and latency turn it into seconds.

A ring all-gather or reduce-scatter of ``S`` bytes over ``N`` ranks sends ``S (N-1)/N`` from each rank,
an all-reduce twice that.
"""

from __future__ import annotations

from polytrain.parallel.planner.model_profile import ChildProfile
from polytrain.parallel.planner.timing import Features, gathered_bytes, tp_pass_bytes


def ring_bytes(nbytes: float, ranks: int) -> float:
    return nbytes * (ranks - 1) / ranks if ranks > 1 else 0.0


def _tp_passes(c: ChildProfile, checkpointed: bool, op: bool) -> float:
    """Passes of a child's TP collectives per micro-batch: forward, backward, and the recompute's
    (per-op checkpointing keeps the reduce-scatters' outputs: half under sequence parallelism)."""
    if not checkpointed:
        return 2.0
    return 2.5 if op and c.sequence_parallel else 3.0


def stage_traffic(kids: tuple[ChildProfile, ...], ckpt: list[bool], features: Features, *, micro: int,
                  n_microbatches: int, tp: int, dp_shard: int, dp_replicate: int, pp: int, cp: int,
                  boundary_bytes: int, param_bytes: int, master_bytes: int,
                  op: bool, reshard_after_forward: bool = True, ep: int = 1) -> dict[str, float]:
    """Bytes per step one rank of a pipeline stage holding ``kids`` sends over each axis of degree > 1:
    ``tp`` (row-parallel outputs, ``2 (t-1)/t`` of the payload a pass; float8 gathers at 1 byte under
    sequence parallelism), ``dp_shard`` (FSDP over ``dp_shard x cp``: two gathers a unit, forward and
    backward, ``m + 1`` under a pipeline, one without resharding after forward; one reduce-scatter),
    ``dp_replicate`` (the shard's all-reduce), ``pp`` (``boundary_bytes`` a sample: what
    ``timing.boundary_sends`` counts, per micro-batch). Under expert parallel (``ep`` > 1) the experts leave
    those axes: ``ep`` (each experts module's two all-to-alls a pass, forward, backward and a checkpointed
    block's recompute, ``(ep-1)/ep`` of its rows) and ``efsdp`` (their FSDP over the ``dp / ep`` ranks
    holding the same experts: gathers as ``dp_shard``'s, one reduce-scatter)."""
    m, shard = n_microbatches, dp_shard * cp
    out: dict[str, float] = {}
    if tp > 1:
        out["tp"] = m * sum(
            tp_pass_bytes(c, micro, tp, features.f8(i)) * _tp_passes(c, k, op)
            for i, (c, k) in enumerate(zip(kids, ckpt)))
    local = [c.tp_params / tp + (c.params - c.tp_params) - (c.expert_params if ep > 1 else 0) for c in kids]
    if shard > 1:
        gathers = (m + 1 if pp > 1 else 2) if reshard_after_forward else 1
        fp8 = [features.fp8_gather and features.f8(i) for i in range(len(kids))]
        gathered = [gathered_bytes(c, n, param_bytes, f) for n, c, f in zip(local, kids, fp8)]
        out["dp_shard"] = sum(gathers * ring_bytes(g, shard) + ring_bytes(n * master_bytes, shard)
                              for g, n in zip(gathered, local))
    if dp_replicate > 1:
        out["dp_replicate"] = sum(2 * ring_bytes(n / shard * master_bytes, dp_replicate) for n in local)
    if pp > 1:
        out["pp"] = float(m * micro * boundary_bytes)
    if ep > 1:
        passes = [3.0 if k else 2.0 for k in ckpt]  # a checkpointed block exchanges again when it recomputes
        out["ep"] = m * sum(n * 2 * micro * c.dispatch_bytes * (ep - 1) / ep for c, n in zip(kids, passes))
        edp = shard * dp_replicate // ep
        if edp > 1:
            gathers = (m + 1 if pp > 1 else 2) if reshard_after_forward else 1
            out["efsdp"] = sum(gathers * ring_bytes(c.expert_params / ep * param_bytes, edp)
                               + ring_bytes(c.expert_params / ep * master_bytes, edp) for c in kids)
    return out
