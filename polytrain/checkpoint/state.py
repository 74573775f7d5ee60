"""Model and optimizer state of a live (possibly sharded) model, keyed as on one device.

A strategy's model may be plain or ``DTensor``-sharded (FSDP, HSDP, tensor parallel), and a pipeline
rank holds only its stages; a strategy hands these functions its ``parts``: ``(module, its optimizers)``
pairs (``Strategy.state_parts``). Every function here reads or writes such state under the names the
full, unwrapped model has on one device, with the optimizer state flattened by parameter name
(``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``): that is what makes every
checkpoint portable between strategies and world sizes.

torch's ``distributed.checkpoint`` and ``distributed.tensor`` come through ``polytrain.core.lazy``:
a single-device run that never saves does not pay for importing them.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from polytrain.checkpoint.reading import strip_wrapper_prefix
from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import CheckpointError

Parts = list[tuple[nn.Module, list[torch.optim.Optimizer]]]
TENSOR_KEYS = ("model", "optimizer", "optimizers")  # model and optimizer state; the rest is the payload


@dataclass
class Loaded:
    """A checkpoint as a ``CheckpointIO`` read it: ``payload`` is everything but model and optimizer state;
    ``model`` and ``optimizer`` (flattened by parameter name; None when the file holds none) are full
    tensors, or with ``in_place`` the live state a sharded directory was read into; ``legacy_optimizers``:
    an older file's index-keyed ``Optimizer.state_dict()`` s; ``saved_model_keys``: every model entry the
    checkpoint holds (a rank may hold only some of them)."""

    payload: dict[str, Any]
    model: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    legacy_optimizers: list[dict[str, Any]] | None = None
    saved_model_keys: set[str] = field(default_factory=set)
    in_place: bool = False

    @classmethod
    def from_full(cls, state: dict[str, Any]) -> Loaded:
        model = strip_wrapper_prefix(state.get("model", {}))
        return cls({k: v for k, v in state.items() if k not in TENSOR_KEYS}, model, state.get("optimizer"),
                   state.get("optimizers"), set(model))


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """The whole model as plain CPU tensors under single-device names, on rank 0 (others get ``{}``
    for a sharded model). A collective when parameters are ``DTensor`` s: every rank calls it."""
    sd = lazy.dcp().state_dict
    return sd.get_model_state_dict(module,
                                   options=sd.StateDictOptions(full_state_dict=True, cpu_offload=True))


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
    return (plain_tensors(lazy.dcp().state_dict.get_model_state_dict(part, options=_options())),
            plain_tensors(optimizer_state(part, optimizers)))


def plain_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor that a library wraps in a subclass of its own (torchao's float8 weights
    under FSDP's float8 all-gather) replaced by the plain tensor inside it, which shares its storage: a
    checkpoint then holds plain tensors only and loads where that library is not imported, and a sharded
    load into these tensors fills the wrapped ones. A ``DTensor`` keeps its layout around its plain shard."""
    return {key: _plain(value) for key, value in state.items()}


def _plain(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, nn.Parameter):
        return value
    DTensor = lazy.dtensor().DTensor
    if isinstance(value, DTensor):
        local = value.to_local()
        plain = _plain(local)
        if plain is local:
            return value
        return DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    inner = _wrapped(value)
    return value if inner is None else _plain(inner)


def _wrapped(value: torch.Tensor) -> torch.Tensor | None:
    """The one tensor a wrapper subclass holds, of its own shape and dtype (None: not such a wrapper: a
    float8 tensor's data and scale are not the value it stands for)."""
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is None:
        return None
    names, _ = flatten()
    if len(names) != 1:
        return None
    inner = getattr(value, names[0])
    if not isinstance(inner, torch.Tensor) or inner.shape != value.shape or inner.dtype != value.dtype:
        return None
    return inner


def live_state(parts: Parts, states: list[tuple[dict, dict]] | None = None) -> dict[str, Any]:
    """Each rank's own slices of the model and optimizer state (no communication), keyed as on one device:
    what a sharded directory holds, and what it is read back into. ``states``: the parts' ``part_state``
    when the caller has them already."""
    states = states if states is not None else [part_state(part, optimizers) for part, optimizers in parts]
    state = {"model": {k: v for m, _ in states for k, v in m.items()}}
    optim = {k: v for _, o in states for k, v in o.items()}
    if optim:
        state["optimizer"] = optim
    return state


def optimizer_state(part: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """``optimizers``' state, flattened and keyed by parameter name within ``part``."""
    if not optimizers:
        return {}
    # torch creates missing optimizer state with a zero-lr step; a saved run must not keep it
    # (Adam's step count would be off by one), so such optimizers get their empty state back. Cleared in
    # place: loading a state dict would give them new param_groups under whatever holds the old ones.
    fresh = [opt for opt in optimizers if not opt.state]
    optim = lazy.dcp().state_dict.get_optimizer_state_dict(part, optimizers, options=_options())
    for opt in fresh:
        opt.state.clear()
    return optim


def set_part_state(part: nn.Module, optimizers: list[torch.optim.Optimizer], model: dict,
                   optim: dict) -> None:
    sd = lazy.dcp().state_dict
    sd.set_model_state_dict(part, model, options=_options())
    if optimizers:
        sd.set_optimizer_state_dict(part, optimizers, optim, options=_options())


def full_optimizer_state(parts: Parts) -> dict[str, Any]:
    """Every optimizer's state as one flat, name-keyed dict of full tensors (replicated files).

    A collective when parameters are ``DTensor`` s (they are gathered); plain tensors are copied."""
    DTensor = lazy.dtensor().DTensor
    merged: dict[str, Any] = {}
    for part, optimizers in parts:
        if optimizers:
            optim = optimizer_state(part, optimizers)
            merged.update({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in optim.items()})
    return merged


def _like(live: Any, saved: Any, key: str) -> Any:
    """``saved`` (a full value) shaped like ``live``: this rank's shard of it for a ``DTensor``."""
    DTensor, Replicate = lazy.dtensor().DTensor, lazy.dtensor().Replicate
    if not isinstance(live, torch.Tensor):
        return saved
    if isinstance(saved, DTensor):
        return saved  # read in place into the live layout (a sharded directory)
    if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(live.shape):
        got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise CheckpointError(f"checkpoint entry {key} has shape {got} "
                              f"but the model expects {tuple(live.shape)}; "
                              f"the checkpoint was written for a different model")
    if isinstance(live, DTensor):
        # Replicate -> the live placements is a local slice on every rank: no communication.
        full = saved.to(device=live.device, dtype=live.dtype)
        whole = DTensor.from_local(full, live.device_mesh, [Replicate()] * live.device_mesh.ndim,
                                   run_check=False)
        return whole.redistribute(live.device_mesh, live.placements)
    return saved.to(device=live.device, dtype=live.dtype)


def _fill(live: dict[str, Any], saved: dict[str, Any], what: str, path: str) -> dict[str, Any]:
    missing = [k for k in live if k not in saved]
    if missing:
        raise CheckpointError(f"{path} has no {what} entry "
                              f"for {len(missing)} of {len(live)} keys this model needs, "
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


def agree_on_load(error: str | None, saved_keys: set[str], used: set[str], path: str) -> None:
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
        raise CheckpointError(f"{path} holds {len(unused)} model entries no rank's model has, "
                              f"e.g. {unused[:3]}; it was written for a different model")


def _apply_local(parts: Parts, loaded: Loaded, path: str, states: list[tuple[dict, dict]]) -> set[str]:
    used: set[str] = set()
    for (part, optimizers), (live_model, live_optim) in zip(parts, states):
        used.update(live_model)
        model = _fill(live_model, loaded.model, "model", path)
        optim: dict[str, Any] = {}
        if optimizers and (loaded.optimizer is not None or loaded.legacy_optimizers is not None):
            saved_optim = loaded.optimizer
            if saved_optim is None:
                saved_optim = _legacy_optimizer(part, optimizers, loaded.legacy_optimizers)
            optim = _fill(live_optim, saved_optim, "optimizer", path)
        elif optimizers:
            optimizers = []  # weights only (a bare state_dict): optimizers keep their fresh state
        set_part_state(part, optimizers, model, optim)
    return used


def apply_loaded(parts: Parts, loaded: Loaded, path: str,
                 states: list[tuple[dict, dict]] | None = None) -> None:
    """Load a checkpoint's model and optimizer state into ``parts``: full values are cut to each rank's
    shard, values read in place are set as they are. Every rank calls it; errors are agreed on.
    ``states``: the parts' ``part_state`` when the caller has them already (the live state read into)."""
    error, used = None, set()
    try:
        states = (states if states is not None
                  else [part_state(part, optimizers) for part, optimizers in parts])
        used = _apply_local(parts, loaded, path, states)
    except (CheckpointError, KeyError, RuntimeError, ValueError, OSError, pickle.UnpicklingError) as err:
        error = str(err) if isinstance(err, CheckpointError) else f"{path} does not fit this model: {err!r}"
    agree_on_load(error, loaded.saved_model_keys, used, path)
