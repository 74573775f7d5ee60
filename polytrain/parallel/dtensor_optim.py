"""Optimizer steps over ``DTensor`` parameters where torch has no sharding rule of its own.

torch registers DTensor rules for fused Adam/AdamW but none for fused SGD, so ``SGD(fused=True)``
over sharded parameters (fsdp, tensor parallel) raises "does not have a sharding strategy
registered". ``support_fused_sgd`` installs a handler in DTensor's dispatcher (a private table:
every access is guarded, and the handler steps aside once torch has a rule of its own).

DTensor runs no op over tensors of different meshes, so a param group mixing them (expert parallel:
the experts' mesh beside the dense parameters') steps one tensor at a time (``step_across_meshes``).
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.core import lazy
from polytrain.core.errors import ConfigError


def _fused_sgd_on_local_shards(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """``torch._fused_sgd_`` over DTensors: elementwise, so each rank updates its own shards. A grad laid
    out unlike its parameter (a Partial one, from a sequence-parallel layer) is redistributed first."""
    DTensor = lazy.dtensor().DTensor
    params, grads, buffers = args[0], args[1], args[2]
    for tensor in (*grads, *buffers):
        if not isinstance(tensor, DTensor):
            raise RuntimeError(f"{op_call} got mixed torch.Tensor and DTensor; "
                               f"make every parameter a DTensor")
    grads = [g if g.placements == p.placements else g.redistribute(p.device_mesh, p.placements)
             for p, g in zip(params, grads)]
    for param, buf in zip(params, buffers):
        if buf.placements != param.placements:
            raise NotImplementedError(f"fused SGD over a DTensor parameter laid out {param.placements} "
                                      f"whose momentum buffer is {buf.placements}; use SGD(foreach=True)")

    def local(value: Any) -> Any:
        return value.to_local() if isinstance(value, DTensor) else value

    return op_call([local(p) for p in params], [local(g) for g in grads], [local(b) for b in buffers],
                   *[local(a) for a in args[3:]], **{k: local(v) for k, v in kwargs.items()})


def support_fused_sgd(optimizers: list[torch.optim.Optimizer]) -> None:
    """Let ``SGD(fused=True)`` step DTensor parameters (torch registers DTensor rules for fused Adam/AdamW
    but none for fused SGD, so it raises "does not have a sharding strategy registered"). Acts only when
    an optimizer is a fused SGD; idempotent; does nothing once torch has a rule of its own, or if its
    dispatcher's layout differs (the torch error then stands)."""
    if not any(isinstance(opt, torch.optim.SGD) and any(g.get("fused") for g in opt.param_groups)
               for opt in optimizers):
        return
    dispatcher = getattr(lazy.dtensor().DTensor, "_op_dispatcher", None)
    handlers = getattr(dispatcher, "_custom_op_handlers", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    if not isinstance(handlers, dict) or propagator is None:
        return
    for name in ("default", "tensor_lr"):
        op = getattr(torch.ops.aten._fused_sgd_, name, None)
        registered = any(op in getattr(propagator, table, {})
                         for table in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"))
        if op is not None and not registered:
            handlers.setdefault(op, _fused_sgd_on_local_shards)


def step_across_meshes(optimizers: list[torch.optim.Optimizer]) -> None:
    """Make every param group whose parameters lie on several device meshes step one tensor at a time:
    torch's foreach kernels take a whole group at once, and DTensor refuses a foreach op across meshes
    (torch's default on CPU; torchtitan turns foreach off for its MoE models alike). A group built with
    ``foreach=True`` over such parameters is refused, in words, before any step. A fused step is left as
    asked: fused SGD runs on each parameter's local shard (``support_fused_sgd``). Meshes are told apart
    by their ranks and names (FSDP gives equal meshes to different parameters)."""
    for optimizer in optimizers:
        for index, group in enumerate(optimizer.param_groups):
            meshes = {p.device_mesh for p in group["params"] if hasattr(p, "device_mesh")}
            if len(meshes) < 2 or group.get("fused"):
                continue
            if group.get("foreach"):
                raise ConfigError(
                    f"{type(optimizer).__name__} param group {index} was built with foreach=True over "
                    f"parameters on {len(meshes)} device meshes (the experts of expert parallel beside the "
                    f"dense layers): DTensor runs no foreach kernel across meshes; leave foreach unset (the "
                    f"group then steps one tensor at a time) or give the experts a param group of their own")
            if "foreach" in group:
                group["foreach"] = False
