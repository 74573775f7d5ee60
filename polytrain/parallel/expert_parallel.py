"""Expert parallel as plain functions: which modules of a model are its experts, splitting them over the
``ep`` ranks, and sending each token to its experts and back with all-to-all.

A mixture-of-experts layer routes every token to ``top_k`` of ``num_experts`` experts. Its ``experts``
module holds each weight as one tensor with the expert on dim 0 (Hugging Face's ``gate_up_proj`` (E, 2I, H)
and ``down_proj`` (E, H, I)) and is called as ``experts(hidden_states, top_k_index, top_k_weights)``: the
rows, the chosen expert ids (tokens, k) and their routing weights (tokens, k). Under ``ep`` each rank of an
expert group keeps ``num_experts / ep`` consecutive experts (a ``DTensor`` sharded on dim 0 over the ``ep``
mesh, so checkpoints name and gather them whole); the router and everything else stay as they are.

Which modules are experts comes from the model's own plan, in Hugging Face's words: a module's
``expert_parallel_plan()``, or the ``_ep_plan`` of the Hugging Face models it holds (built from the config's
``base_model_ep_plan``)::

    {"layers.*.mlp.experts": "ep_dispatch_experts",          # the module tokens are sent to
     "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",    # its tensors split on dim 0
     "layers.*.mlp.experts.down_proj": "grouped_gemm"}

The plan is read from the model object: transformers is never imported (its own expert-parallel code is
in 5.x only, and applies to models it loaded itself). The dispatch is dropless, as one process computes:
every (token, expert) pair reaches its expert, however uneven the split (``all_to_all_single`` with
sizes exchanged first); the experts run their own forward on the rows they received, with local ids,
and the routing weights are applied on the sender, so the router and its auxiliary loss see nothing
change. Gradients come back through the same exchanges in reverse.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polytrain.core import lazy
from polytrain.core.errors import ConfigError, first_few
from polytrain.parallel.tensor_parallel import resolve_key

DISPATCH = "ep_dispatch_experts"  # the module the tokens are sent to
SPLIT = "grouped_gemm"  # a tensor of it, split on dim 0 (the expert)
STYLES = (DISPATCH, SPLIT)


class ExpertParallelPlanError(ConfigError):
    """The model's experts cannot be split as asked; the message says what to change."""


@dataclass
class ExpertLayer:
    """One experts module the plan splits: where it is, its expert count, the tensors split on dim 0."""

    path: str
    module: nn.Module
    num_experts: int
    tensors: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the plan


def expert_plan(module: nn.Module) -> dict[str, str]:
    """The module's expert-parallel plan: ``expert_parallel_plan()``'s dict, or the ``_ep_plan`` of every
    Hugging Face model it holds, keyed from ``module``; empty when it has neither."""
    hook = getattr(module, "expert_parallel_plan", None)
    if callable(hook):
        plan = hook()
        if not isinstance(plan, dict) or not plan:
            raise ExpertParallelPlanError(
                f"{type(module).__name__}.expert_parallel_plan() returned {type(plan).__name__} {plan!r}; "
                f"return a non-empty dict such as {{'layers.*.moe.experts': '{DISPATCH}', "
                f"'layers.*.moe.experts.w1': '{SPLIT}'}}")
        return dict(plan)
    plan: dict[str, str] = {}
    for path, model in _library_models(module):
        plan.update({f"{path}.{key}" if path else key: style for key, style in model._ep_plan.items()})
    return plan


def _library_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules (``module`` included) carrying a Hugging Face expert-parallel plan."""
    found: list[tuple[str, nn.Module]] = []
    for path, sub in module.named_modules():
        if any(path.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue  # inside one found already: the outer model's plan covers it
        if isinstance(getattr(sub, "_ep_plan", None), dict) and sub._ep_plan:
            found.append((path, sub))
    return found


def expert_layers(module: nn.Module, plan: dict[str, str]) -> list[ExpertLayer]:
    """The experts modules ``plan`` names in ``module``, each with the tensors it splits. Raises, naming the
    entry, for a style other than the two, a key that reaches nothing, or an experts module whose tensors
    do not hold ``num_experts`` on dim 0; and when the model has no experts at all."""
    if not plan:
        raise ExpertParallelPlanError(
            f"ep > 1 needs a mixture-of-experts model, but {type(module).__name__} has no expert-parallel "
            f"plan: it holds no Hugging Face MoE model (whose config carries base_model_ep_plan) and defines "
            f"no expert_parallel_plan(self); define one naming its experts modules ('{DISPATCH}') and their "
            f"tensors with the expert on dim 0 ('{SPLIT}'), or train it with ep=1")
    layers: dict[str, ExpertLayer] = {}
    splits: list[tuple[str, str, str]] = []  # (entry, module path, tensor name)
    for key, style in plan.items():
        if style not in STYLES:
            raise ExpertParallelPlanError(
                f"expert-parallel plan entry '{key}' is '{style}'; polytrain knows {', '.join(STYLES)} "
                f"(the experts module tokens are sent to, and its tensors split on the expert dim)")
        owner_key, _, tensor = key.rpartition(".") if style == SPLIT else (key, "", "")
        paths = resolve_key(module, owner_key)
        if not paths:
            raise ExpertParallelPlanError(
                f"expert-parallel plan entry '{key}' reaches no submodule of {type(module).__name__} "
                f"(names are relative to the TrainModule, as in named_modules()); fix the key")
        for path in paths:
            if style == DISPATCH:
                experts = module.get_submodule(path)
                count = getattr(experts, "num_experts", None)
                if not isinstance(count, int):
                    raise ExpertParallelPlanError(
                        f"'{path}' ({type(experts).__name__}) is planned as '{DISPATCH}' but has no integer "
                        f"num_experts: an experts module says how many experts its tensors hold")
                layers[path] = ExpertLayer(path, experts, count)
            else:
                splits.append((key, path, tensor))
    for key, path, tensor in splits:
        layer = layers.get(path)
        if layer is None:
            raise ExpertParallelPlanError(
                f"expert-parallel plan entry '{key}' splits a tensor of '{path}', which no '{DISPATCH}' "
                f"entry names: its tokens would not reach the split experts; add '{path}': '{DISPATCH}'")
        value = layer.module._parameters.get(tensor)
        if value is None:
            held = sorted(n for n, p in layer.module._parameters.items() if p is not None)
            raise ExpertParallelPlanError(
                f"expert-parallel plan entry '{key}': {type(layer.module).__name__} at '{path}' has no "
                f"parameter '{tensor}' (it holds {held})")
        if value.dim() == 0 or value.shape[0] != layer.num_experts:
            raise ExpertParallelPlanError(
                f"expert-parallel plan entry '{key}': '{path}.{tensor}' has shape {tuple(value.shape)}, but "
                f"its module holds num_experts={layer.num_experts}: the expert must be dim 0")
        layer.tensors.append(tensor)
    for layer in layers.values():
        per_expert = [n for n, p in layer.module._parameters.items()
                      if p is not None and p.dim() > 0 and p.shape[0] == layer.num_experts]
        left = [n for n in per_expert if n not in layer.tensors]
        if not layer.tensors or left:
            raise ExpertParallelPlanError(
                f"'{layer.path}' ({type(layer.module).__name__}) is planned as '{DISPATCH}' but the plan "
                f"splits {layer.tensors or 'none'} of its per-expert tensors, not {left or 'any'}: each rank "
                f"runs its own experts only, so every tensor with the expert on dim 0 must be split "
                f"('{SPLIT}')")
    return list(layers.values())


def check_expert_degree(layers: list[ExpertLayer], ep: int, dp_size: int) -> None:
    """Every experts module splits evenly over ``ep`` ranks; says which degrees would."""
    uneven = [f"{layer.path} ({layer.num_experts} experts)" for layer in layers if layer.num_experts % ep]
    if uneven:
        counts = sorted({layer.num_experts for layer in layers})
        fitting = [d for d in range(1, dp_size + 1) if dp_size % d == 0 and all(c % d == 0 for c in counts)]
        raise ExpertParallelPlanError(
            f"ep={ep} does not divide the expert count of {first_few(uneven)}: each rank holds "
            f"num_experts / ep whole experts; with {dp_size} data-parallel ranks use ep in {fitting}")


# --------------------------------------------------------------------------- splitting and dispatch


def split_experts(layers: list[ExpertLayer], ep_mesh: Any) -> None:
    """Keep this rank's experts of every layer: each planned tensor becomes a ``DTensor`` sharded on dim 0
    over ``ep_mesh`` (every rank holds the same full values here: its own slice is cut, nothing moves), and
    the module's forward goes through ``_dispatched_forward``."""
    dt = lazy.dtensor()
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for layer in layers:
        module = layer.module
        for name in layer.tensors:
            full = module._parameters[name]
            local = full.detach().chunk(size, dim=0)[rank].clone()
            sharded = dt.DTensor.from_local(local, ep_mesh, [dt.Shard(0)], run_check=False)
            module._parameters[name] = nn.Parameter(sharded, requires_grad=full.requires_grad)
        local_count = layer.num_experts // size
        module.num_experts = local_count  # the experts' own forward then sees local ids only
        if hasattr(module, "_is_expert_parallel"):
            module._is_expert_parallel = True  # transformers' grouped kernels read it to skip foreign ids
        own_forward = module.forward
        module.forward = functools.partial(_dispatched_forward, module, own_forward, ep_mesh.get_group(),
                                           size, local_count)


@contextlib.contextmanager
def _local_tensors(module: nn.Module) -> Iterator[None]:
    """The module's ``DTensor`` parameters as their local experts while its own forward runs (it indexes
    them by local id); autograd carries the gradients back to the ``DTensor``."""
    DTensor = lazy.dtensor().DTensor
    sharded = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    module._parameters.update({n: p.to_local() for n, p in sharded.items()})
    try:
        yield
    finally:
        module._parameters.update(sharded)


def _dispatched_forward(module: nn.Module, own_forward: Callable[..., torch.Tensor], group: Any, ep: int,
                        local_count: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair to the rank holding the expert, the experts' own forward there, the results
    back, weighted by the router and summed per token: what ``own_forward`` computes on one process."""
    DTensor = lazy.dtensor().DTensor
    if isinstance(hidden_states, DTensor):
        hidden_states = hidden_states.to_local()  # a tensor-parallel block hands its replicated rows
    if isinstance(top_k_weights, DTensor):
        top_k_weights = top_k_weights.to_local()
    tokens, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    # Sorted by expert, the pairs are grouped by the rank owning them (each owns consecutive experts).
    order = torch.argsort(ids, stable=True)
    sent = hidden_states[order // k]
    per_expert = torch.bincount(ids, minlength=local_count * ep).view(ep, local_count)
    per_expert_in = torch.empty_like(per_expert)
    dist.all_to_all_single(per_expert_in, per_expert, group=group)
    # The split sizes are the layer's one host sync: all_to_all_single takes them as lists.
    sizes_out, sizes_in = torch.stack([per_expert.sum(dim=1), per_expert_in.sum(dim=1)]).tolist()
    received = _AllToAll.apply(sent, sizes_in, sizes_out, group)
    local_ids = torch.arange(local_count, device=ids.device).repeat(ep)
    local_ids = local_ids.repeat_interleave(per_expert_in.reshape(-1)).unsqueeze(-1)
    unit = torch.ones_like(local_ids, dtype=received.dtype)  # weighted below, on the sender
    with _local_tensors(module):
        if received.shape[0]:
            computed = own_forward(received, local_ids, unit)
        else:
            # Nothing came: one row through the experts, cut off, keeps them in the backward graph so every
            # rank runs the same reverse exchange and the experts' gradient reduction.
            computed = own_forward(received.sum(dim=0, keepdim=True), local_ids.new_zeros((1, 1)),
                                   unit.new_ones((1, 1)))[:0]
    returned = _AllToAll.apply(computed, sizes_out, sizes_in, group)
    per_pair = returned[torch.argsort(order)].view(tokens, k, -1)
    combined = (per_pair * top_k_weights.unsqueeze(-1).to(per_pair.dtype)).sum(dim=1)
    return combined.to(hidden_states.dtype)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sizes_in: list[int], sizes_out: list[int],
                group: Any) -> torch.Tensor:
        ctx.sizes_in = sizes_in
        ctx.sizes_out = sizes_out
        ctx.group = group
        out = rows.new_empty((sum(sizes_in), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), sizes_in, sizes_out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.sizes_out), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sizes_out, ctx.sizes_in, group=ctx.group)
        return back, None, None, None


def expert_parameters(layers: list[ExpertLayer]) -> list[nn.Parameter]:
    return [layer.module._parameters[name] for layer in layers for name in layer.tensors]
