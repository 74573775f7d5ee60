"""The one place that says in which order parallelisms are applied to a model part.

A "part" is what one rank runs forward: the whole module (no pipeline), or one pipeline stage
(``pipeline_sequential_cut`` cuts the user's ``nn.Sequential`` first, so every later step sees only this
rank's layers and works inside this stage's sub-mesh). On each part, in torchtitan's order:

0. **expert parallel** (``expert_parallel``): a mixture-of-experts model's experts split over the ``ep``
   ranks, their tokens dispatched with all-to-all. First, so that tensor parallel finds the experts
   already ``DTensor`` s of their own mesh and leaves them alone (each tp peer runs its group's experts on
   the batch they share).
1. **tensor parallel** (``tensor_parallel``): the module's plan over the ``tp`` mesh; parameters the
   plan leaves alone become replicated DTensors. First, because it rewrites layers (DTensor
   parameters, input/output hooks) that everything after must see as they finally are.
2. **activation checkpointing** (``trainer.activation_checkpointing``; ``parallel.activation_checkpointing``):
   the blocks of the FSDP wrap policy recompute in backward. After TP, so a recomputed block
   recomputes its TP collectives too; before compile, so the compiled graph holds the checkpoint
   boundaries. A pipeline chooses the blocks on the whole model before the cut (every rank alike).
3. **compile** (``trainer.compile``; ``parallel.compile``): per block under FSDP or TP (after the
   block's final form is known, before FSDP: FSDP's hooks stay outside the compiled regions), per
   stage in a plain pipeline, the model's network otherwise (under DDP: split by DDPOptimizer).
4. **data parallel**: FSDP2/HSDP over the ``fsdp`` mesh (``dp_replicate x dp_shard x cp``; on top of
   TP: 2-D DTensors), or a gradient all-reduce, or DDP's wrapper (a plain replicated module). Last,
   because it shards whatever parameters the steps above left, and wraps units in their final form.
   The experts are FSDP units of their own first, over ``efsdp`` (the data-parallel ranks holding the same
   experts), their gradients divided by the whole data-parallel size: each expert's gradient already sums
   its expert group's tokens.

``ParallelLayout`` is the resolved description a strategy composes from its options (a preset fills it
from its own option names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from polytrain.core.errors import ConfigError
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.parallel.activation_checkpointing import apply_activation_checkpointing
from polytrain.parallel.choices import DATA_PARALLEL
from polytrain.parallel.compile import apply_compile, compile_targets
from polytrain.parallel.dims import ParallelDims
from polytrain.parallel.expert_parallel import ExpertLayer, split_experts
from polytrain.parallel.fully_shard import apply_fsdp
from polytrain.parallel.library_plans import library_summed_keys
from polytrain.parallel.pipeline_path_cut import Elsewhere

APPLY_ORDER = ("expert_parallel", "tensor_parallel", "activation_checkpointing", "compile", "data_parallel")


@dataclass
class FSDPSettings:
    # class names of the FSDP units; None: the repeated blocks (fsdp.blocks_to_wrap)
    wrap_modules: list[str] | None = None
    # None: True, except under a pipeline, where PipelineStage keeps every unit gathered after its first
    # backward anyway and resharding after forward would gather it again for every micro-batch
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False


@dataclass
class PipelineSettings:
    schedule: str = "1f1b"
    n_microbatches: int | None = None
    stages_per_rank: int = 1
    split_points: list[int] | list[str] | None = None  # child indices, or module paths
    sequential: str | None = None
    step: str = "training_step"  # "training_step": the user's step per micro-batch | "pipeline_loss"


@dataclass
class ParallelLayout:
    """Degrees and the per-parallelism settings of one job (``-1``: inferred from the world size)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: borrows from dp_replicate x dp_shard
    # auto | fsdp (even on one rank) | ddp (wrapper) | all_reduce (flat, per step)
    data_parallel: str = "auto"
    fsdp: FSDPSettings = field(default_factory=FSDPSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    ddp: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallel keyword arguments
    sync_batchnorm: bool = False
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    device_index: int | None = None  # None: the local rank's device
    meta_init: bool | None = None  # configure_model on the meta device; None: under plain FSDP
    process_group: bool = True  # False: one process and nothing to communicate (single)
    tensor_parallel: bool | None = None  # apply the module's plan; None: when tp > 1 (model_parallel: always)

    def dims(self, world_size: int, rank: int) -> ParallelDims:
        return ParallelDims(world_size, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp,
                            pp=self.pp, cp=self.cp, rank=rank, ep=self.ep)

    def uses_tp(self, dims: ParallelDims) -> bool:
        return dims.tp > 1 if self.tensor_parallel is None else self.tensor_parallel


def data_parallel_mode(layout: ParallelLayout, dims: ParallelDims) -> str:
    """How gradients meet across data-parallel ranks: ``fsdp`` | ``ddp`` | ``all_reduce`` | ``none``.

    ``auto``: FSDP whenever parameters are sharded over data (``dp_shard x cp > 1``) or already DTensors
    (tensor parallel: HSDP with one shard when only replicated); a plain replicated model: DDP without a
    pipeline, one flat all-reduce per step with one (stages run outside any wrapper). ``none``: nothing
    meets (one replica, or ``single`` started several times). Expert parallel needs FSDP: the experts
    reduce their gradients as FSDP units over a mesh of their own."""
    mode = layout.data_parallel
    if mode not in DATA_PARALLEL:
        raise ConfigError(f"data_parallel={mode!r} is not valid; choose one of: {', '.join(DATA_PARALLEL)}")
    if dims.ep > 1:
        if mode not in ("auto", "fsdp"):
            raise ConfigError(f"data_parallel={mode!r} with ep={dims.ep}: the experts reduce their gradients "
                              f"as FSDP units over their own ranks; use data_parallel=auto or fsdp")
        return "fsdp"
    if mode != "auto":
        if mode == "ddp" and (dims.tp > 1 or dims.pp > 1 or dims.fsdp_size > 1):
            raise ConfigError(f"data_parallel='ddp' replicates a plain module: "
                              f"it cannot combine with tp={dims.tp}, "
                              f"pp={dims.pp}, dp_shard x cp={dims.fsdp_size}; use data_parallel=auto")
        return mode
    if dims.fsdp_size > 1 or (layout.uses_tp(dims) and dims.dp_size > 1):
        return "fsdp"
    if dims.dp_size == 1:
        return "none"
    return "all_reduce" if dims.pp > 1 else "ddp"


@dataclass
class Applied:
    """What applying the parallelisms to one part produced (the strategy needs it for the step)."""

    replicas: list[tuple[nn.Module, str]] = field(default_factory=list)  # tp: (owner, name) made replicated
    steps: list[str] = field(default_factory=list)  # the APPLY_ORDER entries that did something


def parallelize(part: nn.Module, roots: list[nn.Module], dims: ParallelDims, layout: ParallelLayout,
                mode: str, plan: dict[str, Any] | None, autocast_dtype: torch.dtype | None, device_type: str,
                checkpointing: dict[str, Any] | None = None, compile_options: dict[str, Any] | None = None,
                checkpoint_blocks: list[nn.Module] | None = None,
                experts: list[ExpertLayer] | None = None) -> Applied:
    """Apply every parallelism of ``layout`` to ``part`` (the module, or a pipeline rank's pruned module)
    in ``APPLY_ORDER``. ``roots`` are what forward runs through (the step's router, or this rank's
    pipeline stages): they get the TP view hooks and are the FSDP roots. ``plan`` None with tp > 1 means
    the module's own ``parallelize(tp_mesh)``. ``checkpointing`` and ``compile_options`` are the
    trainer's options, resolved (None: off); ``checkpoint_blocks``: the blocks a pipeline chose before
    the cut (``checkpoint_targets`` on the whole model); ``experts``: the experts modules the model's
    expert-parallel plan names (read before any rendezvous), split when ``ep > 1``."""
    if compile_options is not None and mode == "ddp" and layout.ddp.get("bucket_cap_mb", 25) < 1:
        raise ConfigError(f"ddp bucket_cap_mb={layout.ddp['bucket_cap_mb']} with trainer.compile: dynamo's "
                          f"DDPOptimizer needs buckets of at least DDP's 1 MB first bucket; "
                          f"use bucket_cap_mb >= 1")
    applied = Applied()
    held = {id(m) for m in part.modules()}
    experts = [layer for layer in experts or [] if id(layer.module) in held]  # a pipeline stage's own
    if dims.ep > 1 and experts:
        split_experts(experts, dims.get_mesh("ep"))
        applied.steps.append("expert_parallel")
    if layout.uses_tp(dims):
        tp_mesh = dims.get_mesh("tp")
        tp_fn.apply_tensor_parallel(part, tp_mesh, plan)
        applied.replicas = tp_fn.replicate_unplanned(part, tp_mesh)
        tp_fn.sum_grads_over_tp(part, library_summed_keys(part), tp_mesh)
        for root in roots:
            tp_fn.localize_replicas(root, applied.replicas)  # before fully_shard: see localize_replicas
        applied.steps.append("tensor_parallel")
    wrap_modules = layout.fsdp.wrap_modules  # the FSDP units are the checkpointed and compiled blocks
    if checkpointing is not None:
        apply_activation_checkpointing(part, checkpointing, wrap_modules, checkpoint_blocks)
        applied.steps.append("activation_checkpointing")
    if compile_options is not None:
        scope = "blocks" if mode == "fsdp" or layout.uses_tp(dims) else "stages" if dims.pp > 1 else "model"
        apply_compile(compile_targets(part, compile_options, scope, wrap_modules, roots), compile_options)
        applied.steps.append("compile")
    if mode == "fsdp":
        reshard = layout.fsdp.reshard_after_forward
        own_units = []
        if dims.ep > 1:
            own_units = [(layer.module, dims.get_mesh("efsdp"), dims.dp_size) for layer in experts]
        apply_fsdp(part, roots, dims.get_mesh("fsdp"), autocast_dtype, layout.fsdp.wrap_modules,
                   dims.pp == 1 if reshard is None else reshard, layout.fsdp.cpu_offload, device_type,
                   own_units)
        applied.steps.append("data_parallel")
    return applied


def local_plan(module: nn.Module, plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """The entries of ``plan`` that reach a submodule this rank still holds (a pipeline stage keeps
    only its layers; the plan was checked against the whole module before the cut)."""
    if plan is None:
        return None
    if not any(isinstance(m, Elsewhere) for m in module.modules()):
        return {key: style for key, style in plan.items() if tp_fn.resolve_key(module, key)}
    # Cut at module paths, other stages' modules are stand-ins: each key becomes the names it reaches
    # here, without them (a pattern would walk into a stand-in, which has no submodules).
    return {name: style for key, style in plan.items() for name in tp_fn.resolve_key(module, key)
            if not isinstance(module.get_submodule(name), Elsewhere)}
