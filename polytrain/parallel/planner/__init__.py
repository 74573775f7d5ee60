"""The parallelism planner: which layout (degrees, micro-batches, activation checkpointing) to run a
model with, from a profile taken on the meta device and a documented cost model
(docs/strategies/planner.md)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch
from torch import nn

from polytrain.core.batch import map_tensors
from polytrain.core.errors import ConfigError
from polytrain.parallel.fully_shard import blocks_to_wrap
from polytrain.parallel.hardware import PRESETS, Hardware, hardware, parse_bytes
from polytrain.parallel.library_plans import library_plan
from polytrain.parallel.pipeline_path_cut import meta_twin
from polytrain.parallel.pipeline_schedules import MANUAL_OPTIMISATION_REFUSED
from polytrain.parallel.pipeline_sequential_cut import PipelineSplitError, find_sequential
from polytrain.parallel.planner.estimate import Estimate, Layout, Training, estimate
from polytrain.parallel.planner.model_profile import (
    ModelProfile,
    TrainingStep,
    find_experts,
    profile_blocks,
    profile_sequential,
    profile_whole,
    style_names,
)
from polytrain.parallel.planner.search import Plan, format_table, rank_layouts
from polytrain.parallel.tensor_parallel import without_ties

__all__ = ["PRESETS", "Estimate", "Hardware", "Layout", "ModelProfile", "Plan", "Training", "estimate",
           "format_table", "hardware", "on_meta", "parse_bytes", "plan_module", "profiler", "rank_layouts"]


def profiler(module: nn.Module, example: torch.Tensor | None, target: torch.Tensor | None = None,
             attention: str = "flash", sequential: str | None = None, precision: str = "32",
             device: str = "cuda", batch: Any = None, step: TrainingStep | None = None) -> Any:
    """``tp -> ModelProfile`` for a module built on the meta device, cached per degree.

    A module not on meta is profiled through a meta copy of its Sequential. ``example`` is one sample of the
    Sequential's input (batch dimension 1, any device: it is moved to meta), None where the batch has no
    leading input tensor (then the model is profiled through its step); ``target`` one sample of the
    targets for ``module.pipeline_loss``, when the module has one. A model with no Sequential is profiled
    through ``step`` (``training_step``'s loss when None) on ``batch``: one sample of the loader's batch, of
    any structure (``[example, target]`` when None).
    ``attention``: ``flash`` (torch's kernel for SDPA on CUDA in bf16), ``cpu`` (torch's pick on CPU: flash,
    fp32 included, but math under dropout) or ``math``. ``precision``: the training precision
    (``Training``'s), traced as it runs: ``16-mixed`` and ``bf16-mixed`` under the autocast of ``device``
    (``cuda`` or ``cpu``: their rules differ), unless the model is built in the compute dtype.
    """
    hook = getattr(module, "tensor_parallel_plan", None)
    refusal = (f"{type(module).__name__} has no tensor-parallel plan: define tensor_parallel_plan() or "
               f"parallelize(tp_mesh)")
    if callable(hook):
        plan: dict[str, str] | None = style_names(hook())
    else:  # a Hugging Face model's own plan, as the strategy reads it (parallel/library_plans.py)
        try:
            plan = style_names(without_ties(module, library_plan(module) or {})) or None
        except ConfigError as err:  # a style the strategy would refuse: so are the tp > 1 layouts
            plan, refusal = None, str(err)
    # The strategy refuses tensor parallelism for a module that does not say how to split its layers; so
    # does the planner, in the same words, instead of costing a split that will not happen.
    splits = plan is not None or callable(getattr(module, "parallelize", None))
    # The experts modules expert parallel splits, read as the strategy reads them (or why it cannot)
    experts = find_experts(module)
    try:
        if example is None and sequential is None:  # nothing to feed a Sequential: the step runs the model
            raise PipelineSplitError("no leading input tensor")
        seq_name, seq = find_sequential(module, sequential)
    except PipelineSplitError as err:
        if sequential is not None:
            raise
        # No Sequential to cut: every layout but a pipeline runs the model as it is; profile it whole. The
        # strategy cuts such a model at module paths, which the cost model does not follow yet.
        whole = on_meta(module)
        given = batch if batch is not None else [t for t in (example, target) if t is not None]
        on_meta_batch = map_tensors(given, _to_meta)
        reason = ("its batch has no leading input tensor to feed one" if example is None
                  else " ".join(str(err).split()[1:4]))
        why = (f"the planner costs a pipeline of one nn.Sequential's children, and {type(module).__name__} "
               f"has none ({reason}): the strategy cuts it at module paths "
               f"(split_points, or across its repeated blocks), but this plan does not rank that layout; set "
               f"pp yourself")

        # With repeated blocks the strategy cuts it at module paths: profiled block by block, every
        # layout is planned, pipelines included; without, profiled whole (no pipeline).
        by_blocks = len(blocks_to_wrap(whole, None)) >= 2

        @functools.cache
        def whole_at(tp: int) -> ModelProfile:
            if tp > 1 and not splits:
                raise ConfigError(refusal)
            if by_blocks:
                profile = profile_blocks(whole, on_meta_batch, tp, plan, attention, precision, device, step,
                                         experts)
            else:
                profile = profile_whole(whole, on_meta_batch, why, tp, plan, attention, precision, device,
                                        step, experts)
            return dataclasses.replace(profile, pipeline_refused=_pipeline_refused(module))

        return whole_at
    seq = on_meta(seq)
    assert example is not None  # a Sequential is looked for only where there is an input to feed it
    example = example.to("meta")
    loss_fn = getattr(module, "pipeline_loss", None)
    loss = None
    if callable(loss_fn) and target is not None:
        target = target.to("meta")
        loss = functools.partial(_apply_loss, loss_fn, target)

    @functools.cache
    def at(tp: int) -> ModelProfile:
        if tp > 1 and not splits:
            raise ConfigError(refusal)
        profile = profile_sequential(seq, example, tp, plan, seq_name, loss, attention, precision, device,
                                     experts)
        return dataclasses.replace(profile, pipeline_refused=_pipeline_refused(module))

    return at


def on_meta(module: nn.Module) -> nn.Module:
    """``module`` if it is on meta already, else a copy on meta (its weights are never copied)."""
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    return module if all(t.is_meta for t in tensors) else meta_twin(module)


def _pipeline_refused(module: nn.Module) -> str | None:
    """The pipeline strategy's refusal of this module, in its words, or None."""
    if getattr(module, "automatic_optimization", True):
        return None
    return MANUAL_OPTIMISATION_REFUSED


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def _apply_loss(loss_fn: Any, target: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return loss_fn(out, target)


def plan_module(module: nn.Module, example: torch.Tensor, hw: Hardware, train: Training,
                target: torch.Tensor | None = None, attention: str = "flash",
                pinned: dict[str, int] | None = None, device: str = "cuda") -> Plan:
    """Rank every layout of ``hw``'s world for ``module`` (built on meta) on ``train``'s batch, traced in
    ``train``'s precision as ``device`` (``cuda`` or ``cpu``) runs it."""
    return rank_layouts(hw, train, profiler(module, example, target, attention, precision=train.precision,
                                            device=device), pinned)
