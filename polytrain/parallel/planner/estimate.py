"""Per-rank memory and step time of one layout, from a model's profile (docs/strategies/planner.md has
the equations, their defaults and where they are known to be wrong).

All figures are for the worst rank: pipeline stages differ (the first holds the most micro-batches in
flight, the cut by parameter count is uneven), and the step waits for the slowest stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from polytrain.core.errors import ConfigError
from polytrain.parallel.hardware import Hardware
from polytrain.parallel.pipeline_sequential_cut import balance
from polytrain.parallel.planner import timing, volume
from polytrain.parallel.planner.model_profile import ChildProfile, ModelProfile

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}
# Temporaries of the optimizer's step, in copies of the parameters it steps at once: torch's Adam makes
# sqrt(exp_avg_sq) before dividing by it (``_multi_tensor_adam``: for every parameter of the group at
# once; ``_single_tensor_adam``: one parameter at a time). SGD's momentum updates in place.
STEP_TEMPORARIES = {"adam": 1, "adamw": 1, "sgd_momentum": 0, "sgd": 0, "none": 0}
MASTER_BYTES = {"32": 4, "16-mixed": 4, "bf16-mixed": 4, "bf16-true": 2}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    n_microbatches: int = 1
    # False: off; True: full (a block keeps its input); "op": per-op selective (also its odd-numbered
    # matmul outputs and its attention output): the strategy's activation_checkpointing modes
    activation_checkpointing: bool | str = False
    checkpoint_every: int = 1  # every n-th block (``every: n``); planned only when the config pins it
    # Expert parallel: the experts split over ``ep`` of the data-parallel ranks (it divides ``dp``: borrowed
    # from them, not a factor of the world size)
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Data-parallel ranks holding the same experts, which FSDP shards them over (``dp / ep``)."""
        return self.dp // self.ep

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    def checkpointing_config(self) -> bool | dict[str, int | str]:
        """This layout's checkpointing as ``trainer.activation_checkpointing`` takes it."""
        if not self.activation_checkpointing:
            return False
        mode = "op" if self.activation_checkpointing == "op" else "full"
        if mode == "full" and self.checkpoint_every == 1:
            return True
        return {"mode": mode, "every": self.checkpoint_every}

    def label(self) -> str:
        parts = [f"{n}{v}" for n, v in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                        ("ep", self.ep), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
                 if v > 1]
        text = " x ".join(parts) or "single"
        if self.pp > 1:
            text += f" m={self.n_microbatches}"
        ac = self.activation_checkpointing
        if ac and self.checkpoint_every > 1:
            return text + f" +AC({'op, ' if ac == 'op' else ''}every {self.checkpoint_every})"
        return text + {False: "", True: " +AC", "op": " +AC(op)"}[ac]


@dataclass(frozen=True)
class Training:
    """What is held fixed while layouts are compared."""

    global_batch: int  # samples per optimizer step, over every data-parallel rank
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    pp_schedule: str = "1f1b"  # under pp > 1: 1f1b, or interleaved_1f1b with stages_per_rank stages a rank
    stages_per_rank: int = 1
    # torchao float8 linears (torchtitan's enable_float8_linear, dynamic tensorwise scaling): every
    # nn.Linear but the output head (the Sequential's last child) runs its matmuls at the fp8 peak.
    float8: bool = False
    fsdp_float8_all_gather: bool = False  # torchtitan's enable_fsdp_float8_all_gather (needs float8)
    # Float8 under tensor parallelism (torchao's float8 TP styles, as torchtitan runs it): tensorwise scaling
    # only, so a polytrain config with a rowwise recipe plans with False, and tp > 1 is then rejected.
    float8_tp: bool = True
    async_tp: bool = False  # torchtitan's enable_async_tensor_parallel (micro-pipelined TP collectives)
    # FSDP's reshard_after_forward (the strategy option): False keeps each unit gathered from its forward to
    # its backward, one gather a step; None (the default, and torchtitan's rule): False under a pipeline only
    reshard_after_forward: bool | None = None
    # The optimizer steps every parameter at once (torch's foreach implementations, its default on CUDA)
    # or one at a time (its default on CPU): the size of the step's temporaries.
    foreach: bool = True

    def reshards(self, pp: int) -> bool:
        return pp == 1 if self.reshard_after_forward is None else self.reshard_after_forward

    def __post_init__(self) -> None:
        if self.fsdp_float8_all_gather and not self.float8:
            raise ConfigError("fsdp_float8_all_gather gathers float8 Linear weights: it needs float8=True")
        if self.pp_schedule not in timing.SCHEDULES:
            raise ConfigError(f"pipeline schedule '{self.pp_schedule}' unknown to the planner; one of "
                              f"{', '.join(timing.SCHEDULES)}")
        if self.stages_per_rank < 1 or (self.pp_schedule == "1f1b" and self.stages_per_rank != 1):
            raise ConfigError(f"stages_per_rank={self.stages_per_rank}: 1f1b runs one stage per rank, "
                              f"interleaved_1f1b one or more")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ConfigError(f"optimizer '{self.optimizer}' unknown to the planner; "
                              f"one of {', '.join(OPTIMIZER_STATES)}")
        if self.precision not in MASTER_BYTES:
            raise ConfigError(f"precision '{self.precision}' unknown to the planner; "
                              f"one of {', '.join(MASTER_BYTES)}")


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: dict[str, int]  # per-rank bytes by term (worst stage)
    time: dict[str, float]  # seconds per step by term
    step_time: float
    samples_per_s: float
    tokens_per_s: float
    bubble: float
    # bytes a rank sends per step, by axis (the busiest)
    traffic: dict[str, float] = field(default_factory=dict)

    @property
    def total_memory(self) -> int:
        return sum(self.memory.values())


def checkpointed(children: tuple[ChildProfile, ...], every: int = 1) -> list[bool]:
    """Which children activation checkpointing wraps: those of a repeated class (the blocks), as
    ``parallel/activation_checkpointing.py`` chooses; every child when no class repeats; of those, every
    ``every``-th (``every: n``, counted over the whole model)."""
    kinds = [c.kind for c in children]
    repeated = [kinds.count(k) > 1 for k in kinds]
    mask = repeated if any(repeated) else [True] * len(kinds)
    positions = [i for i, m in enumerate(mask) if m]
    kept = {i for n, i in enumerate(positions, start=1) if n % every == 0}
    return [i in kept for i in range(len(kinds))]


def stages(profile: ModelProfile, pp: int) -> list[tuple[int, int]]:
    """(first, end) child index of each stage, cut by parameter count as the strategy cuts: between
    children, or between the units of a model profiled block by block (its glue stays with a block)."""
    units = profile.units or tuple((i, i + 1) for i in range(len(profile.children)))
    cuts = balance([sum(c.params for c in profile.children[lo:hi]) for lo, hi in units], pp)
    points = [0, *(units[i][0] for i in cuts), len(profile.children)]
    return list(zip(points[:-1], points[1:]))


def rank_chunks(profile: ModelProfile, pp: int, v: int = 1) -> list[list[tuple[int, int]]]:
    """Per pipeline rank, the (first, end) child index of each stage it holds: the Sequential cut into
    ``pp x v`` stages, rank ``s`` holding stages ``s, s + pp, ...`` (the "loop" placement)."""
    cuts = stages(profile, pp * v)
    return [[cuts[s + j * pp] for j in range(v)] for s in range(pp)]


def _local_params(c: ChildProfile, tp: int) -> float:
    return c.tp_params / tp + (c.params - c.tp_params)


def _runs_ddp(lay: Layout) -> bool:
    """Whether the strategy wraps the model in DDP (``parallel/apply.py``'s ``data_parallel_mode``, auto);
    never under expert parallel, whose experts are FSDP units of their own."""
    return lay.dp_replicate > 1 and lay.fsdp == 1 and lay.tp == 1 and lay.pp == 1 and lay.ep == 1


def _unit_params(c: ChildProfile, lay: Layout) -> float:
    """Parameters of the largest FSDP unit in ``c`` as one rank gathers them: at degree ``tp``, and under
    expert parallel with ``E / ep`` of the experts (the experts module is a unit of its own, gathered
    inside its block's: the two are counted as one unit)."""
    whole = c.fsdp_unit_params or _local_params(c, lay.tp)
    if lay.ep == 1:
        return whole
    experts = c.fsdp_unit_experts if c.fsdp_unit_params else c.expert_params
    return whole - experts + experts / lay.ep


def _fsdp_buffers(lay: Layout, prof: ModelProfile, stage_params: float, unit: int, master: int,
                  reshard_after_forward: bool) -> int:
    """FSDP gathers one unit (and prefetches the next) in the compute dtype; its gradient arrives whole.
    Under a pipeline, torch's ``PipelineStage`` turns gradient sync and resharding after backward off
    until the last micro-batch: every unit of the stage stays gathered, its gradient accumulated
    unsharded in the reduce dtype (``master``). Without resharding after forward every unit stays
    gathered from its forward to its backward. Under expert parallel the experts are FSDP-sharded over the
    ``dp / ep`` ranks holding them whatever ``dp_shard`` is: there are buffers when either shards."""
    if lay.fsdp == 1 and (lay.ep == 1 or lay.edp == 1):
        return 0
    if lay.pp > 1:
        return math.ceil(stage_params * (prof.param_bytes + master))
    if not reshard_after_forward:
        return math.ceil(stage_params * prof.param_bytes + unit * master)
    return math.ceil(unit * (2 * prof.param_bytes + master))


def _stage_memory(lay: Layout, train: Training, prof: ModelProfile, chunks: list[tuple[int, int]],
                  s: int) -> dict[str, int]:
    kids = [c for lo, hi in chunks for c in prof.children[lo:hi]]
    # Precision 32 trains the weights in the dtype they are built in (float64 too)
    master = prof.param_bytes if train.precision == "32" else MASTER_BYTES[train.precision]
    mine = {i for lo, hi in chunks for i in range(lo, hi)}
    # A tie spanning stages (a model cut at module paths) is held again by each stage that uses it
    copies = sum(n for (first, other), n in zip(prof.ties, prof.tied_params)
                 if other in mine and first not in mine)
    held = (sum(_local_params(c, lay.tp) for c in kids) + copies) / lay.fsdp
    gathered = held * lay.fsdp  # the stage's parameters as FSDP gathers them
    if lay.ep > 1:
        # Expert tensors: split over ep, FSDP-sharded over the dp / ep ranks holding the same experts (every
        # data-parallel rank, HSDP's replicas included), whole over tp: 1 / dp of them a rank
        experts = sum(c.expert_params for c in kids)
        dense = sum(_local_params(c, lay.tp) for c in kids) - experts + copies
        held = dense / lay.fsdp + experts / lay.dp
        gathered = dense + experts / lay.ep
    units = max(_unit_params(c, lay) for c in kids)
    micro = train.global_batch // lay.dp // lay.n_microbatches
    # Micro-batches each of the rank's stages holds at its peak (1F1B: p - s; timing.in_flight)
    flights = timing.in_flight(lay.pp, lay.n_microbatches, s, train.pp_schedule, len(chunks))
    ckpt = (checkpointed(prof.children, lay.checkpoint_every) if lay.activation_checkpointing
            else [False] * len(prof.children))
    op = lay.activation_checkpointing == "op"

    # between a micro-batch's forward and its backward
    def between_passes(c: ChildProfile, checkpointed: bool) -> int:
        return c.input_bytes + (c.op_kept_bytes if op else 0) if checkpointed else c.saved_bytes

    # Autocast's weight casts are saved once a micro-batch (not per sample) by the children not checkpointed;
    # a checkpointed block makes its casts again when it recomputes.
    kept = sum(n * sum(micro * between_passes(prof.children[i], ckpt[i]) + (0 if ckpt[i] else
                                                                              prof.children[i].cast_bytes)
                       for i in range(lo, hi))
               for n, (lo, hi) in zip(flights, chunks))
    # A checkpointed block's backward brings back what it did not keep (one block at a time)
    recomputes = [micro * (prof.children[i].saved_bytes - (prof.children[i].op_kept_bytes if op else 0))
                  + prof.children[i].cast_bytes if ckpt[i] else 0 for lo, hi in chunks for i in range(lo, hi)]
    recompute = max(recomputes, default=0)
    activations = math.ceil(kept + recompute)
    params = math.ceil(held * master)
    buffers = _fsdp_buffers(lay, prof, gathered, units, master, train.reshards(lay.pp))
    return {
        "params": params,
        # DDP (replicas of a plain module: no shard, tp or pipeline) keeps its own bucketed copy of the
        # gradients (gradient_as_bucket_view off, the strategy's default).
        "grads": params * (2 if _runs_ddp(lay) else 1),
        "optimizer": math.ceil(held * master * OPTIMIZER_STATES[train.optimizer]),
        "fsdp_buffers": buffers,
        "activations": activations,
        "transients": _transients(lay, train, kids, recomputes, micro, master, params,
                                  activations + buffers),
    }


def _transients(lay: Layout, train: Training, kids: list[ChildProfile], recomputes: list[float], micro: int,
                master: int, params: int, freed_by_step: int) -> int:
    """What the step's busiest phase holds beyond the terms above (memory is the peak over the phases):

    - backward, at each child: what its backward allocates at its peak (``backward_bytes``, measured on
      meta: the gradients it makes and their temporaries, less the saved tensors it frees; with the loss,
      two tensors as large as the logits) beside its recompute when it is checkpointed (``activations``
      already holds the largest recompute, which only a checkpointed block's backward has live: the
      loss's backward comes before any), and, without FSDP, its largest parameter's fresh gradient
      before it is added into the kept one (FSDP's unsharded gradients are in ``fsdp_buffers``);
    - the optimizer step: its temporaries (``STEP_TEMPORARIES``), once activations and FSDP's buffers
      are freed.
    Gradients count as allocated through the whole step (as from the second micro-batch on): after
    ``zero_grad(set_to_none=True)`` the first backward allocates them as it frees activations, so for
    that backward the sum is an upper bound."""
    fresh = max(c.largest_param for c in kids) * master if lay.fsdp == 1 else 0
    backward = (max(rec + micro * c.backward_bytes for c, rec in zip(kids, recomputes)) - max(recomputes)
                + fresh)
    stepped = params if train.foreach else math.ceil(max(c.largest_param for c in kids) * master / lay.fsdp)
    step = stepped * STEP_TEMPORARIES[train.optimizer] - freed_by_step
    return math.ceil(max(backward, step, 0))


def _stage_units(lay: Layout, train: Training, prof: ModelProfile, chunks: list[tuple[int, int]]
                 ) -> tuple[tuple[ChildProfile, ...], list[bool], timing.Features, int]:
    """A pipeline rank's children, which of them are checkpointed, the held-fixed features, the
    micro-batch."""
    kids = tuple(c for lo, hi in chunks for c in prof.children[lo:hi])
    micro = train.global_batch // lay.dp // lay.n_microbatches
    mask = (checkpointed(prof.children, lay.checkpoint_every) if lay.activation_checkpointing
            else [False] * len(prof.children))
    ckpt = [mask[i] for lo, hi in chunks for i in range(lo, hi)]
    head = len(prof.children) - 1  # torchtitan keeps the output head in bf16 (filter fqn != "output")
    features = timing.Features(float8=tuple(train.float8 and i != head
                                            for lo, hi in chunks for i in range(lo, hi)),
                               fp8_gather=train.fsdp_float8_all_gather, async_tp=train.async_tp)
    return kids, ckpt, features, micro


def _stage_traffic(lay: Layout, train: Training, prof: ModelProfile,
                   chunks: list[tuple[int, int]]) -> dict[str, float]:
    kids, ckpt, features, micro = _stage_units(lay, train, prof, chunks)
    return volume.stage_traffic(
        kids, ckpt, features, micro=micro, n_microbatches=lay.n_microbatches, tp=lay.tp,
        dp_shard=lay.dp_shard, dp_replicate=lay.dp_replicate, pp=lay.pp, cp=lay.cp,
        boundary_bytes=sum(timing.boundary_sends(prof.children, chunks)), param_bytes=prof.param_bytes,
        master_bytes=MASTER_BYTES[train.precision], op=lay.activation_checkpointing == "op",
        reshard_after_forward=train.reshards(lay.pp), ep=lay.ep)


def _stage_time(lay: Layout, train: Training, prof: ModelProfile, hw: Hardware, chunks: list[tuple[int, int]],
                s: int) -> dict[str, float]:
    kids, ckpt, features, micro = _stage_units(lay, train, prof, chunks)
    units = timing.unit_times(kids, ckpt, micro, tp=lay.tp, fsdp=lay.dp_shard, replicate=lay.dp_replicate,
                              cp=lay.cp, param_bytes=prof.param_bytes,
                              master_bytes=MASTER_BYTES[train.precision],
                              hw=hw, ddp=_runs_ddp(lay), features=features,
                              op_checkpointing=lay.activation_checkpointing == "op", ep=lay.ep)
    # Pipeline neighbours are world / pp ranks apart: on several nodes some pair crosses, and all wait for it.
    bw, lat = timing.link(hw, lay.world_size)
    p2p = sum(micro * n / bw + lat for n in timing.boundary_sends(prof.children, chunks))
    return timing.stage_time(units, pp=lay.pp, stage=s, n_microbatches=lay.n_microbatches,
                             stages_per_rank=len(chunks), p2p=p2p,
                             reshard_after_forward=train.reshards(lay.pp))


def _chunks(lay: Layout, train: Training, prof: ModelProfile) -> list[list[tuple[int, int]]]:
    return rank_chunks(prof, lay.pp, train.stages_per_rank if lay.pp > 1 else 1)


def stage_memories(lay: Layout, train: Training, prof: ModelProfile) -> list[dict[str, int]]:
    """Per-rank bytes by term of each pipeline stage (index = pp rank); ``prof`` is the profile at
    ``lay.tp``."""
    return [_stage_memory(lay, train, prof, chunks, s) for s, chunks in enumerate(_chunks(lay, train, prof))]


def estimate(lay: Layout, train: Training, prof: ModelProfile, hw: Hardware) -> Estimate:
    """Memory of the worst rank and the step time of ``lay``; ``prof`` is the profile at ``lay.tp``."""
    if train.float8 and not hw.fp8_peak_flops:
        raise ConfigError("float8 training needs fp8 tensor cores: this hardware has no fp8 peak")
    memories = stage_memories(lay, train, prof)
    memory = max(memories, key=lambda m: sum(m.values()))
    times = [_stage_time(lay, train, prof, hw, chunks, s)
             for s, chunks in enumerate(_chunks(lay, train, prof))]
    time = max(times, key=lambda t: sum(t.values()))  # the step waits for the slowest pipeline rank
    bubble = timing.bubble_fraction(lay.pp, lay.n_microbatches, train.stages_per_rank if lay.pp > 1 else 1)
    step = sum(time.values())
    samples = train.global_batch / step
    traffic: dict[str, float] = {}
    for chunks in _chunks(lay, train, prof):  # per axis, the most any pipeline rank sends
        for axis, n in _stage_traffic(lay, train, prof, chunks).items():
            traffic[axis] = max(traffic.get(axis, 0.0), n)
    return Estimate(layout=lay, memory=memory, time=time, step_time=step, samples_per_s=samples,
                    tokens_per_s=samples * prof.seq_len, bubble=bubble, traffic=traffic)
