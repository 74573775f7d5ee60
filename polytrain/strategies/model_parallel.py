"""``model_parallel``: a model too big for one device, split two ways.

``mode: layers`` — one process drives ``devices_per_process`` devices and the layers of the
module's ``nn.Sequential`` are spread over them (balanced by parameter count, at ``split_points``,
or by the module's own ``place_layers(devices)``). ``split_size`` cuts each batch into micro-batches
so the devices overlap. With several processes, DDP (``device_ids=None``, a multi-device module)
averages gradients across them: ``devices`` per node = processes x ``devices_per_process``.

``mode: tensor`` — every process holds a slice of each large layer (Megatron-style tensor
parallelism over the ``tp`` dimension of a ``DeviceMesh``), following the module's plan:
``tensor_parallel_plan(self) -> {submodule name: ColwiseParallel(), ...}`` or
``parallelize(self, tp_mesh)``. With ``dp_shard > 1`` the result is also sharded with FSDP2 over
the data-parallel dimension (2D). Data follows the mesh: ranks of one tensor-parallel group see
the same batch; the sampler splits over the data-parallel dimension only.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from polytrain.checkpoint.sharded import load_sharded, save_sharded
from polytrain.checkpoint.state import full_model_state
from polytrain.core.errors import ConfigError
from polytrain.core.precision import Precision
from polytrain.core.process_group import default_backend, init_process_group, resolve_device
from polytrain.data.padding import EvalBatches, PaddingState
from polytrain.layers.placement import PlacedSequential, stage_bounds
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.parallel.compile import checkpoint_and_compile
from polytrain.parallel.dims import ParallelDims
from polytrain.parallel.fsdp import no_gradient_sync
from polytrain.parallel.pipeline_split import balance, child_costs
from polytrain.strategies.base import StepRouter, Strategy
from polytrain.strategies.sharded_eval import padded_eval_step

log = logging.getLogger("polytrain")

MODES = ("layers", "tensor")


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
            raise ConfigError(f"model_parallel mode={self.mode!r} is not valid; choose one of: {', '.join(MODES)}")
        if self.mode == "layers":
            if self.devices_per_process < 1:
                raise ConfigError(f"model_parallel devices_per_process={self.devices_per_process} must be >= 1")
            if self.tp is not None or self.dp_shard != -1 or self.dp_replicate != 1:
                raise ConfigError(f"model_parallel options tp={self.tp}, dp_shard={self.dp_shard}, dp_replicate="
                                  f"{self.dp_replicate} apply to mode: tensor; set mode: tensor or drop them")
        elif self.split_size is not None or self.split_points is not None or self.sequential is not None:
            raise ConfigError(f"model_parallel options split_size={self.split_size}, split_points="
                              f"{self.split_points}, sequential={self.sequential!r} apply to mode: layers; "
                              f"set mode: layers or drop them")


def _option(options: Any, name: str) -> Any:
    if isinstance(options, dict):
        return options.get(name, getattr(ModelParallelOptions, name))
    return getattr(options, name, getattr(ModelParallelOptions, name))


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
            f"{type(module).__name__} has {len(found)} nn.Sequential children ({', '.join(n for n, _ in found) or 'none'}); "
            f"model_parallel layers mode places exactly one: set strategy option sequential=<attribute>, or define "
            f"place_layers(self, devices) to place layers yourself"
        )
    return found[0]


def _check_placed(module: nn.Module, devices: list[torch.device]) -> None:
    """After a user's ``place_layers``: every parameter and buffer sits on one of the process's devices."""
    allowed = {(d.type, d.index if d.index is not None else 0) for d in devices}
    stray = [f"{n} on {t.device}" for n, t in [*module.named_parameters(), *module.named_buffers()]
             if (t.device.type, t.device.index if t.device.index is not None else 0) not in allowed]
    if stray:
        raise ConfigError(f"{type(module).__name__}.place_layers(devices) left {len(stray)} tensor(s) off this "
                          f"process's devices {[str(d) for d in devices]}: {', '.join(stray[:5])}; move every "
                          f"layer to one of the devices it was given")


class ModelParallelStrategy(Strategy):
    name = "model_parallel"
    Options = ModelParallelOptions

    @classmethod
    def processes_per_node(cls, devices: int, options: Any = None) -> int:
        if _option(options, "mode") != "layers":
            return devices
        per = _option(options, "devices_per_process")
        if devices % per:
            raise ConfigError(f"trainer.devices={devices} is not a multiple of model_parallel devices_per_process="
                              f"{per}; each process drives {per} devices, so use devices={per * max(1, devices // per)}")
        return devices // per

    def __init__(self, options: ModelParallelOptions, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self._padding = PaddingState()

    @property
    def layers(self) -> bool:
        return self.options.mode == "layers"

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        if self.layers:
            return self.global_rank
        return (self.global_rank // self.dims.tp) % self.dims.dp_size

    @property
    def dp_size(self) -> int:
        return self.world_size if self.layers else self.dims.dp_size

    @property
    def dp_group(self) -> Any:
        if self.layers:
            return None
        if not hasattr(self.dims, "dp_mesh"):
            raise RuntimeError("model_parallel dp_group was asked for before setup_module built the mesh")
        return self.dims.dp_mesh.get_group()

    @property
    def replicated(self) -> bool:
        return self.layers

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        if self.layers:
            self._devices = self._process_devices()
            self._device = self._devices[0]
        else:
            self.dims = self._parallel_dims()  # degrees are checked before anything else happens
            self._device = resolve_device(self.accelerator, self.local_rank)
            if self.precision_name == "16-mixed":
                raise ConfigError("model_parallel mode 'tensor' does not support precision '16-mixed' (a GradScaler "
                                  "over sharded gradients); use precision 'bf16-mixed' or '32'")
        self.precision = Precision(self.precision_name, self._device.type)
        if self.layers and self.world_size > 1:
            self._init_process_group()

    def _init_process_group(self) -> None:
        init_process_group(self.env, self.options.backend or default_backend(self._device), self.timeout)

    def _process_devices(self) -> list[torch.device]:
        per = self.options.devices_per_process
        if self.accelerator not in ("cuda", "gpu"):
            return [torch.device("cpu")] * per  # one device type: the placement code path still runs
        first, count = self.local_rank * per, torch.cuda.device_count()
        if first + per > count:
            raise RuntimeError(
                f"local rank {self.local_rank} with devices_per_process={per} needs cuda:{first}..cuda:"
                f"{first + per - 1} but {count} GPU(s) are visible; use at most {count // per} process(es) per "
                f"node (trainer.devices={count // per * per}) or lower devices_per_process"
            )
        torch.cuda.set_device(first)
        return [torch.device("cuda", first + i) for i in range(per)]

    def _parallel_dims(self) -> ParallelDims:
        o, world = self.options, self.world_size
        tp = o.tp
        if tp is None:
            rest = o.dp_replicate * max(o.dp_shard, 1)
            if world % rest:
                raise ConfigError(f"cannot infer tp: world_size={world} is not divisible by dp_replicate="
                                  f"{o.dp_replicate} x dp_shard={o.dp_shard} = {rest}")
            tp = world // rest
        return ParallelDims(world_size=world, dp_replicate=o.dp_replicate, dp_shard=o.dp_shard, tp=tp)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self._place_layers(module) if self.layers else self._shard_tensors(module)
        self.module = module
        return self.model

    def _place_layers(self, module: nn.Module) -> nn.Module:
        o, devices = self.options, self._devices
        if callable(getattr(module, "place_layers", None)):
            if o.split_points is not None or o.split_size is not None:
                raise ConfigError(f"{type(module).__name__} defines place_layers(), so polytrain does not cut its "
                                  f"layers: drop split_points/split_size, or build a polytrain.layers."
                                  f"PlacedSequential(seq, devices, split_points, split_size) inside place_layers")
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
            log.info("model_parallel layers: %s.%s placed as %s", type(module).__name__, name, placed.extra_repr())
        module = self.precision.convert_module(module)
        checkpoint_and_compile(module, self.checkpointing_options, self.compile_options, "blocks")
        router = StepRouter(module)
        if self.world_size > 1:
            # A module spanning several devices: DDP must get device_ids=None.
            self.model = DistributedDataParallel(router, device_ids=None,
                                                 find_unused_parameters=o.find_unused_parameters)
        else:
            self.model = router
        return module

    def _shard_tensors(self, module: nn.Module) -> nn.Module:
        plan = tp_fn.module_plan(module)  # reads the module only: a bad plan fails before any rendezvous
        self._init_process_group()
        mesh = self.dims.build_mesh(self._device.type)
        module = self.precision.convert_module(module.to(self._device))
        tp_fn.apply_tensor_parallel(module, mesh["tp"], plan)
        checkpoint_and_compile(module, self.checkpointing_options, self.compile_options, "blocks")  # TP, AC, compile, FSDP
        self.model = StepRouter(module)
        if self.dims.dp_size > 1:
            dp_mesh = mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 else mesh["dp_shard"]
            tp_fn.shard_data_parallel(module, self.model, dp_mesh)
        return module

    # ------------------------------------------------------------------ data and steps
    @property
    def _forward_has_dp_collectives(self) -> bool:
        return not self.layers and self.dims.dp_size > 1

    def process_dataloader(self, loader: DataLoader, stage: str, seed: int, use_sampler: bool) -> Any:
        loader = super().process_dataloader(loader, stage, seed, use_sampler)  # split over dp only
        if stage == "train" or not self._forward_has_dp_collectives:
            return loader
        # FSDP gathers parameters over the data-parallel group in every forward, so data-parallel ranks
        # must run as many evaluation batches as each other: one that runs out repeats its last batch as
        # padding (logs discarded). Tensor-parallel peers share a data rank, so they pad alike.
        return EvalBatches(loader, self._padding, self.collective_device)

    def eval_step(self, stage: str, batch: Any, batch_idx: int) -> Any:
        if not self._forward_has_dp_collectives:
            return super().eval_step(stage, batch, batch_idx)
        # Through the FSDP root, which gathers the parameters it owns; safe because every rank runs the
        # same number of evaluation batches (see process_dataloader).
        return padded_eval_step(self, self._padding, stage, batch, batch_idx)

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        if self._forward_has_dp_collectives:
            return no_gradient_sync(self.model)
        return contextlib.nullcontext()

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> torch.Tensor | None:
        if self.layers or algorithm == "value":
            return super().clip_gradients(optimizer, value, algorithm)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return tp_fn.clip_grad_norm(params, value)

    # ------------------------------------------------------------------ checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        """Layers: the module's own state dict. Tensor: the full model gathered to CPU on rank 0
        (a collective: every rank must call it; ranks other than 0 get an empty dict)."""
        if self.layers:
            return self.module.state_dict()
        return full_model_state(self.module)

    def save_checkpoint(self, payload: dict[str, Any], path: str) -> None:
        if self.layers:
            return super().save_checkpoint(payload, path)
        save_sharded(self, payload, path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        if self.layers:
            return super().load_checkpoint(path)
        return load_sharded(self, path)

    def teardown(self) -> None:
        super().teardown()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
