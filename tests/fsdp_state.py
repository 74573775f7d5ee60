"""Reading what FSDP2's ``fully_shard`` applied to each unit, for tests that must see an option take
effect rather than only parse. Private torch state: the fields used here are the same in torch 2.11
through 2.15 (the supported range); a rename there fails these tests loudly, not silently."""

from __future__ import annotations

from typing import Any

from torch import nn


def fsdp_units(model: nn.Module) -> dict[str, dict[str, Any]]:
    """What ``fully_shard`` recorded on each unit (FSDP2's state, the same fields in torch 2.11-2.15):
    gather/reduce dtypes, offload policy, whether it reshards after forward, where its shards live."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[str, dict[str, Any]] = {}
    for name, m in model.named_modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is not None:
            params = group.fsdp_params
            units[name or "<root>"] = {
                "param_dtype": {str(p.mp_policy.param_dtype) for p in params},
                "reduce_dtype": {str(p.mp_policy.reduce_dtype) for p in params},
                "offload": (type(group.offload_policy).__name__, {p.offload_to_cpu for p in params}),
                "reshard": group.post_forward_mesh_info is not None,
                "devices": {p.sharded_param.device.type for p in params},
                "grad_devices": {p.sharded_param.grad.device.type for p in params
                                 if p.sharded_param.grad is not None}}
    return units
