"""``fsdp``: FSDP2 (``fully_shard``). Parameters, gradients and optimizer state are sharded over the
data-parallel ranks; each block's parameters are all-gathered just before its forward/backward and
freed after. ``dp_replicate > 1`` (or several nodes) gives HSDP: shard within a group, replicate
across groups. See docs/strategies/fsdp.md.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from polytrain.strategies import collectives as C
from polytrain.strategies.base import PADDING_BATCH, StepRouter, Strategy
from polytrain.strategies.mesh import ParallelDims
from polytrain.strategies.process_group import default_backend, init_process_group, resolve_device
from polytrain.trainer.config import ConfigError
from polytrain.trainer.precision import Precision


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


class _PadState:
    """Set while the evaluation loader hands out a padding batch (see ``EvalBatches``)."""

    active = False


class FSDPStrategy(Strategy):
    name = "fsdp"
    Options = FSDPOptions

    def __init__(self, options: FSDPOptions, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.dims: ParallelDims | None = None
        self._init_rng: torch.Tensor | None = None
        self._padding = _PadState()

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
            from polytrain.strategies.sync_batchnorm import convert_sync_batchnorm

            module = convert_sync_batchnorm(module, self.dp_group)
        on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
        if not on_meta:
            module.to(self._state_device)  # else fully_shard moves what is not on meta
        broadcast_module(module, self.collective_device)  # as DDP: every rank shards rank 0's weights
        router = StepRouter(module)
        self._shard(module, router)
        if on_meta:
            materialize_meta(module, self._state_device, self._init_rng)
        self.module, self.model = module, router
        return router

    @property
    def _state_device(self) -> torch.device:
        return torch.device("cpu") if self.options.cpu_offload else self.root_device

    def _shard(self, module: nn.Module, router: StepRouter) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.options.cpu_offload \
            else OffloadPolicy()
        common = dict(mesh=self.fsdp_mesh, mp_policy=self._mp_policy(), offload_policy=offload)
        for block in blocks_to_wrap(module, self.options.wrap_modules):
            fully_shard(block, reshard_after_forward=self.options.reshard_after_forward, **common)
        # The root (the router, owning whatever no block took) stays gathered after forward by
        # default: backward needs it first. Its forward is the user's training/eval step.
        fully_shard(router, reshard_after_forward=None if self.options.reshard_after_forward else False, **common)

    def _mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision_name)
        if dtype is None:
            return MixedPrecisionPolicy()
        # Gather parameters in the low dtype (half the traffic) and reduce gradients in fp32. Inputs
        # are not cast: autocast (Precision.forward_context) picks each op's dtype, as on one device.
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)

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
        return _no_gradient_sync(self.model) if enabled else contextlib.nullcontext()

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> torch.Tensor | None:
        if algorithm == "value":
            return super().clip_gradients(optimizer, value, algorithm)  # elementwise: shards are fine
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # each rank holds a partial norm of its shards: reduce to the global one
        torch.nn.utils.clip_grads_with_norm_(params, value, norm)
        return norm

    # ------------------------------------------------------------------ checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        """The full model on rank 0's CPU (a collective: every rank calls it; others get ``{}``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_checkpoint(self, payload: dict[str, Any], path: str) -> None:
        from polytrain.strategies.sharded_io import save_sharded

        save_sharded(self, payload, path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        from polytrain.strategies.sharded_io import load_sharded

        return load_sharded(self, path)


# --------------------------------------------------------------------------- wrapping


def blocks_to_wrap(module: nn.Module, names: list[str] | None) -> list[nn.Module]:
    """The submodules to ``fully_shard`` before the root, innermost first (FSDP goes bottom-up)."""
    if names is not None:
        present = {type(m).__name__ for m in module.modules()}
        unknown = sorted(set(names) - present)
        if unknown:
            raise ConfigError(f"fsdp wrap_modules names {unknown}, but {type(module).__name__} has no submodule of "
                              f"that class; classes present: {', '.join(sorted(present))}")
        chosen = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        return list(reversed(chosen))  # pre-order reversed: every module after its descendants
    containers = [m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    if not containers:
        return []
    largest = max(containers, key=lambda m: sum(p.numel() for p in m.parameters()))
    return [child for child in largest.children() if next(child.parameters(), None) is not None]


def broadcast_module(module: nn.Module, device: torch.device) -> None:
    """Rank 0's values of everything already materialised (meta tensors are initialised later,
    identically on every rank, from the same RNG state). Via ``device``: NCCL cannot send CPU
    tensors (an offloaded model lives on CPU)."""
    if not C.active():
        return
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if not tensor.is_meta:
                staged = tensor.data.to(device)
                C.broadcast(staged, 0)
                if staged is not tensor.data:
                    tensor.data.copy_(staged)


# --------------------------------------------------------------------------- meta-device init


def _direct_tensors(module: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    return [(reg, name, t) for reg in (module._parameters, module._buffers) for name, t in reg.items()
            if t is not None]


def materialize_meta(module: nn.Module, device: torch.device, rng_state: torch.Tensor | None) -> None:
    """Allocate the shards of every meta tensor and initialise them as a CPU build would have.

    Modules are visited in registration order, the RNG restarts from the state at
    ``configure_model``, and each module's ``reset_parameters()`` runs on full-size CPU tensors
    (one module at a time); this rank keeps its shard. Standard layers draw the same numbers in
    ``reset_parameters`` as in their constructor, so the weights equal a CPU build with the seed.
    """
    targets = [m for m in module.modules() if any(t.is_meta for _, _, t in _direct_tensors(m))]
    for m in targets:
        if not callable(getattr(m, "reset_parameters", None)):
            names = [n for _, n, t in _direct_tensors(m) if t.is_meta]
            raise ConfigError(f"{type(m).__name__} holds {names} built on the meta device (configure_model under fsdp) "
                              f"but has no reset_parameters() to initialise them; define reset_parameters() on it "
                              f"or create those tensors in __init__")
    with torch.random.fork_rng(devices=[]):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        for m in targets:
            m.to_empty(device=device, recurse=False)
            _reset_full(m)


@torch.no_grad()
def _reset_full(module: nn.Module) -> None:
    live = _direct_tensors(module)
    for reg, name, t in live:
        full = torch.empty(t.shape, dtype=t.dtype)  # t.shape is the global shape for a DTensor
        reg[name] = nn.Parameter(full, requires_grad=t.requires_grad) if reg is module._parameters else full
    try:
        module.reset_parameters()
        for reg, name, t in live:
            _copy_shard(t, reg[name])
    finally:
        for reg, name, t in live:
            reg[name] = t


def _copy_shard(live: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(live, DTensor):
        live.copy_(full)
        return
    mesh = live.device_mesh
    whole = DTensor.from_local(full.to(live.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
    live.to_local().copy_(whole.redistribute(mesh, live.placements).to_local())  # a local slice: no traffic


# --------------------------------------------------------------------------- steps and evaluation


@contextlib.contextmanager
def _no_gradient_sync(root: Any) -> Iterator[None]:
    # Gradients accumulate unsharded; the last micro-batch's backward reduce-scatters the sum.
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def padded_eval_step(strategy: Strategy, padding: Any, stage: str, batch: Any, batch_idx: int) -> Any:
    """An evaluation step through the sharded root (its forward gathers parameters, so every rank
    must run it); on a padding batch the step still runs, its logs are dropped and the loops are
    told with ``PADDING_BATCH``."""
    with strategy.precision.forward_context():
        if not padding.active:
            return strategy.model(f"{stage}_step", batch, batch_idx)
        with discarded_logs(strategy.module):
            strategy.model(f"{stage}_step", batch, batch_idx)
        return PADDING_BATCH


@contextlib.contextmanager
def discarded_logs(module: nn.Module) -> Iterator[None]:
    """``self.log`` calls inside go to a scratch collector: a padding batch never counts in a metric."""
    trainer = module.__dict__.get("_trainer")
    if trainer is None:
        yield
        return
    from polytrain.trainer.metrics import MetricCollector

    real = trainer.metrics
    scratch = MetricCollector()
    scratch.device, scratch.stage, scratch.batch_size = real.device, real.stage, real.batch_size
    trainer.metrics = scratch
    try:
        yield
    finally:
        trainer.metrics = real


_END = object()


class EvalBatches:
    """An evaluation loader on which every rank yields the same number of batches.

    Ranks' shares differ by up to one batch (no padded samples: metrics must equal one process's),
    but under FSDP every forward all-gathers, so a rank that stopped early would leave the others
    waiting. Before each batch the ranks agree whether any still has data; one that ran out
    re-runs its last batch flagged as padding: ``eval_step`` discards its logs and returns None
    (``predict`` lists end with that None on such ranks; callbacks there see the repeated batch).
    """

    def __init__(self, loader: Any, state: _PadState, device: torch.device) -> None:
        self.loader = loader
        self.state = state
        self.device = device

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        from polytrain.trainer.data import EvenlySplitSampler

        sampler, size = getattr(self.loader, "sampler", None), getattr(self.loader, "batch_size", None)
        if isinstance(sampler, EvenlySplitSampler) and size:
            most = len(range(0, sampler.dataset_len, sampler.num_replicas))  # rank 0's share is the largest
            return most // size if self.loader.drop_last else -(-most // size)
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        iterator, last = iter(self.loader), _END
        try:
            while True:
                batch = next(iterator, _END)
                if not C.any_rank(batch is not _END, self.device):
                    return
                if batch is not _END:
                    last = batch
                elif last is _END:
                    last = self._borrowed_batch()
                self.state.active = batch is _END
                yield last
        finally:
            self.state.active = False

    def _borrowed_batch(self) -> Any:
        """A rank with no share at all (fewer samples than ranks) pads with the dataset's first batch."""
        dataset = getattr(self.loader, "dataset", None)
        if dataset is None or not len(dataset):
            raise RuntimeError("this rank has no evaluation batches and its loader has no dataset to borrow a "
                               "padding batch from; give every rank at least one batch")
        return next(iter(DataLoader(dataset, batch_size=getattr(self.loader, "batch_size", None) or 1,
                                    collate_fn=getattr(self.loader, "collate_fn", None))))
