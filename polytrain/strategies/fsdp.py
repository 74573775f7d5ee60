"""``fsdp``: FSDP2 (``fully_shard``). Parameters, gradients and optimizer state are sharded over the
data-parallel ranks; each block's parameters are all-gathered just before its forward/backward and
freed after. ``dp_replicate > 1`` (or several nodes) gives HSDP: shard within a group, replicate
across groups. See docs/strategies/fsdp.md.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from polytrain.checkpoint.sharded import load_sharded, save_sharded
from polytrain.checkpoint.state import full_model_state
from polytrain.core.precision import Precision
from polytrain.core.process_group import default_backend, init_process_group, resolve_device
from polytrain.data.padding import EvalBatches, PaddingState
from polytrain.layers.sync_batchnorm import convert_sync_batchnorm
from polytrain.parallel.compile import checkpoint_and_compile
from polytrain.parallel.dims import ParallelDims
from polytrain.parallel.fsdp import (
    apply_fsdp,
    broadcast_module,
    clip_sharded_grad_norm,
    materialize_meta,
    no_gradient_sync,
)
from polytrain.strategies.base import StepRouter, Strategy
from polytrain.strategies.sharded_eval import padded_eval_step


@dataclass
class FSDPOptions:
    # Class names of the submodules that become FSDP units (one all-gather each). None: every child
    # of the model's largest nn.ModuleList/nn.Sequential (the "blocks"); the rest goes to the root.
    wrap_modules: list[str] | None = None
    reshard_after_forward: bool = True  # False: keep gathered blocks until backward (more memory, less traffic)
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer state live in CPU memory
    dp_replicate: int | None = None  # HSDP replica groups; None: num_nodes (shard inside a node)
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    sync_batchnorm: bool = False


class FSDPStrategy(Strategy):
    name = "fsdp"
    Options = FSDPOptions

    def __init__(self, options: FSDPOptions, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.dims: ParallelDims | None = None
        self._init_rng: torch.Tensor | None = None
        self._padding = PaddingState()

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        return self.dims.dp_mesh.get_local_rank() if self.dims is not None else self.global_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size if self.dims is not None else self.world_size

    @property
    def dp_group(self) -> Any:
        if self.dims is None or self.dims.dp_size == self.world_size:
            return None  # the data-parallel group is the world
        return self.dims.dp_mesh.get_group()

    @property
    def replicated(self) -> bool:
        return False

    @property
    def fsdp_mesh(self) -> Any:
        """1-D (shard) mesh, or 2-D (replicate, shard) for HSDP, as ``fully_shard`` expects."""
        mesh = self.dims.mesh
        return mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 else mesh["dp_shard"]

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        self._device = resolve_device(self.accelerator, self.local_rank)
        replicate = self.options.dp_replicate if self.options.dp_replicate is not None else self.num_nodes
        dims = ParallelDims(self.world_size, dp_replicate=replicate)  # a bad degree fails before any rendezvous
        self.precision = Precision(self.precision_name, self._device.type)
        init_process_group(self.env, self.options.backend or default_backend(self._device), self.timeout)
        dims.build_mesh(self._device.type)
        self.dims = dims

    def model_init_context(self) -> contextlib.AbstractContextManager:
        # Layers built in configure_model land on the meta device (no memory); setup_module then
        # allocates only this rank's shards and initialises them from this RNG state.
        self._init_rng = torch.get_rng_state()
        return torch.device("meta")

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.precision.convert_module(module)
        if self.options.sync_batchnorm:
            module = convert_sync_batchnorm(module, self.dp_group)
        on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
        if not on_meta:
            module.to(self._state_device)  # else fully_shard moves what is not on meta
        broadcast_module(module, self.collective_device)  # as DDP: every rank shards rank 0's weights
        router = StepRouter(module)
        checkpoint_and_compile(module, self.checkpointing_options, self.compile_options, "blocks",
                               self.options.wrap_modules)  # each FSDP unit compiled before fully_shard
        apply_fsdp(module, router, self.fsdp_mesh, self.precision.autocast_dtype, self.options.wrap_modules,
                   self.options.reshard_after_forward, self.options.cpu_offload, self.root_device.type)
        if on_meta:
            materialize_meta(module, self._state_device, self._init_rng)
        self.module, self.model = module, router
        return router

    @property
    def _state_device(self) -> torch.device:
        return torch.device("cpu") if self.options.cpu_offload else self.root_device

    # ------------------------------------------------------------------ data
    def process_dataloader(self, loader: DataLoader, stage: str, seed: int, use_sampler: bool) -> Any:
        loader = super().process_dataloader(loader, stage, seed, use_sampler)
        if stage == "train":
            return loader  # the training sampler pads: every rank already has the same count
        return EvalBatches(loader, self._padding, self.collective_device)

    # ------------------------------------------------------------------ step
    def eval_step(self, stage: str, batch: Any, batch_idx: int) -> Any:
        # Through the sharded root: every block all-gathers its parameters in forward, so every
        # rank must run as many eval forwards as the others (EvalBatches sees to that).
        return padded_eval_step(self, self._padding, stage, batch, batch_idx)

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return no_gradient_sync(self.model) if enabled else contextlib.nullcontext()

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> torch.Tensor | None:
        if algorithm == "value":
            return super().clip_gradients(optimizer, value, algorithm)  # elementwise: shards are fine
        return clip_sharded_grad_norm(optimizer, value)

    # ------------------------------------------------------------------ checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        """The full model on rank 0's CPU (a collective: every rank calls it; others get ``{}``)."""
        return full_model_state(self.module)

    def save_checkpoint(self, payload: dict[str, Any], path: str) -> None:
        save_sharded(self, payload, path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return load_sharded(self, path)
