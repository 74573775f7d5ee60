"""``ddp``: one process per device, full replicas, gradients all-reduced during backward."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from polytrain.core.errors import ConfigError
from polytrain.core.precision import Precision
from polytrain.core.process_group import default_backend, init_process_group, resolve_device
from polytrain.layers.sync_batchnorm import convert_sync_batchnorm
from polytrain.parallel.compile import checkpoint_and_compile
from polytrain.strategies.base import StepRouter, Strategy


@dataclass
class DDPOptions:
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False


class DDPStrategy(Strategy):
    name = "ddp"
    Options = DDPOptions

    def setup_environment(self) -> None:
        self._device = resolve_device(self.accelerator, self.local_rank)
        self.precision = Precision(self.precision_name, self._device.type)
        init_process_group(self.env, self.options.backend or default_backend(self._device), self.timeout)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.precision.convert_module(module.to(self.root_device))
        if self.options.sync_batchnorm:
            module = convert_sync_batchnorm(module)
        self.module = module
        # Compiled regions run inside DDP's forward: dynamo's DDPOptimizer splits them at bucket boundaries.
        if self.compile_options is not None and self.options.bucket_cap_mb < 1:
            raise ConfigError(f"ddp bucket_cap_mb={self.options.bucket_cap_mb} with trainer.compile: dynamo's DDPOptimizer "
                              f"needs buckets of at least DDP's 1 MB first bucket; use bucket_cap_mb >= 1")
        checkpoint_and_compile(module, self.checkpointing_options, self.compile_options)
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters here, so every replica starts identical.
        kwargs = dict(
            device_ids=device_ids,
            find_unused_parameters=self.options.find_unused_parameters,
            static_graph=self.options.static_graph,
            bucket_cap_mb=self.options.bucket_cap_mb,
            gradient_as_bucket_view=self.options.gradient_as_bucket_view,
        )
        # torch 2.14 renamed broadcast_buffers; older releases only know the old name.
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
            kwargs["forward_sync_buffers"] = self.options.broadcast_buffers
        else:
            kwargs["broadcast_buffers"] = self.options.broadcast_buffers
        self.model = DistributedDataParallel(StepRouter(module), **kwargs)
        return self.model

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return self.model.no_sync() if enabled else contextlib.nullcontext()

    # ------------------------------------------------------------------ manual optimisation
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.module.automatic_optimization:
            return super().training_step(batch, batch_idx)
        # Manual optimisation runs several backward passes (one per manual_backward) after one
        # forward through DDP (a GAN's two losses): DDP must not prepare its reducer in the forward,
        # it is prepared before each backward instead (prepare_manual_backward).
        sync = self.model.require_backward_grad_sync
        self.model.require_backward_grad_sync = False
        try:
            return super().training_step(batch, batch_idx)
        finally:
            self.model.require_backward_grad_sync = sync

    def prepare_manual_backward(self, loss: torch.Tensor) -> None:
        ddp = self.model
        if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
            return  # inside no_backward_sync (accumulating): gradients stay local
        # With find_unused_parameters the reducer walks the graph from this loss to the parameters it
        # uses; the others are marked ready at once, so this backward's all-reduce completes.
        used = list(_find_tensors(loss)) if ddp.find_unused_parameters and not ddp.static_graph else []
        ddp.reducer.prepare_for_backward(used)
