"""``parallel``: every parallelism composed over one device mesh.

    strategy: {name: parallel, pp: 2, tp: 2, dp_shard: 2}      # 8 processes

Degrees ``dp_replicate x dp_shard x cp x tp x pp`` (one may be ``-1``: inferred), and ``ep`` (expert
parallel, borrowed from the data-parallel ranks), make one ``ParallelDims``; ``parallel.apply`` applies
the parallelisms to the model in one stated order
(tensor parallel, activation checkpointing, compile, FSDP/HSDP) and, with ``pp > 1``, first cuts the
module into stages that are each parallelised within their own sub-mesh. The user's ``training_step``
and hooks run as under every other strategy.

This class holds the options and their composition. What differs with a pipeline is asked of the
executor chosen once in ``setup_environment``: ``WholeModel`` (``strategies/whole_model.py``) or
``PipelineRunner`` (``strategies/pipeline_runner.py``), as the data-parallel backend is chosen once
(``strategies/gradient_sync.py``).

Today's strategy names are presets of this class (``single``, ``ddp``, ``fsdp``, ``model_parallel``
tensor mode, ``pipeline``): each maps its own options to a ``ParallelLayout`` in ``compose`` and inherits
everything else. See docs/strategies/composition.md.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from polytrain.checkpoint.checkpoint_io import CheckpointIO, ReplicatedCheckpointIO, ShardedCheckpointIO
from polytrain.core.environment import ClusterEnvironment
from polytrain.core.process_group import default_backend, init_process_group, resolve_device
from polytrain.core.rank_zero import rank_zero_info
from polytrain.data.padding import EvalBatches
from polytrain.layers.sync_batchnorm import convert_sync_batchnorm
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.parallel.apply import (
    FSDPSettings,
    ParallelLayout,
    PipelineSettings,
    data_parallel_mode,
    parallelize,
)
from polytrain.parallel.choices import (
    check_pipeline_with_sharding,
    check_precision_with_layout,
)
from polytrain.parallel.context_parallel import check_context_parallel, context_parallel_training_step
from polytrain.parallel.dims import ParallelDims, check_ep_composes
from polytrain.parallel.dtensor_optim import step_across_meshes, support_fused_sgd
from polytrain.parallel.expert_parallel import check_expert_degree, expert_layers, expert_plan
from polytrain.parallel.float8 import with_float8_styles
from polytrain.parallel.fully_shard import broadcast_module, materialize_meta
from polytrain.strategies.base import Strategy
from polytrain.strategies.gradient_sync import backend_for
from polytrain.strategies.options import ParallelOptions
from polytrain.strategies.pipeline_runner import PipelineRunner
from polytrain.strategies.registry import register
from polytrain.strategies.router import StepRouter


@register
class ParallelStrategy(Strategy):
    """What differs between layouts is resolved once: the data-parallel backend, whether the module's
    tensor-parallel plan applies, and the executor (whole model or pipeline), which fixes the evaluation
    step, the no-sync context and the clipping by norm once the model is wrapped."""

    name = "parallel"
    Options = ParallelOptions

    def __init__(self, options: Any, *, layout: ParallelLayout | None = None,
                 dims: ParallelDims | None = None, checkpoint_io: CheckpointIO | None = None,
                 **kwargs: Any) -> None:
        self.layout = layout if layout is not None else self.compose(options, kwargs["num_nodes"])
        env: ClusterEnvironment = kwargs["env"]
        dims = dims if dims is not None else self.layout.dims(env.world_size, env.global_rank)
        self.backend = backend_for(data_parallel_mode(self.layout, dims), self.layout.ddp)
        self.tensor_parallel = self.layout.uses_tp(dims)  # the module's plan is applied
        check_pipeline_with_sharding(dims.pp > 1, self.backend.shards, self.layout.pipeline.schedule)
        # The one place deciding whether the model is spread over ranks: parameters are DTensors (FSDP,
        # tensor parallel), and with a pipeline each rank holds some stages only.
        self.dtensor_parameters = self.backend.shards or self.tensor_parallel
        self._gathers = self.dtensor_parameters or dims.pp > 1
        super().__init__(options, dims=dims, checkpoint_io=checkpoint_io, **kwargs)
        # The executor (strategies/train_step.py) is the whole model until setup_environment, which needs
        # the process group to build a pipeline's.
        self._init_rng: torch.Tensor | None = None

    @classmethod
    def build(cls, options: Any, **kwargs: Any) -> ParallelStrategy:
        layout = cls.compose(options, kwargs["num_nodes"])  # once per build
        return cls(options, layout=layout, **kwargs)

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> ParallelLayout:
        """This strategy's options as a ``ParallelLayout`` (presets override this and nothing else of
        substance)."""
        o = options
        pipeline = PipelineSettings(o.schedule, o.n_microbatches, o.stages_per_rank, o.split_points,
                                    o.sequential)
        return ParallelLayout(dp_replicate=o.dp_replicate, dp_shard=o.dp_shard, tp=o.tp, pp=o.pp, cp=o.cp,
                              ep=o.ep,
                              data_parallel=o.data_parallel, backend=o.backend,
                              sync_batchnorm=o.sync_batchnorm,
                              fsdp=FSDPSettings(o.wrap_modules, o.reshard_after_forward, o.cpu_offload),
                              pipeline=pipeline)

    @classmethod
    def parallel_dims(cls, options: Any, env: ClusterEnvironment, num_nodes: int) -> Any:
        return cls.compose(options, num_nodes).dims(env.world_size, env.global_rank)

    @classmethod
    def check_options(cls, options: Any, device_type: str) -> None:
        layout = cls.compose(options, 1)
        if layout.cp != 1:
            check_context_parallel(layout.cp, device_type)
        check_ep_composes(layout.ep, layout.pp, layout.cp)
        # The rest is known with the world size.
        check_pipeline_with_sharding(layout.pp != 1,
                                     layout.data_parallel == "fsdp" or layout.dp_shard > 1 or layout.cp > 1,
                                     layout.pipeline.schedule)

    def default_checkpoint_io(self) -> CheckpointIO:
        return ShardedCheckpointIO() if self._gathers else ReplicatedCheckpointIO()

    @property
    def data_parallel(self) -> str:
        """How gradients meet across data-parallel ranks: ``fsdp`` | ``ddp`` | ``all_reduce`` | ``none``."""
        return self.backend.name

    # ------------------------------------------------------------------ topology (all from self.dims)
    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_group(self) -> Any:
        if self.dims.dp_size == self.world_size:
            return None  # the data-parallel group is the world
        return self.dims.get_mesh("dp").get_group()

    @property
    def pp_rank(self) -> int:
        return self.dims.pp_rank

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def pp_group(self) -> Any:
        return self.dims.get_mesh("pp").get_group()

    @property
    def is_last_stage(self) -> bool:
        return self.executor.is_last_stage

    @property
    def is_logging_rank(self) -> bool:
        """The rank holding the loss (a pipeline's last stage, its first replica)."""
        return self.executor.is_logging_rank()

    def counts_over_stages(self, counts: dict[str, Any]) -> dict[str, Any]:
        """Every rank (a collective over the pipeline's stages): each stage's counts added, a child split
        over stages (a ModuleList's blocks) counted on each, in the order of the stages."""
        if self.pp_size == 1:
            return counts
        merged: dict[str, Any] = {"children": [], "total": 0, "trainable": 0}
        by_name: dict[str, int] = {}
        for stage in self.all_gather_object(counts, group=self.pp_group):
            merged["total"] += stage["total"]
            merged["trainable"] += stage["trainable"]
            for name, kind, n in stage["children"]:
                if name in by_name:
                    row = merged["children"][by_name[name]]
                    merged["children"][by_name[name]] = (name, kind, row[2] + n)
                else:
                    by_name[name] = len(merged["children"])
                    merged["children"].append((name, kind, n))
        return merged

    @property
    def fsdp_mesh(self) -> Any:
        """1-D (shard) mesh, or 2-D (replicate, shard) for HSDP, as ``fully_shard`` expects."""
        return self.dims.get_mesh("fsdp")

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        layout, dims = self.layout, self.dims
        index = layout.device_index if layout.device_index is not None else self.local_rank
        self._device = resolve_device(self.accelerator, index)
        check_precision_with_layout(self.precision.name, dims.pp, self.tensor_parallel)
        if dims.cp > 1:
            check_context_parallel(dims.cp, self._device.type)
        if self.world_size > 1:
            self.join_process_group()
        if dims.pp > 1:
            self.executor = PipelineRunner(self, layout.pipeline, dims,
                                           averages_grads=self.backend.name == "all_reduce",
                                           padding=self.backend.padding)

    def join_process_group(self) -> None:
        """Join the job's process group and build the mesh (idempotent). Several processes join in
        ``setup_environment``; one alone joins in ``setup_module``, after the module's plan was read."""
        if not self.layout.process_group:
            return
        init_process_group(self.env, self.layout.backend or default_backend(self._device), self.timeout)
        self.dims.build_mesh(self._device.type)

    def model_init_context(self) -> contextlib.AbstractContextManager:
        if not self._meta_init:
            return contextlib.nullcontext()
        # Layers built in configure_model land on the meta device (no memory); setup_module then
        # allocates only this rank's shards and initialises them from this RNG state.
        self._init_rng = torch.get_rng_state()
        return torch.device("meta")

    @property
    def _meta_init(self) -> bool:
        if self.layout.meta_init is not None:
            return self.layout.meta_init
        # Not under expert parallel: each rank cuts its experts from full weights (split_experts).
        return (self.backend.shards and not self.tensor_parallel and self.dims.pp == self.dims.cp == 1
                and self.dims.ep == 1)

    @property
    def _state_device(self) -> torch.device:
        return torch.device("cpu") if self.layout.fsdp.cpu_offload else self.root_device

    def setup_module(self, module: nn.Module) -> nn.Module:
        dims, backend = self.dims, self.backend
        plan = tp_fn.module_plan(module) if self.tensor_parallel else None  # read before any rendezvous
        if self.tensor_parallel:
            plan = with_float8_styles(module, plan, tp_fn.resolve_key)
        experts = None
        if dims.ep > 1:  # read and checked before any rendezvous too: every rank says it alike
            experts = expert_layers(module, expert_plan(module))
            check_expert_degree(experts, dims.ep, dims.dp_size)
        self.executor.check_module(module)
        self.join_process_group()
        module = self.precision.convert_module(module)
        if self.layout.sync_batchnorm:
            if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
                rank_zero_info(f"sync_batchnorm: {type(module).__name__} has no BatchNorm layer: nothing to "
                               f"synchronise across processes")
            module = convert_sync_batchnorm(module, self.dp_group if backend.shards else None)
        on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
        if backend.broadcasts_weights and self.world_size > 1:
            # as DDP: every rank starts from rank 0's weights
            broadcast_module(module, self.collective_device)
        # A pipeline keeps this rank's stages only (blocks to checkpoint chosen on the whole model first).
        plan, chosen = self.executor.cut_model(module, plan, self.is_global_zero)
        if not on_meta:
            module.to(self._state_device)  # else fully_shard moves what is not on meta
        router = StepRouter(module)
        parallelize(module, self.executor.roots(router), dims, self.layout, backend.name, plan,
                    self.precision.autocast_dtype, self.root_device.type,
                    self.activation_checkpointing_options, self.compile_options, chosen, experts)
        if on_meta:
            materialize_meta(module, self._state_device, self._init_rng, self.filled_after_setup)
        self.module, self.model = module, backend.wrap(router, self.root_device)
        self.executor.build(module, self.root_device)  # the step verbs, fixed now the model is wrapped
        return self.model

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        if self.dtensor_parameters:
            support_fused_sgd(optimizers)  # every parameter is a DTensor
            step_across_meshes(optimizers)  # the experts of expert parallel have a mesh of their own
        self.executor.new_optimizers()
        return super().setup_optimizers(optimizers)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, loader: DataLoader, stage: str, seed: int, use_sampler: bool | str) -> Any:
        loader = super().process_dataloader(loader, stage, seed, use_sampler)  # split over dp only
        if stage == "train":
            self.executor.check_train_loader(loader)
            return loader
        padding = self.backend.padding
        # FSDP gathers in every forward: data ranks must run as many evaluation batches as each other.
        return loader if padding is None else EvalBatches(loader, padding, self.collective_device)

    # ------------------------------------------------------------------ step
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.executor.check_manual_optimisation()
        if self.module.automatic_optimization:
            return super().training_step(batch, batch_idx)
        with self.backend.manual_step(self.model):
            return super().training_step(batch, batch_idx)

    def training_step_function(self) -> Callable[[Any, int], Any]:
        step = self.backend.checked_step(super().training_step_function(), self.model)
        return (step if self.dims.cp <= 1
                else context_parallel_training_step(step, self.dims.get_mesh("cp"), self.module))

    def prepare_manual_backward(self, loss: torch.Tensor) -> None:
        self.backend.prepare_manual_backward(self.model, loss)

    def eval_step(self, stage: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        executor_step = self.executor.eval_step
        if executor_step is None:  # nothing gathers or routes: the unwrapped module's step
            return super().eval_step(stage, batch, batch_idx, dataloader_idx)
        return executor_step(stage, batch, batch_idx, dataloader_idx)

    def prepare_evaluation(self) -> None:
        self.executor.prepare_evaluation()

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return self.executor.no_sync() if enabled else contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints and teardown
    @property
    def gathers_state(self) -> bool:
        return self._gathers

    def module_state_dict(self) -> dict[str, Any]:
        """The full model as CPU tensors on rank 0 (others: ``{}``) when spread over ranks (a collective:
        every rank calls it); the module's own state dict when every rank holds all of it."""
        return self.executor.module_state_dict()

    def teardown(self) -> None:
        super().teardown()
        self.dims.release_mesh()
        gc.collect()  # the groups' C++ objects go now, while the interpreter is whole (see release_mesh)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
