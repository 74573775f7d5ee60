"""Model and optimizer state of a live (possibly sharded) model, keyed as on one device.

A strategy's model may be plain, ``DTensor``-sharded (FSDP, HSDP, tensor parallel) or split in
parts (the stages a pipeline rank holds: ``strategy.state_dict_module()``). Every function here
reads or writes such state under the names the full, unwrapped model has on one device, with the
optimizer state flattened by parameter name (``state.<fqn>.<name>``,
``param_groups.<fqn>.<hyperparameter>``): that is what makes every checkpoint portable between
strategies and world sizes.

torch's ``distributed.checkpoint`` and ``distributed.tensor`` come through ``polytrain.core.lazy``:
a single-device run that never saves does not pay for importing them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from polytrain.checkpoint.reading import strip_wrapper_prefix
from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import CheckpointError


def state_dict_parts(strategy: Any) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
    """``(module, its optimizers)`` for each part of the model this rank holds (see the contract)."""
    hook = getattr(strategy, "state_dict_module", None)
    modules = hook() if callable(hook) else strategy.module
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    if len(modules) == 1:
        return [(modules[0], list(strategy.optimizers))]
    owner = {id(p): i for i, m in enumerate(modules) for p in m.parameters()}
    groups: list[list[torch.optim.Optimizer]] = [[] for _ in modules]
    for n, opt in enumerate(strategy.optimizers):
        parts = {owner.get(id(p)) for g in opt.param_groups for p in g["params"]}
        if len(parts) != 1 or None in parts:
            raise CheckpointError(f"optimizer {n} holds parameters of parts {sorted(map(str, parts))} of the "
                                  f"{len(modules)} returned by state_dict_module(); give each part its own optimizer")
        groups[parts.pop()].append(opt)
    return list(zip(modules, groups))


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """The whole model as plain CPU tensors under single-device names, on rank 0 (others get ``{}``
    for a sharded model). A collective when parameters are ``DTensor`` s: every rank calls it."""
    sd = lazy.dcp().state_dict
    return sd.get_model_state_dict(module, options=sd.StateDictOptions(full_state_dict=True, cpu_offload=True))


def gathered_stage_state(module: nn.Module, is_global_zero: bool) -> dict[str, Any]:
    """The whole model on rank 0 from a pipeline's ranks, each holding some stages (maybe sharded over
    their own sub-mesh): every rank makes its part full (a collective within the part's meshes), then
    the parts meet on rank 0 (others get ``{}``). A collective: every rank calls it."""
    DTensor = lazy.dtensor().DTensor
    # FSDP over TP leaves strided shards that torch gathers in two steps, warning once per tensor.
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                 for k, v in module.state_dict().items()}
    finally:
        quiet.setLevel(level)
    merged: dict[str, Any] = {}
    for part in C.all_gather_object(local):
        merged.update(part)
    return merged if is_global_zero else {}


def _options() -> Any:
    # Sharded (each rank its own slices: no communication). Flattened optimizer state is keyed by
    # parameter name alone, so any partition of the model finds its entries.
    return lazy.dcp().state_dict.StateDictOptions(flatten_optimizer_state_dict=True)


def part_state(part: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict]:
    return lazy.dcp().state_dict.get_model_state_dict(part, options=_options()), optimizer_state(part, optimizers)


def optimizer_state(part: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """``optimizers``' state, flattened and keyed by parameter name within ``part``."""
    if not optimizers:
        return {}
    # torch creates missing optimizer state with a zero-lr step; a saved run must not keep it
    # (Adam's step count would be off by one), so such optimizers get their empty state back.
    fresh = [(opt, opt.state_dict()) for opt in optimizers if not opt.state]
    optim = lazy.dcp().state_dict.get_optimizer_state_dict(part, optimizers, options=_options())
    for opt, state in fresh:
        opt.load_state_dict(state)
    return optim


def set_part_state(part: nn.Module, optimizers: list[torch.optim.Optimizer], model: dict, optim: dict) -> None:
    sd = lazy.dcp().state_dict
    sd.set_model_state_dict(part, model, options=_options())
    if optimizers:
        sd.set_optimizer_state_dict(part, optimizers, optim, options=_options())


def full_optimizer_state(strategy: Any) -> dict[str, Any]:
    """Every optimizer's state as one flat, name-keyed dict of full tensors (replicated files).

    A collective when parameters are ``DTensor`` s (they are gathered); plain tensors are copied."""
    DTensor = lazy.dtensor().DTensor
    merged: dict[str, Any] = {}
    for part, optimizers in state_dict_parts(strategy):
        if optimizers:
            optim = optimizer_state(part, optimizers)
            merged.update({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in optim.items()})
    return merged


def _like(live: Any, saved: Any, key: str) -> Any:
    """``saved`` (a full value) shaped like ``live``: this rank's shard of it for a ``DTensor``."""
    DTensor, Replicate = lazy.dtensor().DTensor, lazy.dtensor().Replicate
    if not isinstance(live, torch.Tensor):
        return saved
    if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(live.shape):
        got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise CheckpointError(f"checkpoint entry {key} has shape {got} but the model expects {tuple(live.shape)}; "
                              f"the checkpoint was written for a different model")
    if isinstance(live, DTensor):
        # Replicate -> the live placements is a local slice on every rank: no communication.
        full = saved.to(device=live.device, dtype=live.dtype)
        whole = DTensor.from_local(full, live.device_mesh, [Replicate()] * live.device_mesh.ndim, run_check=False)
        return whole.redistribute(live.device_mesh, live.placements)
    return saved.to(device=live.device, dtype=live.dtype)


def _fill(live: dict[str, Any], saved: dict[str, Any], what: str, path: str) -> dict[str, Any]:
    missing = [k for k in live if k not in saved]
    if missing:
        raise CheckpointError(f"{path} has no {what} entry for {len(missing)} of {len(live)} keys this model needs, "
                              f"e.g. {missing[:3]}; it was written for a different model or optimizer")
    return {k: _like(v, saved[k], f"{what} {k}") for k, v in live.items()}


def _legacy_optimizer(part: nn.Module, optimizers: list, states: list[dict]) -> dict[str, Any]:
    """Files from before name-keyed optimizer state: entries are numbered in configure_optimizers'
    parameter order, which the same module reproduces; rename them to the flat form."""
    names = {id(p): n for n, p in part.named_parameters()}
    flat: dict[str, Any] = {}
    for optimizer, state in zip(optimizers, states):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fqn = {i: names[id(p)] for i, p in enumerate(params)}
        for i, entries in state["state"].items():
            flat.update({f"state.{fqn[int(i)]}.{k}": v for k, v in entries.items()})
        for group in state["param_groups"]:
            for i in group["params"]:
                flat.update({f"param_groups.{fqn[int(i)]}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def agree_on_load(strategy: Any, error: str | None, saved_keys: set[str], used: set[str], path: str) -> None:
    """One collective after all local work: any rank's error, or a model entry of the checkpoint
    that no rank holds (a pipeline rank holds only its part), raises the same error everywhere."""
    if C.active():
        gathered = C.all_gather_object((error, sorted(used)))
        error = next((f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e is not None), None)
        used = set().union(*(set(u) for _, u in gathered))
    if error is not None:
        raise CheckpointError(error)
    unused = sorted(saved_keys - used)
    if unused:
        raise CheckpointError(f"{path} holds {len(unused)} model entries no rank's model has, e.g. {unused[:3]}; "
                              f"it was written for a different model")


def _load_full_local(strategy: Any, payload: dict[str, Any], path: str) -> set[str]:
    saved_model = strip_wrapper_prefix(payload["model"])
    used: set[str] = set()
    for part, optimizers in state_dict_parts(strategy):
        live_model, live_optim = part_state(part, optimizers)
        used.update(live_model)
        model = _fill(live_model, saved_model, "model", path)
        optim: dict[str, Any] = {}
        if optimizers and ("optimizer" in payload or "optimizers" in payload):
            saved_optim = payload.get("optimizer")
            if saved_optim is None:
                saved_optim = _legacy_optimizer(part, optimizers, payload["optimizers"])
            optim = _fill(live_optim, saved_optim, "optimizer", path)
        elif optimizers:
            optimizers = []  # weights only (a bare state_dict): optimizers keep their fresh state
        set_part_state(part, optimizers, model, optim)
    return used


def load_full_state(strategy: Any, payload: dict[str, Any], path: str) -> None:
    """Load full (unsharded) model/optimizer state, e.g. from a replicated file, into ``strategy``:
    each rank keeps its shard of every tensor. Every rank calls it; errors are agreed on."""
    error, used = None, set()
    try:
        used = _load_full_local(strategy, payload, path)
    except (CheckpointError, KeyError, RuntimeError, ValueError) as err:
        error = str(err) if isinstance(err, CheckpointError) else f"{path} does not fit this model: {err!r}"
    agree_on_load(strategy, error, set(strip_wrapper_prefix(payload.get("model", {}))), used, path)
