"""``parallel``: every parallelism composed over one device mesh.

    strategy: {name: parallel, pp: 2, tp: 2, dp_shard: 2}      # 8 processes

Degrees ``dp_replicate x dp_shard x cp x tp x pp`` (one may be ``-1``: inferred) make one
``ParallelDims``; ``parallel.apply`` applies the parallelisms to the model in one stated order
(tensor parallel, activation checkpointing, compile, FSDP/HSDP) and, with ``pp > 1``, first cuts the
module's ``nn.Sequential`` into stages that are each parallelised within their own sub-mesh
(``strategies.pipeline_runner``). The user's ``training_step`` and hooks run as under every other strategy.

Today's strategy names are presets of this class (``single``, ``ddp``, ``fsdp``, ``model_parallel``
tensor mode, ``pipeline``): each maps its own options to a ``ParallelLayout`` in ``compose`` and inherits
everything else. See docs/strategies/composition.md.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from polytrain.checkpoint.checkpoint_io import CheckpointIO, ReplicatedCheckpointIO, ShardedCheckpointIO
from polytrain.checkpoint.state import full_model_state, gathered_stage_state
from polytrain.core.environment import ClusterEnvironment
from polytrain.core.errors import ConfigError
from polytrain.core.process_group import default_backend, init_process_group, resolve_device
from polytrain.data.padding import EvalBatches
from polytrain.layers.sync_batchnorm import convert_sync_batchnorm
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.parallel.activation_checkpointing import checkpoint_targets
from polytrain.parallel.apply import (
    FSDPSettings,
    ParallelLayout,
    PipelineSettings,
    data_parallel_mode,
    local_plan,
    parallelize,
)
from polytrain.parallel.choices import SCHEDULES, check_schedule_with_fsdp
from polytrain.parallel.context_parallel import check_context_parallel, context_parallel_training_step
from polytrain.parallel.dims import ParallelDims
from polytrain.parallel.dtensor_optim import support_fused_sgd
from polytrain.parallel.float8 import with_float8_styles
from polytrain.parallel.fsdp import broadcast_module, materialize_meta
from polytrain.parallel.pipeline_stage import (
    schedule_class,
)
from polytrain.strategies.base import Strategy
from polytrain.strategies.gradient_sync import backend_for
from polytrain.strategies.options import ParallelOptions
from polytrain.strategies.pipeline_runner import PipelineRunner
from polytrain.strategies.registry import register
from polytrain.strategies.router import StepResult, StepRouter
from polytrain.strategies.sharded_eval import padded_eval_step


@register
class ParallelStrategy(Strategy):
    """What differs between layouts is resolved once: the data-parallel backend, the pipeline runner when
    ``pp > 1``, whether the module's tensor-parallel plan applies, and at ``setup_module`` the evaluation
    step, the no-sync context and the clipping by norm."""

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
        if dims.pp > 1 and self.backend.shards:
            check_schedule_with_fsdp(self.layout.pipeline.schedule)
        # The one place deciding whether the model is spread over ranks: parameters are DTensors (FSDP,
        # tensor parallel), and with a pipeline each rank holds some stages only.
        self.dtensor_parameters = self.backend.shards or self.tensor_parallel
        self._gathers = self.dtensor_parameters or dims.pp > 1
        super().__init__(options, dims=dims, checkpoint_io=checkpoint_io, **kwargs)
        self.pipeline: PipelineRunner | None = None
        self._init_rng: torch.Tensor | None = None
        self._eval_step: Callable[..., Any] = super().eval_step
        self._no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._prepare_evaluation: Callable[[], None] = lambda: None
        self._clip_norm: Callable[[torch.optim.Optimizer, float], torch.Tensor | None] | None = None

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
        if layout.pp != 1 and (layout.data_parallel == "fsdp" or layout.dp_shard > 1 or layout.cp > 1):
            check_schedule_with_fsdp(layout.pipeline.schedule)  # the rest is known with the world size

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
        return self.pipeline is None or self.pipeline.is_last_stage

    @property
    def is_logging_rank(self) -> bool:
        """Pipeline: the last stage's first data-parallel replica (tp/cp rank 0): it holds the loss."""
        if self.pipeline is None:
            return self.is_global_zero
        d = self.dims
        return self.pipeline.is_last_stage and d.dp_rank == 0 and d.tp_rank == 0 and d.cp_rank == 0

    @property
    def fsdp_mesh(self) -> Any:
        """1-D (shard) mesh, or 2-D (replicate, shard) for HSDP, as ``fully_shard`` expects."""
        return self.dims.get_mesh("fsdp")

    @property
    def n_microbatches(self) -> int:
        return self.pipeline.n_microbatches

    def check_batch_size(self, batch_size: int, where: str) -> None:
        self.pipeline.check_batch_size(batch_size, where)

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        layout, dims = self.layout, self.dims
        if dims.pp > 1 and schedule_class(layout.pipeline.schedule) is None:
            # Checked here, not in the options: importing torch's pipelining costs a second.
            raise ConfigError(f"pipeline schedule={layout.pipeline.schedule!r} needs torch.distributed.pipelining."
                              f"{SCHEDULES[layout.pipeline.schedule][0]}, which torch {torch.__version__} lacks")
        index = layout.device_index if layout.device_index is not None else self.local_rank
        self._device = resolve_device(self.accelerator, index)
        if self.precision.name == "16-mixed" and (dims.pp > 1 or self.tensor_parallel):
            what = "the pipeline strategy (each stage's GradScaler would skip steps on its own)" if dims.pp > 1 else \
                "tensor parallelism (a GradScaler over sharded gradients)"
            raise ConfigError(f"precision '16-mixed' is not supported by {what}; use precision 'bf16-mixed' or '32'")
        if dims.cp > 1:
            check_context_parallel(dims.cp, self._device.type)
        if self.world_size > 1:
            self.join_process_group()
        if dims.pp > 1:
            self.pipeline = PipelineRunner(self, layout.pipeline, dims, averages_grads=self.backend.name == "all_reduce",
                                           padding=self.backend.padding)

    def forward_backward(self, batch: Any, batch_idx: int, accumulate: int = 1,
                         zero_grad: Callable[[], None] | None = None) -> StepResult:
        """The pipeline's schedule owns forward and backward when there is one."""
        if self.pipeline is not None:
            return self.pipeline.forward_backward(batch, batch_idx, accumulate, zero_grad)
        return super().forward_backward(batch, batch_idx, accumulate, zero_grad)

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
        return self.backend.shards and not self.tensor_parallel and self.dims.pp == self.dims.cp == 1

    @property
    def _state_device(self) -> torch.device:
        return torch.device("cpu") if self.layout.fsdp.cpu_offload else self.root_device

    def setup_module(self, module: nn.Module) -> nn.Module:
        dims, backend = self.dims, self.backend
        plan = tp_fn.module_plan(module) if self.tensor_parallel else None  # read before any rendezvous
        if self.tensor_parallel:
            plan = with_float8_styles(module, plan, tp_fn.resolve_key)
        if self.pipeline is not None:
            self.pipeline.check_module(module)
        self.join_process_group()
        module = self.precision.convert_module(module)
        if self.layout.sync_batchnorm:
            module = convert_sync_batchnorm(module, self.dp_group if backend.shards else None)
        on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
        if backend.broadcasts_weights and self.world_size > 1:
            broadcast_module(module, self.collective_device)  # as DDP: every rank starts from rank 0's weights
        chosen = None
        if self.pipeline is not None:
            # Checkpointed blocks are chosen on the whole model: every rank chooses alike.
            chosen = checkpoint_targets(module, self.checkpointing_options, self.layout.fsdp.wrap_modules)
            roots = self.pipeline.split(module, self.is_global_zero)  # this rank keeps its stages only
            plan = local_plan(module, plan)
        if not on_meta:
            module.to(self._state_device)  # else fully_shard moves what is not on meta
        router = StepRouter(module)
        if self.pipeline is None:
            roots = [router]
        parallelize(module, roots, dims, self.layout, backend.name, plan, self.precision.autocast_dtype,
                    self.root_device.type, self.checkpointing_options, self.compile_options, chosen)
        if on_meta:
            materialize_meta(module, self._state_device, self._init_rng)
        self.module, self.model = module, backend.wrap(router, self.root_device)
        if self.pipeline is not None:
            self.pipeline.build(module, self.root_device)
        self._resolve_step_verbs()
        return self.model

    def _resolve_step_verbs(self) -> None:
        """What evaluation, a no-sync micro-batch and clipping by norm run, fixed once the model is wrapped."""
        backend, pipeline = self.backend, self.pipeline
        if pipeline is not None:
            self._eval_step, self._no_sync = pipeline.eval_step, pipeline.no_sync
        else:
            self._no_sync = functools.partial(backend.no_sync, self.model)
            self._prepare_evaluation = functools.partial(backend.prepare_evaluation, self.model)
            if backend.padding is not None:
                # Through the sharded root (its forward gathers parameters): every rank runs as many
                # evaluation forwards as the others (process_dataloader's EvalBatches).
                self._eval_step = functools.partial(padded_eval_step, self, backend.padding)
            elif self.tensor_parallel:
                self._eval_step = self._routed_eval_step
        if self.tensor_parallel or pipeline is not None:
            self._clip_norm = self._clip_over_stages_and_tp
        elif backend.shards:
            self._clip_norm = backend.clip_norm

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        if self.dtensor_parameters:
            support_fused_sgd(optimizers)  # every parameter is a DTensor
        if self.pipeline is not None:
            self.pipeline.optimizers_checked = False
        return super().setup_optimizers(optimizers)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, loader: DataLoader, stage: str, seed: int, use_sampler: bool | str) -> Any:
        loader = super().process_dataloader(loader, stage, seed, use_sampler)  # split over dp only
        if stage == "train":
            if self.pipeline is not None:
                self.pipeline.check_train_loader(loader)
            return loader
        padding = self.backend.padding
        # FSDP gathers in every forward: data ranks must run as many evaluation batches as each other.
        return loader if padding is None else EvalBatches(loader, padding, self.collective_device)

    # ------------------------------------------------------------------ step
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.pipeline is not None:
            raise ConfigError("manual optimisation (training_step driving the optimizers) is not supported under "
                              "pipeline parallelism: the schedule owns forward and backward; use automatic "
                              "optimisation")
        if self.module.automatic_optimization:
            return super().training_step(batch, batch_idx)
        with self.backend.manual_step(self.model):
            return super().training_step(batch, batch_idx)

    def _bind_training_step(self) -> Callable[[Any, int], Any]:
        step = self.backend.checked_step(super()._bind_training_step(), self.model)
        return step if self.dims.cp <= 1 else context_parallel_training_step(step, self.dims.get_mesh("cp"), self.module)

    def prepare_manual_backward(self, loss: torch.Tensor) -> None:
        self.backend.prepare_manual_backward(self.model, loss)

    def eval_step(self, stage: str, batch: Any, batch_idx: int) -> Any:
        return self._eval_step(stage, batch, batch_idx)

    def prepare_evaluation(self) -> None:
        self._prepare_evaluation()

    def _routed_eval_step(self, stage: str, batch: Any, batch_idx: int) -> Any:
        # Tensor parallel: through the router (no collectives of its own): its hook makes the replicated
        # parameters local views for the whole step, as in training.
        with self.precision.forward_context():
            return self.model(f"{stage}_step", batch, batch_idx)

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return self._no_sync() if enabled else contextlib.nullcontext()

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> torch.Tensor | None:
        if algorithm == "value" or self._clip_norm is None:
            return super().clip_gradients(optimizer, value, algorithm)  # elementwise: shards are fine
        return self._clip_norm(optimizer, value)

    def _clip_over_stages_and_tp(self, optimizer: torch.optim.Optimizer, value: float) -> torch.Tensor:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.pipeline is not None:
            self.pipeline.check_optimizers_line_up(self.optimizers)
        tp_fn.reduce_partial_grads(params)  # idempotent: clipping by hand under manual optimisation
        if self.pipeline is None:
            return tp_fn.clip_grad_norm(params, value)
        return tp_fn.clip_grad_norm(params, value, self.pp_group, self.pipeline.counted_elsewhere)

    @property
    def steps_plainly(self) -> bool:
        return not self.tensor_parallel and self.precision.steps_plainly  # tensor parallel adds to the step (below)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None,
                       after_closure: Callable[[], None] | None) -> Any:
        if self.tensor_parallel:  # Partial gradients (sequence parallel) summed once, before the hooks and clipping
            after_closure = tp_fn.partial_grads_reduced_first(optimizer, after_closure)
        return self.precision.optimizer_step(optimizer, closure, after_closure)

    # ------------------------------------------------------------------ checkpoints and teardown
    @property
    def gathers_state(self) -> bool:
        return self._gathers

    def module_state_dict(self) -> dict[str, Any]:
        """The full model as CPU tensors on rank 0 (others: ``{}``) when spread over ranks (a collective:
        every rank calls it); the module's own state dict when every rank holds all of it."""
        if self.pipeline is not None:
            return gathered_stage_state(self.module, self.is_global_zero)
        return full_model_state(self.module) if self._gathers else self.module.state_dict()

    def teardown(self) -> None:
        super().teardown()
        self.dims.release_mesh()
        gc.collect()  # the groups' C++ objects go now, while the interpreter is whole (see release_mesh)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
