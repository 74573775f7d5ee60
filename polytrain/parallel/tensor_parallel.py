"""Plain functions behind ``model_parallel``'s tensor mode: reading and checking the module's plan,
applying it over the ``tp`` mesh, sharding the result over the data-parallel mesh (2D), and the
pieces of the step that must understand ``DTensor`` (gradient-norm clipping).

Everything that only reads the module (the plan checks) runs before any process group exists, so
a typo in a plan fails in a second on every rank alike instead of after a rendezvous.
"""

from __future__ import annotations

import difflib
import functools
import math
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import ConfigError, first_few
from polytrain.parallel.library_plans import library_models, library_plan


class TensorParallelPlanError(ConfigError):
    """The module's tensor-parallel plan cannot be applied; the message says what to change."""


def module_plan(module: nn.Module) -> dict[str, Any] | None:
    """The module's plan: ``tensor_parallel_plan()``'s dict, or None when it has ``parallelize(tp_mesh)``;
    without either, the plan of the Hugging Face models it holds (``library_plans``)."""
    hook = getattr(module, "tensor_parallel_plan", None)
    if callable(hook):
        plan = hook()
        check_plan(module, plan)
        return plan
    if callable(getattr(module, "parallelize", None)):
        return None
    plan = without_ties(module, reachable(module, library_plan(module) or {}))
    if plan:
        check_plan(module, plan)
        return plan
    held = ", ".join(f"{path or 'the module'} ({type(m).__name__})" for path, m in library_models(module))
    library = f"; the library model it holds has no plan of its own: {held}" if held else ""
    raise TensorParallelPlanError(
        f"model_parallel mode 'tensor' needs {type(module).__name__} to say how to split its "
        f"layers{library}: define tensor_parallel_plan(self) returning "
        f"{{'submodule.name': ColwiseParallel(), ...}} or parallelize(self, tp_mesh) applying "
        f"torch.distributed.tensor.parallel itself"
    )


def reachable(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """The entries of a library's plan that reach a submodule of this model. A model class's plan covers every
    config of it: Qwen3-MoE's names the dense MLP (``layers.*.mlp.gate_proj``) that a model whose layers are
    all mixtures of experts does not have. A plan the user wrote is checked strictly instead."""
    return {key: style for key, style in plan.items() if resolve_key(module, key)}


def without_ties(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` less the entries reaching a module whose parameter another module holds too (an
    embedding tied to the head): sharding one holder would leave the other with the old tensor and
    untie them silently. Both stay whole on every rank, tied, as any parameter no plan names."""
    holders: dict[int, int] = {}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    kept = {}
    for key, style in plan.items():
        reached = [module.get_submodule(name) for name in resolve_key(module, key)]
        if not any(holders[id(p)] > 1 for sub in reached for p in sub.parameters(recurse=False)):
            kept[key] = style
    return kept


def resolve_key(module: nn.Module, key: str) -> list[str]:
    """Module names that plan key ``key`` reaches, matching the way ``parallelize_module`` walks
    (one ``fnmatch`` pattern per dotted part, over children)."""
    if key == "":
        return [""]
    names = [""]
    for token in key.split("."):
        nxt = []
        for name in names:
            parent = module.get_submodule(name)
            nxt += [f"{name}.{c}" if name else c for c, _ in parent.named_children() if fnmatch(c, token)]
        names = nxt
    return names


def check_plan(module: nn.Module, plan: Any) -> None:
    """Every key names an existing submodule and every value is a ``ParallelStyle``."""
    if not isinstance(plan, dict) or not plan:
        raise TensorParallelPlanError(
            f"{type(module).__name__}.tensor_parallel_plan() returned {type(plan).__name__} {plan!r}; "
            f"return a non-empty dict {{'submodule.name': ColwiseParallel(), ...}}"
        )
    known = [n for n, _ in module.named_modules() if n]
    ParallelStyle = lazy.dtensor().parallel.ParallelStyle
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TensorParallelPlanError(
                f"tensor-parallel plan entry '{key}' is a {type(style).__name__}, not a ParallelStyle; use "
                f"ColwiseParallel(), RowwiseParallel(), SequenceParallel(), "
                f"polytrain.layers.VocabParallel(), ..."
            )
        if not isinstance(key, str) or not resolve_key(module, key):
            close = difflib.get_close_matches(str(key), known, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TensorParallelPlanError(
                f"tensor-parallel plan names submodule '{key}', but {type(module).__name__} has no submodule "
                f"of that name ({len(known)} submodules; names are relative to the TrainModule, as in "
                f"named_modules(), e.g. {known[:4]}).{hint} Fix the key in tensor_parallel_plan()"
            )
        _check_splittable(module, key, style)


def _check_splittable(module: nn.Module, key: str, style: Any) -> None:
    """torch's own ColwiseParallel and RowwiseParallel split ``nn.Linear`` and ``nn.Embedding`` and raise a
    bare ``NotImplementedError`` on anything else (Hugging Face GPT-2's ``Conv1D``), from every rank, once
    the process group is up. Said here, by entry and layer. A style of one's own (a subclass) may split
    other layers: it is not checked."""
    parallel = lazy.dtensor().parallel
    if type(style) not in (parallel.ColwiseParallel, parallel.RowwiseParallel):
        return
    other = [(name, type(module.get_submodule(name)).__name__) for name in resolve_key(module, key)
             if not isinstance(module.get_submodule(name), (nn.Linear, nn.Embedding))]
    if other:
        kinds = sorted({kind for _, kind in other})
        raise TensorParallelPlanError(
            f"tensor-parallel plan entry '{key}' gives {type(style).__name__} to {len(other)} layer(s) it "
            f"cannot split: {first_few([f'{name} ({kind})' for name, kind in other])}; torch's "
            f"{type(style).__name__} splits nn.Linear and nn.Embedding only. Leave {', '.join(kinds)} out of "
            f"the plan, replace those layers with nn.Linear, or give them a ParallelStyle of your own")


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, plan: dict[str, Any] | None) -> None:
    """Shard the module's layers over ``tp_mesh`` (rank 0's initial values win, as on one device)."""
    if plan is None:
        module.parallelize(tp_mesh)
    else:
        lazy.dtensor().parallel.parallelize_module(module, tp_mesh, plan)


# --------------------------------------------------------------------------- replicated parameters
#
# Parameters the plan leaves alone (embeddings, norms, heads...) become DTensors replicated over the
# tp mesh, so that every parameter an optimizer or a clipping function sees is a DTensor: torch's
# foreach and fused kernels refuse a list that mixes DTensor and torch.Tensor. Their modules keep
# computing on plain tensors: while a hooked module runs forward, each such parameter in it is swapped
# for ``to_local()`` (a view, connected to autograd) and its DTensor is put back afterwards. Hooked are
# the step's router and every module holding such a parameter somewhere below it, so a parameter used
# by an enclosing module's forward (``nn.MultiheadAttention`` reads ``out_proj.weight``; tied weights)
# works too, in a step or in a direct call after fit; under FSDP (2D) the hook of the unit, registered
# first, runs after FSDP has gathered the parameters. The gradient arrives as a Replicate DTensor
# computed locally, with no communication: correct because every tp peer computes it from the same
# replicated activations and the same upstream gradient (the default outputs of Colwise/Rowwise/
# VocabParallel are replicated tensors, identical on every peer; their input hooks all-reduce the
# gradient flowing back into replicated activations). A module called with DTensor inputs (a plan that
# keeps DTensor activations, e.g. sequence parallel with use_local_output=False) computes with the
# DTensors instead, and DTensor gives a parameter used on shards a Partial gradient
# (``reduce_partial_grads`` sums it).


def _is_tp_replica(param: Any, DTensor: type) -> bool:
    """A DTensor replicated over a 1-D mesh: the tp layout; FSDP's sharded form (2-D) is not one."""
    return isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.placements[0].is_replicate()


class _LocalReplicas:
    """Forward hooks on one module: the listed ``(owner, name)`` parameters are local views while it runs,
    unless it is called with DTensor inputs: then they are DTensors, even where an enclosing module's
    hook made them views. A hook with nothing to swap (an enclosing module's hook made the views) changes
    no state: inside a compiled, checkpointed block dynamo refuses side effects (``torch.utils.checkpoint``
    would replay them in the recompute)."""

    def __init__(self, replicas: list[tuple[nn.Module, str]]) -> None:
        self.replicas = replicas
        self.depth = 0  # calls running while this hook's swaps are in place
        self.swapped: list[tuple[nn.Module, str, torch.Tensor]] = []

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.depth:  # re-entered (a module calling itself): the outer call swapped already
            self.depth += 1
            return
        DTensor = lazy.dtensor().DTensor
        dtensor_inputs = any(isinstance(a, DTensor) for a in (*args, *kwargs.values()))
        views: dict[int, torch.Tensor] = {}
        swapped = []
        for owner, name in self.replicas:
            current = owner._parameters.get(name)
            if dtensor_inputs:
                swap = getattr(current, "_polytrain_replica", None)  # an enclosing hook's view: undo it
            elif _is_tp_replica(current, DTensor):  # not a view already, nor FSDP's sharded parameter
                swap = views.get(id(current))
                if swap is None:
                    swap = views[id(current)] = _local_view(current)
                    swap._polytrain_replica = current
                    group = getattr(owner, "_polytrain_summed_grads", {}).get(name)
                    if group is not None and swap.requires_grad:
                        swap.register_hook(functools.partial(_summed, group))
            else:
                swap = None
            if swap is not None:
                owner._parameters[name] = swap
                swapped.append((owner, name, current))
        if swapped:
            self.depth, self.swapped = 1, swapped

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.depth:
            return  # this call swapped nothing
        self.depth -= 1
        if self.depth == 0:
            for owner, name, original in reversed(self.swapped):
                owner._parameters[name] = original
            self.swapped = []


def _summed(group: Any, grad: torch.Tensor) -> torch.Tensor:
    total = grad.clone()
    C.all_reduce(total, group=group)
    return total


def sum_grads_over_tp(module: nn.Module, keys: list[str], tp_mesh: Any) -> None:
    """The parameters of the modules ``keys`` reach are replicas used on this rank's shard of the
    activations: their local views' gradients are summed over ``tp_mesh`` in backward (every tp peer runs
    the same backward, so each reaches the all-reduce). Marked on the owning module: FSDP replaces the
    parameter objects, and the view is made from whichever one is live."""
    group = tp_mesh.get_group()
    for key in keys:
        for path in resolve_key(module, key):
            owner = module.get_submodule(path)
            held = [name for name, param in owner._parameters.items() if param is not None]
            owner._polytrain_summed_grads = dict.fromkeys(held, group)


def _local_view(replica: Any) -> torch.Tensor:
    """``replica.to_local()`` outside any dispatch mode (eager): a per-op checkpointed block's recompute
    calls this hook where its forward did not (an enclosing module's hook had made the views), and
    selective checkpointing's op-by-op replay must not see the extra view."""
    if torch.compiler.is_compiling():
        return replica.to_local()
    with _disable_current_modes():
        return replica.to_local()


def localize_replicas(module: nn.Module, replicas: list[tuple[nn.Module, str]]) -> None:
    """Hook ``module`` so that ``replicas`` are plain local views during its forward. Register before
    ``fully_shard``: FSDP's pre-forward hook (prepended) then unshards first and its post-forward hook
    (appended) reshards after the DTensors are back."""
    if replicas:
        hooks = _LocalReplicas(list(replicas))
        module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
        module.register_forward_hook(hooks.post, always_call=True)


def replicate_unplanned(module: nn.Module, tp_mesh: Any) -> list[tuple[nn.Module, str]]:
    """Make every parameter the plan left a plain tensor a DTensor replicated over ``tp_mesh`` (rank
    0's value, as for the sharded ones; tied parameters stay tied) and hook every module holding one
    (see above). Returns the ``(owner module, parameter name)`` pairs converted."""
    dt = lazy.dtensor()
    converted: dict[int, nn.Parameter] = {}
    below: dict[str, list[tuple[nn.Module, str]]] = {}  # module name -> the replicas in its subtree
    for path, owner in module.named_modules():
        for name, param in list(owner._parameters.items()):
            if param is None or isinstance(param, dt.DTensor):
                continue
            if id(param) not in converted:
                data = dt.distribute_tensor(param.detach(), tp_mesh, [dt.Replicate()])
                converted[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            owner._parameters[name] = converted[id(param)]
            parts = path.split(".") if path else []
            for depth in range(len(parts) + 1):
                below.setdefault(".".join(parts[:depth]), []).append((owner, name))
    for path, replicas in below.items():
        localize_replicas(module.get_submodule(path), replicas)
    return below.get("", [])


def reduce_partial_grads(parameters: list[torch.Tensor]) -> None:
    """Give every gradient its parameter's layout. A replicated parameter used on sequence shards (a
    ``SequenceParallel`` norm, or one outside the plan fed DTensor activations) gets a ``Partial``
    gradient: each peer holds its shard's share. Reduced once here, before clipping and the step, it
    is neither summed again by each optimizer op that reads it nor fed to an op that cannot take a
    partial sum (clamp, fused SGD's momentum init). Same parameters, same layouts on every rank."""
    DTensor = lazy.dtensor().DTensor
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float, group: Any = None,
                   counted_elsewhere: set[int] | frozenset[int] = frozenset()) -> torch.Tensor:
    """``clip_grad_norm_`` over a mix of sharded (``DTensor``) and replicated gradients, and over the
    pipeline stages when ``group`` (the pp group) is given.

    A DTensor's norm is reduced over its mesh (``full_tensor``) so sharded gradients count once in
    full; a plain tensor is the same on every rank and counts as it is; stages' squared norms are
    summed over ``group``. Every rank calls this with the same parameters in the same order (per
    stage), so the per-parameter reductions match. A parameter whose id is in ``counted_elsewhere`` (a
    copy of a tie across stages, counted on its first stage) is clipped but not counted here.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    DTensor = lazy.dtensor().DTensor
    norms = []
    for g in (p.grad for p in parameters if p.grad is not None and id(p) not in counted_elsewhere):
        norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if norms:
        device = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)
    else:
        total = torch.zeros(())
    if group is not None and C.active(group):
        squared = total.reshape(1).pow(2)
        total = C.all_reduce(squared, "sum", group).sqrt().reshape(())
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        for g in grads:
            g.mul_(coef)
    return total
