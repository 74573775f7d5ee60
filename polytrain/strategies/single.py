"""``single``: one process, one device. The default when one process is asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from polytrain.core.precision import Precision
from polytrain.core.process_group import resolve_device
from polytrain.parallel.compile import checkpoint_and_compile
from polytrain.strategies.base import StepRouter, Strategy


@dataclass
class SingleOptions:
    device_index: int = 0  # which GPU when accelerator is cuda


class SingleDeviceStrategy(Strategy):
    name = "single"
    Options = SingleOptions

    def setup_environment(self) -> None:
        self._device = resolve_device(self.accelerator, self.options.device_index)
        self.precision = Precision(self.precision_name, self._device.type)

    def setup_module(self, module: nn.Module) -> nn.Module:
        self.module = self.precision.convert_module(module.to(self.root_device))
        checkpoint_and_compile(self.module, self.checkpointing_options, self.compile_options)
        self.model = StepRouter(self.module)
        return self.model

    def teardown(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.empty_cache()
