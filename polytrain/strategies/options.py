"""What each strategy takes, readable without torch: its options (one dataclass per strategy), the
Lightning strategy strings that stand for one of them, and the check of a ``trainer.strategy`` value
against them. ``polytrain`` checks a config's strategy with this before torch loads, so a typo answers
at once; each strategy class takes its ``Options`` from here, and the registry checks a spec with the
same function (``check_strategy_spec``) over the classes it has, a strategy registered from outside
the package included.

A ``parallel`` spec that asks the planner (``plan: true``, ``"auto"`` degrees: ``wants_plan``) is
checked by ``plan_spec.split_plan``, torch-free as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polytrain.core.errors import ConfigError
from polytrain.core.option_checks import check_choice, suggest, validate_dataclass
from polytrain.parallel.choices import DATA_PARALLEL, check_schedule_options

MODES = ("layers", "tensor")  # model_parallel's

@dataclass
class SingleOptions:
    device_index: int = 0  # which GPU when accelerator is cuda


@dataclass
class DataParallelOptions:
    output_device: int | None = None


@dataclass
class DDPOptions:
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False


@dataclass
class FSDPOptions:
    # Class names of the submodules that become FSDP units (one all-gather each). None: every child
    # of the model's largest nn.ModuleList/nn.Sequential (the "blocks"), and of every other container
    # repeating the same block class (ResNet's layer1..layer4); the rest goes to the root.
    wrap_modules: list[str] | None = None
    # False: keep gathered blocks until backward (more memory, less traffic)
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer state live in CPU memory
    dp_replicate: int | None = None  # HSDP replica groups; None: num_nodes (shard inside a node)
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    sync_batchnorm: bool = False


@dataclass
class ModelParallelOptions:
    mode: str = "layers"  # "layers" (layers across a process's devices) | "tensor" (DeviceMesh tp)
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    # --- mode: layers
    devices_per_process: int = 2  # CPU: that many placements on the one CPU device (tests the path)
    sequential: str | None = None  # attribute holding the nn.Sequential to place; None: the only one
    split_points: list[int] | None = None  # first child index on devices 1..n-1; None: balance params
    split_size: int | None = None  # micro-batch size for pipelining inside the process; None: off
    find_unused_parameters: bool = False  # DDP across processes
    # --- mode: tensor
    tp: int | None = None  # tensor-parallel degree; None: the world size / (dp_replicate x dp_shard)
    dp_shard: int = -1  # FSDP degree over the data dimension; -1: whatever tp leaves of the world
    dp_replicate: int = 1  # HSDP replicas (a replicate x shard data-parallel mesh)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"model_parallel mode={self.mode!r} is not valid; "
                              f"choose one of: {', '.join(MODES)}")
        if self.mode == "layers":
            if self.devices_per_process < 1:
                raise ConfigError(f"model_parallel devices_per_process={self.devices_per_process} "
                                  f"must be >= 1")
            if self.tp is not None or self.dp_shard != -1 or self.dp_replicate != 1:
                raise ConfigError(f"model_parallel options tp={self.tp}, dp_shard={self.dp_shard}, "
                                  f"dp_replicate={self.dp_replicate} apply to mode: tensor; "
                                  f"set mode: tensor or drop them")
        elif self.split_size is not None or self.split_points is not None or self.sequential is not None:
            raise ConfigError(f"model_parallel options split_size={self.split_size}, split_points="
                              f"{self.split_points}, sequential={self.sequential!r} apply to mode: layers; "
                              f"set mode: layers or drop them")


@dataclass
class PipelineOptions:
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv
    n_microbatches: int | None = None  # None: the number of stages (pp x stages_per_rank)
    pp: int = -1  # pipeline degree; -1: the whole world (dp = world / pp)
    stages_per_rank: int = 1  # > 1 for the interleaved / zero-bubble schedules (zbv: exactly 2)
    split_points: list[int] | list[str] | None = None  # first child index (or module path) of stages 1..n-1
    sequential: str | None = None  # attribute holding the nn.Sequential; None: the only one
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        check_schedule_options(self.schedule, self.stages_per_rank, self.n_microbatches)
        if self.pp == 0 or self.pp < -1:
            raise ConfigError(f"pipeline pp={self.pp} must be a positive degree or -1 (the whole world)")


@dataclass
class ParallelOptions:
    dp_replicate: int = 1  # replicas (HSDP across them when sharded); -1: inferred
    dp_shard: int = -1  # FSDP degree; -1: whatever the other degrees leave of the world
    tp: int = 1  # tensor parallel (tensor_parallel_plan(), parallelize(tp_mesh) or a held HF model's plan)
    pp: int = 1  # pipeline stages' ranks (the module's nn.Sequential is cut)
    cp: int = 1  # context parallel (sequence split; CUDA with flash/efficient attention only)
    # expert parallel: a mixture-of-experts model's experts split over ep data-parallel ranks (ep divides
    # dp_replicate x dp_shard: borrowed from them, not a factor of the world size)
    ep: int = 1
    data_parallel: str = "auto"  # auto | fsdp | ddp | all_reduce: how gradients meet across data ranks
    # --- pipeline (pp > 1)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv
    n_microbatches: int | None = None  # None: the number of stages
    stages_per_rank: int = 1
    split_points: list[int] | list[str] | None = None  # first child index (or module path) of stages 1..n-1
    sequential: str | None = None  # attribute holding the nn.Sequential; None: the only one
    # --- FSDP (dp_shard x cp > 1, or under tp with dp > 1)
    wrap_modules: list[str] | None = None
    # None: true, false under a pipeline (no gather per micro-batch)
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    sync_batchnorm: bool = False
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        check_choice(self.data_parallel, DATA_PARALLEL, "parallel data_parallel")
        check_schedule_options(self.schedule, self.stages_per_rank, self.n_microbatches)
        if self.cp < 1:  # what cp > 1 needs of torch and the device: ParallelStrategy.check_options
            raise ConfigError(f"parallel degree cp={self.cp} must be >= 1")
        if self.ep < 1:  # what it must divide is known with the world size (ParallelDims)
            raise ConfigError(f"parallel degree ep={self.ep} must be >= 1")


# Every strategy of the package by name (the registry's test holds each class to its entry here).
OPTIONS: dict[str, type] = {
    "single": SingleOptions,
    "dp": DataParallelOptions,
    "ddp": DDPOptions,
    "fsdp": FSDPOptions,
    "model_parallel": ModelParallelOptions,
    "pipeline": PipelineOptions,
    "parallel": ParallelOptions,
}

# Lightning's strategy strings -> the strategy and options they mean.
LIGHTNING_NAMES: dict[str, dict[str, Any]] = {
    "single_device": {"name": "single"},
    "ddp_find_unused_parameters_true": {"name": "ddp", "find_unused_parameters": True},
    "ddp_find_unused_parameters_false": {"name": "ddp", "find_unused_parameters": False},
}

# A parallel spec asks the planner with plan keys or "auto" (string) degrees (plan_spec.py).
PLANNED_NAME = "parallel"
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")  # the mesh's: their product is the world size
# ...and expert parallel, borrowed from the data-parallel ranks: a degree the planner may choose too
PLANNABLE = (*DEGREES, "ep")
PLAN_KEYS = ("plan", "global_batch", "hardware", "chosen")


def wants_plan(name: str, options: dict[str, Any]) -> bool:
    """Does ``{name, **options}`` ask the planner for something? (``plan_spec.split_plan`` checks
    what it asks.)"""
    return name == PLANNED_NAME and (any(k in options for k in PLAN_KEYS) or
                                     any(isinstance(options.get(k), str) for k in PLANNABLE))


def spec_mapping(value: Any, aliases: Mapping[str, dict[str, Any]] = LIGHTNING_NAMES,
                 names: Mapping[str, Any] = OPTIONS) -> Any:
    """``"ddp"`` and ``{"name": "ddp", ...}`` both become the mapping form; an alias (a name no strategy
    has) becomes what it stands for. Anything else (a Strategy instance) is returned as it is."""
    if value is None:
        return {"name": "auto"}
    if isinstance(value, str):
        if value != "auto" and value not in names and value in aliases:
            return dict(aliases[value])
        return {"name": value}
    if isinstance(value, dict):
        return {"name": "auto", **value}
    if hasattr(value, "items"):
        return {"name": "auto", **dict(value.items())}
    return value


def check_strategy_spec(spec: dict[str, Any], options_of: Mapping[str, type] = OPTIONS,
                        ) -> tuple[str, Any]:
    """The name and the options of ``{name: ..., **options}`` (not a planner request): ``(name, the
    options dataclass)``, or ``("auto", None)``. ``options_of`` maps each known name to its options
    class. Raises ``ConfigError`` naming the valid names or keys."""
    options = dict(spec)
    name = options.pop("name", "auto")
    if name == "auto":
        if options:
            raise ConfigError(f"strategy 'auto' takes no options (got {', '.join(options)}); name a strategy")
        return "auto", None
    if not isinstance(name, str) or name not in options_of:
        raise ConfigError(f"unknown strategy {name!r}{suggest(str(name), ['auto', *options_of], n=2)}")
    options_class = options_of[name]
    valid = [f.name for f in dataclasses.fields(options_class)]
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ConfigError(f"strategy '{name}' has no option '{unknown[0]}'; "
                          f"valid: {', '.join(valid) or '(none)'}")
    return name, validate_dataclass(options_class, options, f"trainer.strategy ({name})")
