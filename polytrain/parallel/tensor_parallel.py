"""Plain functions behind ``model_parallel``'s tensor mode: reading and checking the module's plan,
applying it over the ``tp`` mesh, sharding the result over the data-parallel mesh (2D), and the
pieces of the step that must understand ``DTensor`` (gradient-norm clipping).

Everything that only reads the module (the plan checks) runs before any process group exists, so
a typo in a plan fails in a second on every rank alike instead of after a rendezvous.
"""

from __future__ import annotations

import difflib
import math
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from polytrain.core import lazy
from polytrain.core.errors import ConfigError
from polytrain.parallel.fsdp import blocks_to_wrap


class TensorParallelPlanError(ConfigError):
    """The module's tensor-parallel plan cannot be applied; the message says what to change."""


def module_plan(module: nn.Module) -> dict[str, ParallelStyle] | None:
    """The module's plan: ``tensor_parallel_plan()``'s dict, or None when it has ``parallelize(tp_mesh)``."""
    hook = getattr(module, "tensor_parallel_plan", None)
    if callable(hook):
        plan = hook()
        check_plan(module, plan)
        return plan
    if callable(getattr(module, "parallelize", None)):
        return None
    raise TensorParallelPlanError(
        f"model_parallel mode 'tensor' needs {type(module).__name__} to say how to split its layers: define "
        f"tensor_parallel_plan(self) returning {{'submodule.name': ColwiseParallel(), ...}} or "
        f"parallelize(self, tp_mesh) applying torch.distributed.tensor.parallel itself"
    )


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
            f"{type(module).__name__}.tensor_parallel_plan() returned {type(plan).__name__} {plan!r}; return a "
            f"non-empty dict {{'submodule.name': ColwiseParallel(), ...}}"
        )
    known = [n for n, _ in module.named_modules() if n]
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TensorParallelPlanError(
                f"tensor-parallel plan entry '{key}' is a {type(style).__name__}, not a ParallelStyle; use "
                f"ColwiseParallel(), RowwiseParallel(), SequenceParallel(), polytrain.layers.VocabParallel(), ..."
            )
        if not isinstance(key, str) or not resolve_key(module, key):
            close = difflib.get_close_matches(str(key), known, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TensorParallelPlanError(
                f"tensor-parallel plan names submodule '{key}', but {type(module).__name__} has no submodule "
                f"of that name ({len(known)} submodules; names are relative to the TrainModule, as in "
                f"named_modules(), e.g. {known[:4]}).{hint} Fix the key in tensor_parallel_plan()"
            )


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, plan: dict[str, ParallelStyle] | None) -> None:
    """Shard the module's layers over ``tp_mesh`` (rank 0's initial values win, as on one device)."""
    if plan is None:
        module.parallelize(tp_mesh)
    else:
        parallelize_module(module, tp_mesh, plan)


def shard_data_parallel(module: nn.Module, root: nn.Module, dp_mesh: Any) -> None:
    """FSDP2 over the data-parallel mesh after tensor parallelism (2D). The units are the ``fsdp``
    strategy's (each block of the largest ``nn.Sequential``/``nn.ModuleList``); ``root``, the router
    the step runs through, owns whatever no block took."""
    fully_shard = lazy.fsdp().fully_shard
    for block in blocks_to_wrap(module, None):
        fully_shard(block, mesh=dp_mesh)
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=False)  # backward needs the root first


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over a mix of sharded (``DTensor``) and replicated gradients.

    A DTensor's norm is reduced over its mesh (``full_tensor``) so sharded gradients count once in
    full; a plain tensor is the same on every rank and counts as it is. Every rank calls this with
    the same parameters in the same order, so the per-parameter reductions match.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = []
    for g in grads:
        norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        for g in grads:
            g.mul_(coef)
    return total
