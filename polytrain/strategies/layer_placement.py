"""``model_parallel`` with ``mode: layers``: one process drives ``devices_per_process`` devices and the
layers of the module's ``nn.Sequential`` are spread over them (balanced by parameter count, at
``split_points``, or by the module's own ``place_layers(devices)``). ``split_size`` cuts each batch
into micro-batches so the devices overlap. With several processes, DDP (``device_ids=None``, a
multi-device module) averages gradients across them: ``devices`` per node = processes x
``devices_per_process``.

Not a degree of the device mesh (the split lives inside one process), so not a preset of
``parallel``: ``model_parallel``'s class hands ``mode: layers`` to this one (see model_parallel.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from polytrain.core.errors import ConfigError
from polytrain.core.process_group import default_backend, init_process_group
from polytrain.layers.placement import PlacedSequential, stage_bounds
from polytrain.parallel.compile import checkpoint_and_compile
from polytrain.parallel.pipeline_sequential_cut import balance, child_costs
from polytrain.strategies.base import Strategy
from polytrain.strategies.router import StepRouter

log = logging.getLogger("polytrain")


def find_sequential(module: nn.Module, name: str | None) -> tuple[str, nn.Sequential]:
    """The ``nn.Sequential`` attribute to place: ``name``, or the module's only Sequential child."""
    if name is not None:
        child = getattr(module, name, None)
        if not isinstance(child, nn.Sequential):
            raise ConfigError(f"model_parallel sequential={name!r} names {type(child).__name__} on "
                              f"{type(module).__name__}, not an nn.Sequential; name the Sequential to place")
        return name, child
    found = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Sequential)]
    if len(found) != 1:
        raise ConfigError(
            f"{type(module).__name__} has {len(found)} nn.Sequential children "
            f"({', '.join(n for n, _ in found) or 'none'}); model_parallel layers mode places exactly one: "
            f"set strategy option sequential=<attribute>, or define place_layers(self, devices) to place "
            f"layers yourself"
        )
    return found[0]


def _check_placed(module: nn.Module, devices: list[torch.device]) -> None:
    """After a user's ``place_layers``: every parameter and buffer sits on one of the process's devices."""
    allowed = {(d.type, d.index if d.index is not None else 0) for d in devices}
    stray = [f"{n} on {t.device}" for n, t in [*module.named_parameters(), *module.named_buffers()]
             if (t.device.type, t.device.index if t.device.index is not None else 0) not in allowed]
    if stray:
        raise ConfigError(f"{type(module).__name__}.place_layers(devices) left {len(stray)} tensor(s) off "
                          f"this process's devices {[str(d) for d in devices]}: {', '.join(stray[:5])}; "
                          f"move every layer to one of the devices it was given")


class LayerPlacementStrategy(Strategy):
    name = "model_parallel"  # reached through model_parallel (mode: layers); not registered by itself

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        self._devices = self._process_devices()
        self._device = self._devices[0]
        if self.world_size > 1:
            init_process_group(self.env, self.options.backend or default_backend(self._device), self.timeout)

    def _process_devices(self) -> list[torch.device]:
        per = self.options.devices_per_process
        if self.accelerator not in ("cuda", "gpu"):
            return [torch.device("cpu")] * per  # one device type: the placement code path still runs
        first, count = self.local_rank * per, torch.cuda.device_count()
        if first + per > count:
            raise RuntimeError(
                f"local rank {self.local_rank} with devices_per_process={per} needs cuda:{first}..cuda:"
                f"{first + per - 1} but {count} GPU(s) are visible; use at most {count // per} "
                f"process(es) per node (trainer.devices={count // per * per}) or lower devices_per_process"
            )
        torch.cuda.set_device(first)
        return [torch.device("cuda", first + i) for i in range(per)]

    def setup_module(self, module: nn.Module) -> nn.Module:
        o, devices = self.options, self._devices
        if callable(getattr(module, "place_layers", None)):
            if o.split_points is not None or o.split_size is not None:
                raise ConfigError(f"{type(module).__name__} defines place_layers(), so polytrain does not "
                                  f"cut its layers: drop split_points/split_size, or build a "
                                  f"polytrain.layers.PlacedSequential(seq, devices, split_points, "
                                  f"split_size) inside place_layers")
            module.place_layers(list(devices))
            _check_placed(module, devices)
        else:
            name, seq = find_sequential(module, o.sequential)
            if o.split_points is None:
                stage_bounds(list(range(1, len(devices))), len(seq), len(devices))  # enough children?
            points = o.split_points if o.split_points is not None else balance(child_costs(seq), len(devices))
            placed = PlacedSequential(seq, devices, points, o.split_size)  # moves each child to its device
            # Everything outside the Sequential goes to the first device, without the whole model ever
            # visiting one device (it may not fit there: that is why it is split).
            setattr(module, name, nn.Identity())
            module.to(devices[0])
            setattr(module, name, placed)
            log.info("model_parallel layers: %s.%s placed as %s", type(module).__name__, name,
                     placed.extra_repr())
        module = self.precision.convert_module(module)
        checkpoint_and_compile(module, self.activation_checkpointing_options, self.compile_options, "blocks")
        router = StepRouter(module)
        if self.world_size > 1:
            # A module spanning several devices: DDP must get device_ids=None.
            self.model = DistributedDataParallel(router, device_ids=None,
                                                 find_unused_parameters=o.find_unused_parameters)
        else:
            self.model = router
        self.module = module
        return self.model

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def teardown(self) -> None:
        super().teardown()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def __repr__(self) -> str:
        return f"LayerPlacementStrategy(devices_per_process={self.options.devices_per_process})"


def processes_for(devices: int, per: int) -> int:
    if devices % per:
        raise ConfigError(f"trainer.devices={devices} is not a multiple of model_parallel "
                          f"devices_per_process={per}; each process drives {per} devices, so use "
                          f"devices={per * max(1, devices // per)}")
    return devices // per
