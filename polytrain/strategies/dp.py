"""``dp``: ``nn.DataParallel`` — one process drives several GPUs, batch split along dim 0.

Kept for users coming from it; DDP is faster (no GIL contention, no per-step replication). One
process, several devices: not a degree of the device mesh, so its own small class, not a preset of
``parallel``.
On CPU there is only one device, so it falls back to plain single-device training and says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polytrain.core.errors import ConfigError
from polytrain.core.process_group import resolve_device
from polytrain.parallel.compile import checkpoint_and_compile
from polytrain.strategies.base import Strategy
from polytrain.strategies.options import DataParallelOptions
from polytrain.strategies.registry import register
from polytrain.strategies.router import StepRouter


def _mean_replica_losses(output: Any) -> Any:
    # DataParallel gathers one scalar loss per replica into a vector; the step's loss is their mean.
    if isinstance(output, torch.Tensor) and output.ndim == 1:
        return output.mean()
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor) and output["loss"].ndim == 1:
        return {**output, "loss": output["loss"].mean()}
    return output


@register
class DataParallelStrategy(Strategy):
    name = "dp"
    Options = DataParallelOptions

    @classmethod
    def processes_per_node(cls, devices: int, options: Any = None) -> int:
        return 1  # one process drives all devices

    def setup_environment(self) -> None:
        self._device = resolve_device(self.accelerator, 0)
        self._device_ids: list[int] = []
        if self._device.type == "cuda":
            available = torch.cuda.device_count()
            if self.devices > available:
                raise RuntimeError(f"strategy 'dp' asked for {self.devices} GPUs but {available} are visible")
            self._device_ids = list(range(self.devices))
        else:
            warnings.warn("strategy 'dp' on CPU: DataParallel has one device here, so this runs as "
                          "single-device training. Use strategy 'ddp' for several CPU processes.",
                          stacklevel=2)

    def setup_module(self, module: nn.Module) -> nn.Module:
        self.module = self.precision.convert_module(module.to(self.root_device))
        wraps_blocks = (self.compile_options, self.activation_checkpointing_options) != (None, None)
        if len(self._device_ids) > 1 and wraps_blocks:
            raise ConfigError("strategy 'dp' copies the module to every GPU each step, which drops "
                              "compiled and checkpointed forwards; use strategy 'ddp' with trainer.compile / "
                              "trainer.activation_checkpointing")
        checkpoint_and_compile(self.module, self.activation_checkpointing_options, self.compile_options)
        router = StepRouter(self.module)
        if len(self._device_ids) > 1:
            self.model = nn.DataParallel(router, device_ids=self._device_ids,
                                         output_device=self.options.output_device)
        else:
            self.model = router
        return self.model

    def training_step_function(self) -> Callable[[Any, int], Any]:
        model, context = self.model, self.precision.forward_context

        def replicated_step(batch: Any, batch_idx: int) -> Any:
            with context():
                return _mean_replica_losses(model("training_step", batch, batch_idx))

        return replicated_step
