"""FSDP2 as plain functions: which blocks become FSDP units, rank 0's weights to every rank before
sharding, meta-device initialisation that equals a CPU build, and gradient-sync control for
accumulation. Used by the fsdp strategy and by tensor parallel's data-parallel dimension (2D).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import ConfigError, first_few
from polytrain.core.rank_zero import rank_zero_info

# --------------------------------------------------------------------------- wrapping


def apply_fsdp(module: nn.Module, root: nn.Module | list[nn.Module], mesh: Any,
               autocast_dtype: torch.dtype | None,
               wrap_modules: list[str] | None = None, reshard_after_forward: bool = True,
               cpu_offload: bool = False, compute_device_type: str = "cpu",
               own_meshes: list[tuple[nn.Module, Any, int]] | None = None) -> None:
    """``fully_shard`` each block of ``module`` (``blocks_to_wrap``), then ``root`` (the module the
    step runs through, owning whatever no block took; several roots: a pipeline rank's stages, each
    over the blocks it holds). ``mesh`` is 1-D (shard) or 2-D (replicate,
    shard: HSDP). ``cpu_offload`` keeps shards in CPU memory (pinned when computing on CUDA). Under mixed
    precision parameters are gathered in the autocast dtype (half the traffic) and gradients reduced in
    fp32; inputs are not cast: autocast picks each op's dtype, as on one device. ``own_meshes``: units
    sharded first over a mesh of their own, as ``(module, mesh, gradient divisor)`` (the experts of expert
    parallel: each sums its expert group's gradients already, so the divisor is the data-parallel size)."""
    fsdp = lazy.fsdp()
    offload = (fsdp.CPUOffloadPolicy(pin_memory=compute_device_type == "cuda") if cpu_offload
               else fsdp.OffloadPolicy())
    mp_policy = fsdp.MixedPrecisionPolicy() if autocast_dtype is None else fsdp.MixedPrecisionPolicy(
        param_dtype=autocast_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    names = {id(m): n for n, m in module.named_modules()}
    views = _ViewOutputs()
    for unit, unit_mesh, divisor in own_meshes or []:
        fsdp.fully_shard(unit, mesh=unit_mesh, mp_policy=mp_policy, offload_policy=offload,
                         reshard_after_forward=reshard_after_forward)
        unit.set_gradient_divide_factor(float(divisor))
        if unit_mesh.size() > 1:
            # A divisor is otherwise applied in the reduction (NCCL's PreMulSum), which gloo has not.
            unit.set_force_sum_reduction_for_comms(True)
    for block in blocks_to_wrap(module, wrap_modules):
        fsdp.fully_shard(block, reshard_after_forward=reshard_after_forward, **common)
        views.watch(block, names.get(id(block), type(block).__name__))
    # The root stays gathered after forward by default: backward needs it first.
    for each in root if isinstance(root, list) else [root]:
        fsdp.fully_shard(each, reshard_after_forward=None if reshard_after_forward else False, **common)
        views.watch(each, names.get(id(each)) or type(each).__name__)
    # torch (2.14 on) warns, from every rank, for each unit that returns a view: _ViewOutputs says it once
    warnings.filterwarnings("ignore", message=_TORCH_VIEW_WARNING, category=UserWarning)


_TORCH_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


class _ViewOutputs:
    """Says once, on rank 0, which units returned a view in the first training step, and when that matters.

    FSDP runs a unit's all-gather for backward from a hook on the unit's output; an in-place op on an output
    that is a view (``logits += bias``) replaces the tensor's autograd node and the hook with it, so the
    backward runs without the gathered weights. A Linear with a bias on 3-D input returns such a view
    (``addmm`` then ``view``), and nothing computed from it out of place (a loss) is affected. Whether the
    user's code modifies it in place is not visible here: the line says what to avoid. The units are
    gathered during the first training forward and said when its backward starts. Each unit's hook goes
    after that unit's first training forward: later steps pay nothing."""

    def __init__(self) -> None:
        self.units: list[str] = []
        self.handles: dict[str, Any] = {}
        self.said = False

    def watch(self, unit: nn.Module, name: str) -> None:
        label = f"{name} ({type(unit).__name__.removeprefix('FSDP')})"
        self.handles[label] = unit.register_forward_hook(functools.partial(self._forward, label))

    def _forward(self, label: str, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation pass: no backward, no hook on the output
        handle = self.handles.pop(label, None)
        if handle is None:
            return  # a unit called twice in its first step: seen already
        handle.remove()
        views = [t for t in tree_leaves(output)
                 if isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None]
        if views:
            self.units.append(label)
            views[0].register_hook(self._say)

    def _say(self, grad: torch.Tensor) -> None:
        if self.said:
            return
        self.said = True
        rank_zero_info(f"fsdp: {len(self.units)} unit(s) return a view: {first_few(self.units, 5)}; "
                       f"computing from it out of place (a loss, `out = out + y`) is what FSDP supports: an "
                       f"in-place op on it (`out += y`) would skip the unit's all-gather in backward "
                       f"(torch's warning of this is left out)")


def blocks_to_wrap(module: nn.Module, names: list[str] | None) -> list[nn.Module]:
    """The submodules to ``fully_shard`` before the root, innermost first (FSDP goes bottom-up)."""
    if names is not None:
        present = {type(m).__name__ for m in module.modules()}
        unknown = sorted(set(names) - present)
        if unknown:
            raise ConfigError(f"fsdp wrap_modules names {unknown}, but {type(module).__name__} has no "
                              f"submodule of that class; classes present: {', '.join(sorted(present))}")
        chosen = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        return list(reversed(chosen))  # pre-order reversed: every module after its descendants
    containers = [m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    if not containers:
        return []
    largest = max(containers, key=lambda m: sum(p.numel() for p in m.parameters()))
    with_blocks = {id(largest)} | {id(c) for c in _repeating(largest, containers)}
    chosen = [c for c in containers if id(c) in with_blocks]  # in model order
    holders = _holders(module)
    return [child for container in chosen for child in container.children()
            if next(child.parameters(), None) is not None and not _shares_outside(child, holders)]


def _repeating(largest: nn.Module, containers: list[nn.Module]) -> list[nn.Module]:
    """The other containers of the largest one's block, when it holds one class repeated: ResNet's
    ``layer1``..``layer3`` beside ``layer4`` (all Bottlenecks). Without them a third of ResNet-50
    stays in the root's unit, gathered whole for the entire step."""
    def block_classes(container: nn.Module) -> set[type]:
        return {type(c) for c in container.children() if next(c.parameters(), None) is not None}

    repeated = block_classes(largest)
    if len(repeated) != 1:
        return []  # a stack of different layers (Linear, Conv, ...) is not a repetition of a block
    out: list[nn.Module] = []
    taken = {id(m) for m in largest.modules()}
    for container in containers:
        if id(container) not in taken and block_classes(container) == repeated:
            out.append(container)
            taken |= {id(m) for m in container.modules()}
    return out


def _holders(module: nn.Module) -> dict[int, set[int]]:
    """Each parameter (by id) -> the modules (by id) that hold it directly: more than one for a tie."""
    out: dict[int, set[int]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            out.setdefault(id(p), set()).add(id(sub))
    return out


def _shares_outside(block: nn.Module, holders: dict[int, set[int]]) -> bool:
    """A parameter of ``block`` is also held outside it (a head tied to an embedding): FSDP must not make
    it a unit of its own, or the tie would sit in two units; it stays with the root, which takes both."""
    inside = {id(m) for m in block.modules()}
    return any(holders[id(p)] - inside for p in block.parameters())


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


def uninitialisable_on_meta(module: nn.Module, filled: Callable[[str], bool] | None = None) -> list[str]:
    """The modules holding meta tensors that no ``reset_parameters()`` can initialise (a library's own
    layers: Hugging Face's ``Conv1D``, ``LlamaRMSNorm``), each as ``Class [names]``; empty when every
    meta tensor can be materialised (or there is none). ``filled``: module paths whose tensors are filled
    from elsewhere (``trainer.init_weights``), which need no initialisation."""
    stuck = []
    for path, m in module.named_modules():
        on_meta = [name for _, name, t in _direct_tensors(m) if t.is_meta]
        if on_meta and not callable(getattr(m, "reset_parameters", None)) and not (filled and filled(path)):
            stuck.append(f"{type(m).__name__} {on_meta}")
    return stuck


def rebuilt_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The non-persistent buffers of a module whose weights are filled from a Hugging Face directory (a
    rotary embedding's ``inv_freq``): the directory does not hold them, so the module is built again from
    its config on the CPU, as transformers computes them when it loads. Raises where it has no config."""
    derived = [name for name in module._buffers if name in module._non_persistent_buffers_set]
    if not derived:
        return {}
    config = getattr(module, "config", None)
    if config is None:
        raise ConfigError(f"{type(module).__name__} holds buffers no Hugging Face directory carries "
                          f"({derived}) and neither reset_parameters() nor a config to compute them from: "
                          f"build it outside the meta device")
    with torch.device("cpu"):
        fresh = type(module)(config)
    return {name: fresh._buffers[name] for name in derived}


def materialize_meta(module: nn.Module, device: torch.device, rng_state: torch.Tensor | None,
                     filled: Callable[[str], bool] | None = None) -> None:
    """Allocate the shards of every meta tensor and initialise them as a CPU build would have.

    Modules are visited in registration order, the RNG restarts from the state at
    ``configure_model``, and each module's ``reset_parameters()`` runs on full-size CPU tensors
    (one module at a time); this rank keeps its shard. Standard layers draw the same numbers in
    ``reset_parameters`` as in their constructor, so the weights equal a CPU build with the seed.
    A tensor shared by several modules (a head tied to its embedding) keeps what the first of them
    drew, as a CPU build that ties after constructing does; the later ones still draw, so the
    modules after them draw what they would have.

    A module whose path ``filled`` names (``trainer.init_weights`` fills it once the strategy is done) is
    allocated only, its non-persistent buffers computed from its config (``rebuilt_buffers``): no draws.
    """
    stuck = uninitialisable_on_meta(module, filled)
    if stuck:
        raise ConfigError(f"{first_few(stuck)}: built on the meta device but without reset_parameters() to "
                          f"initialise them; define reset_parameters() or create those tensors in __init__")
    targets = [(path, m) for path, m in module.named_modules()
               if any(t.is_meta for _, _, t in _direct_tensors(m))]
    with torch.random.fork_rng(devices=[]):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        initialised: set[int] = set()
        for path, m in targets:
            # to_empty reallocates every direct tensor, a shared one already initialised too: keep its values.
            with torch.no_grad():
                kept = [(t, _local(t).clone()) for _, _, t in _direct_tensors(m) if id(t) in initialised]
                m.to_empty(device=device, recurse=False)
                for t, values in kept:
                    _local(t).copy_(values)
            if filled is not None and filled(path):
                with torch.no_grad():
                    for name, values in rebuilt_buffers(m).items():
                        _copy_shard(m._buffers[name], values)
                continue
            _reset_full(m, initialised)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def _reset_full(module: nn.Module, initialised: set[int]) -> None:
    """``module.reset_parameters()`` on full-size stand-ins; each live tensor not initialised yet (by an
    earlier module sharing it) takes its shard of what was drawn."""
    live = _direct_tensors(module)
    for reg, name, t in live:
        full = torch.empty(t.shape, dtype=t.dtype)  # t.shape is the global shape for a DTensor
        reg[name] = nn.Parameter(full, requires_grad=t.requires_grad) if reg is module._parameters else full
    try:
        module.reset_parameters()
        for reg, name, t in live:
            if id(t) not in initialised:
                _copy_shard(t, reg[name])
                initialised.add(id(t))
    finally:
        for reg, name, t in live:
            reg[name] = t


def _copy_shard(live: torch.Tensor, full: torch.Tensor) -> None:
    DTensor, Replicate = lazy.dtensor().DTensor, lazy.dtensor().Replicate
    if not isinstance(live, DTensor):
        live.copy_(full)
        return
    mesh = live.device_mesh
    whole = DTensor.from_local(full.to(live.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
    live.to_local().copy_(whole.redistribute(mesh, live.placements).to_local())  # a local slice: no traffic


# --------------------------------------------------------------------------- steps


def clip_sharded_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` when every gradient is a ``DTensor`` shard: each rank's partial norm is
    reduced to the global one before the clip coefficient is applied. Gradients on different meshes (the
    experts of expert parallel beside the dense parameters) are reduced mesh by mesh: DTensor does not
    combine tensors of different meshes."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}  # parameters by their gradient's mesh
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for same_mesh in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in same_mesh], norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, lazy.dtensor().DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    for same_mesh in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(same_mesh, max_norm, total)
    return total


@contextlib.contextmanager
def no_gradient_sync(root: Any) -> Iterator[None]:
    # Gradients accumulate unsharded; the last micro-batch's backward reduce-scatters the sum.
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
