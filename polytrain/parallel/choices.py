"""The values parallel options choose from, readable without torch: the pipeline schedules, how
gradients meet across data-parallel ranks, and the devices context parallel runs on. A config is
checked against them before torch loads (``polytrain.strategies.options``); the code that runs the
choices imports them from here.
"""

from __future__ import annotations

from polytrain.core.errors import ConfigError

# How gradients meet across data-parallel ranks (``parallel.apply.data_parallel_mode`` resolves auto).
DATA_PARALLEL = ("auto", "fsdp", "ddp", "all_reduce", "none")

# name -> (class in torch.distributed.pipelining.schedules, several stages per rank, stage placement)
SCHEDULES: dict[str, tuple[str, bool, str]] = {
    "gpipe": ("ScheduleGPipe", False, "loop"),
    "1f1b": ("Schedule1F1B", False, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True, "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", True, "v"),
}

# Schedules that split each backward into an input-gradient and a weight-gradient pass. FSDP2 reduces
# a unit's gradients from hooks that fire with the input gradients, before the weight pass has made
# them (torch 2.11 and 2.15 alike): those layouts would train on partial gradients, so they are refused.
SPLIT_BACKWARD = ("zero_bubble", "zbv")


def check_schedule_with_fsdp(schedule: str) -> None:
    if schedule in SPLIT_BACKWARD:
        raise ConfigError(f"pipeline schedule={schedule!r} splits backward into input and weight passes, "
                          f"and FSDP reduces a block's gradients before the weight pass has computed them; "
                          f"with dp_shard > 1 (or tp with data parallelism) use gpipe, 1f1b or "
                          f"interleaved_1f1b, or keep {schedule} without FSDP: tp alone, or replicas with "
                          f"data_parallel: all_reduce")


def check_pipeline_with_sharding(pipelined: bool, shards: bool, schedule: str) -> None:
    """A pipeline whose stages are sharded (FSDP) needs a schedule that runs each backward whole.
    ``pipelined``: ``pp > 1``, or, at config time, a ``pp`` not known to be 1 (``-1``: inferred)."""
    if pipelined and shards:
        check_schedule_with_fsdp(schedule)


def check_precision_with_layout(precision: str, pp: int, tensor_parallel: bool) -> None:
    """A GradScaler (``16-mixed``) needs one view of every gradient: not per pipeline stage, not over
    tensor-parallel shards."""
    if precision != "16-mixed" or (pp == 1 and not tensor_parallel):
        return
    what = ("the pipeline strategy (each stage's GradScaler would skip steps on its own)" if pp > 1
            else "tensor parallelism (a GradScaler over sharded gradients)")
    raise ConfigError(f"precision '16-mixed' is not supported by {what}; use precision 'bf16-mixed' or '32'")


def check_schedule_options(schedule: str, stages_per_rank: int, n_microbatches: int | None) -> None:
    """The schedule's name and its stage/micro-batch counts."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule={schedule!r} is not known; valid: {', '.join(SCHEDULES)}")
    for key, value in (("n_microbatches", n_microbatches), ("stages_per_rank", stages_per_rank)):
        if value is not None and value < 1:
            raise ConfigError(f"pipeline {key}={value} must be at least 1")
    if not SCHEDULES[schedule][1] and stages_per_rank != 1:
        raise ConfigError(f"pipeline schedule={schedule!r} runs one stage per rank but stages_per_rank="
                          f"{stages_per_rank}; use interleaved_1f1b, zero_bubble or zbv")
    if schedule == "zbv" and stages_per_rank != 2:
        raise ConfigError(f"pipeline schedule='zbv' needs stages_per_rank=2, got {stages_per_rank}")


def check_context_parallel_device(cp: int, device_type: str) -> None:
    """``cp > 1`` on a device torch has no ring attention for: known from the accelerator alone, so a
    config asking for it on CPU is refused before torch loads."""
    if cp > 1 and device_type != "cuda":
        raise ConfigError(f"cp={cp} (context parallel) runs only on CUDA: torch's ring attention exists "
                          f"for the flash and memory-efficient SDPA kernels alone, and "
                          f"accelerator={device_type!r} has neither. Use cp=1 here (dp_shard/tp/pp still "
                          f"compose), or run on GPUs")
