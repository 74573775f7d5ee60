"""Activation checkpointing as plain functions: chosen blocks keep only their inputs in forward and
recompute the rest during backward (``torch.utils.checkpoint``, non-reentrant).

The blocks are the FSDP wrap policy's (``blocks_to_wrap``: the children of the largest
``nn.ModuleList``/``nn.Sequential`` and of the containers repeating its block, or the classes
named), so one transformer block is one
checkpointed region and one FSDP unit. Unless classes are named, the one-off layers among them
(embeddings, final norm, LM head: classes that occur once) are left out when some class repeats:
checkpointing them saves no memory (their inputs are kept anyway) and the head's recompute costs
as much as several blocks. ``parallel.apply`` applies it after tensor parallelism and before
compile and FSDP (torchtitan's order): TP -> AC -> compile -> FSDP.

A checkpointed block is not wrapped in another module: its class is swapped for a subclass of the
same name whose ``forward`` runs the original one under ``checkpoint`` (FSDP2's ``fully_shard``
does the same). Parameter names stay as they are, so state dicts, checkpoints, FSDP units and
optimizer state are the same with checkpointing on or off; ``isinstance`` and class-name matching
(``wrap_modules``) still see the user's class; a ``deepcopy`` or pickle of the block is the user's
class again (plain, with its own weights). Non-reentrant checkpointing saves the RNG state before the forward
and restores it for the recompute (CPU, and the CUDA devices its inputs are on), so dropout draws
the same masks in the recompute as in the forward, and the RNG streams after the step are those of
a run without checkpointing (tests/test_compile_ac.py checks both).
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from polytrain.core.errors import ConfigError
from polytrain.parallel.fully_shard import blocks_to_wrap

log = logging.getLogger("polytrain")

CHECKPOINTED = "_polytrain_checkpointed_from"  # on a checkpointed class: the class it was made from
NORMS = "_polytrain_checkpointed_norms"  # on a checkpointed block: its BatchNorms (see checkpoint_block)
OPTION_KEYS = ("modules", "every", "mode")
MODES = ("full", "op")


def resolve_checkpointing(spec: Any, key: str = "trainer.activation_checkpointing") -> dict[str, Any] | None:
    """The config value as ``{"modules": [class names] | None, "every": n, "mode": "full" | "op"}``, or
    None when off.

    ``true`` checkpoints every block; a class name or a list of them chooses the blocks; a mapping may
    also say ``every: n`` (every n-th block: less recompute, more memory) and ``mode: op`` (per-op
    selective: a block keeps its matmul and attention outputs and recomputes the rest, ``OpSelection``)."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return {"modules": None, "every": 1, "mode": "full"}
    if isinstance(spec, str):
        spec = [spec]
    if isinstance(spec, (list, tuple)):
        spec = {"modules": list(spec)}
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}={spec!r} is not valid; use true, a block class name or a list of them, "
                          f"or a mapping {{modules: [Block], every: 1, mode: full}}")
    unknown = sorted(set(spec) - set(OPTION_KEYS))
    if unknown:
        raise ConfigError(f"{key} has unknown key(s) {unknown}; valid: {', '.join(OPTION_KEYS)}")
    modules, every = spec.get("modules"), spec.get("every", 1)
    if isinstance(modules, str):
        modules = [modules]
    if modules is not None and not (isinstance(modules, (list, tuple)) and modules
                                    and all(isinstance(m, str) for m in modules)):
        raise ConfigError(f"{key}.modules={spec.get('modules')!r} must be a list of block class names")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"{key}.every={every!r} must be a positive integer (1: every block)")
    mode = spec.get("mode", "full")
    if mode not in MODES:
        raise ConfigError(f"{key}.mode={mode!r} is not valid; use full (a block keeps only its input) "
                          f"or op (a block also keeps its matmul and attention outputs: less recompute, "
                          f"more memory)")
    return {"modules": list(modules) if modules is not None else None, "every": every, "mode": mode}


def swap_class(module: nn.Module, marker: str, key: Any,
               forward: Callable[[type], Callable[..., Any]]) -> None:
    """Give ``module`` a subclass of its class, with the same name, whose ``forward`` is
    ``forward(original class)``; one subclass per (class, marker, key), shared by every instance.
    A pickle or ``deepcopy`` of the module is an instance of the original class (eager, its own
    weights): the subclass cannot be found by name."""
    cls = type(module)
    cache_key = (cls, marker, key)
    sub = _SUBCLASSES.get(cache_key)
    if sub is None:
        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            return copyreg._reconstructor, (_unswapped(type(self)), object, None), self.__getstate__()

        sub = _SUBCLASSES[cache_key] = type(cls.__name__, (cls,), {
            "forward": forward(cls), marker: cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__reduce_ex__": __reduce_ex__})
    module.__class__ = sub


def _unswapped(cls: type) -> type:
    """The user's class under any number of swaps."""
    while any(m in cls.__dict__ for m in _MARKERS):
        cls = cls.__bases__[0]
    return cls


_SUBCLASSES: dict[tuple[type, str, Any], type] = {}
_MARKERS = ("_polytrain_checkpointed_from", "_polytrain_compiled_from")  # CHECKPOINTED, compile.COMPILED


def kept_ops() -> frozenset[Any]:
    """Ops whose outputs a per-op checkpointed block always keeps: attention (the most FLOPs per output
    byte, and its recompute would need the matmul outputs feeding it) and sequence-parallel reduce-scatters
    (recomputing one is a second collective). Kernels absent from this torch build are skipped."""
    names = [("aten", "_scaled_dot_product_flash_attention"),
             ("aten", "_scaled_dot_product_efficient_attention"),
             ("aten", "_scaled_dot_product_cudnn_attention"),
             ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
             ("_c10d_functional", "reduce_scatter_tensor")]
    found = (getattr(getattr(torch.ops, ns), op, None) for ns, op in names)
    return frozenset(packet.default for packet in found if packet is not None)


class OpSelection:
    """What ``mode: op`` keeps of one block's forward; the rest is recomputed in backward.

    Matmuls and attention hold nearly all of a block's FLOPs; norms, activations and elementwise ops are
    cheap to recompute but their outputs are as large. Keeping the odd-numbered matmul outputs (1st, 3rd,
    ...) halves the matmul recompute for half their memory. The forward and the recompute count matmuls
    separately, so both make the same choice. The planner's profile replays this class on the meta trace,
    so what it predicts is what runs."""

    MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})

    def __init__(self) -> None:
        self.matmuls = {False: 0, True: 0}  # per pass: the forward (False) and the recompute (True)
        self.kept = kept_ops()

    def keeps(self, func: Any, recompute: bool = False) -> bool:
        if func in self.MATMULS:
            self.matmuls[recompute] += 1
            return self.matmuls[recompute] % 2 == 1
        return func in self.kept


def _op_contexts() -> Any:
    selection = OpSelection()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if selection.keeps(func, ctx.is_recompute)
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return create_selective_checkpoint_contexts(policy)


def checkpoint_block(block: nn.Module, mode: str = "full") -> None:
    """Make ``block``'s forward a non-reentrant ``torch.utils.checkpoint`` region (idempotent): ``full``
    keeps only its inputs, ``op`` also what ``OpSelection`` keeps."""
    if not hasattr(type(block), CHECKPOINTED):
        swap_class(block, CHECKPOINTED, mode, functools.partial(_checkpointed, mode=mode))
    # Not submodules (a plain list in the instance's dict): the BatchNorms whose statistics the
    # recomputation must leave as the forward left them.
    block.__dict__[NORMS] = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                             and m.track_running_stats]


def _checkpointed(cls: type, mode: str) -> Callable[..., Any]:
    inner = cls.forward
    extra = {"context_fn": _op_contexts} if mode == "op" else {}

    def once(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # the forward
            return inner(self, *args, **kwargs)
        with _running_statistics_kept(self.__dict__[NORMS]):  # the recomputation, inside backward
            return inner(self, *args, **kwargs)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(self, *args, **kwargs)  # evaluation: nothing is saved, nothing to recompute
        # Only a block with BatchNorms asks whether it is recomputed (a question torch.compile cannot trace)
        run = once if self.__dict__.get(NORMS) else inner
        return checkpoint(run, self, *args, use_reentrant=False, **extra, **kwargs)

    forward.checkpoint_mode = mode  # type: ignore[attr-defined]
    return forward


@contextlib.contextmanager
def _running_statistics_kept(norms: list[nn.Module]) -> Iterator[None]:
    """A BatchNorm in training mode updates its running statistics on every forward; recomputed, it
    would update them twice a step. The recomputation runs the same ops (checkpointing checks that it
    saves the same tensors), then its updates are undone: the statistics move once, as on one device."""
    buffers = [b for norm in norms for b in norm.buffers(recurse=False)]
    # Outside per-op checkpointing's dispatch mode: it checks the recomputation runs the forward's ops only
    with _disable_current_modes():
        kept = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with _disable_current_modes(), torch.no_grad():
            for buffer, before in zip(buffers, kept):
                buffer.copy_(before)


def checkpointing_mode(module: nn.Module) -> str | None:
    """``full`` or ``op`` for a checkpointed block, None for any other module."""
    cls = next((c for c in type(module).__mro__ if CHECKPOINTED in c.__dict__), None)
    return None if cls is None else getattr(cls.__dict__["forward"], "checkpoint_mode", "full")


def checkpoint_targets(module: nn.Module, options: dict[str, Any] | None,
                       default_modules: list[str] | None = None) -> list[nn.Module]:
    """The blocks of ``module`` that ``options`` (``resolve_checkpointing``'s result) chooses, in model
    order. When the options name no classes: the blocks of ``default_modules`` (the fsdp settings'
    ``wrap_modules``), else the wrap policy's repeated blocks; ``every: n`` keeps every n-th of them.

    A pipeline chooses on the whole model, before cutting its stages, so every rank chooses from the
    same blocks (``every`` counts over the whole model) and checkpoints those it keeps."""
    if options is None:
        return []
    names = options["modules"] if options["modules"] is not None else default_modules
    blocks = blocks_to_wrap(module, names)
    if names is None:
        blocks = repeated(blocks)
    if not blocks:
        raise ConfigError(f"activation checkpointing found no blocks in {type(module).__name__}: it has no "
                          f"nn.ModuleList/nn.Sequential of layers; name the block classes with "
                          f"activation_checkpointing: {{modules: [MyBlock]}}")
    if names is not None:
        blocks = outermost(list(reversed(blocks)))  # blocks_to_wrap lists named blocks innermost first
    every = options["every"]
    return [b for i, b in enumerate(blocks, start=1) if i % every == 0]


def apply_activation_checkpointing(module: nn.Module, options: dict[str, Any] | None,
                                   default_modules: list[str] | None = None,
                                   chosen: list[nn.Module] | None = None) -> list[nn.Module]:
    """Checkpoint the blocks ``checkpoint_targets`` chooses in ``module``, or those of ``chosen`` that
    ``module`` still holds (a pipeline rank: chosen before the cut). Returns the checkpointed blocks."""
    if options is None:
        return []
    if chosen is None:
        chosen = checkpoint_targets(module, options, default_modules)
    else:
        held = {id(m) for m in module.modules()}
        chosen = [b for b in chosen if id(b) in held]
    for block in chosen:
        checkpoint_block(block, options.get("mode", "full"))
    if chosen:
        no_key_value_cache(module)
    kinds = Counter(type(b).__name__ for b in chosen)
    log.info("activation checkpointing (%s): %d block(s) (%s)", options.get("mode", "full"), len(chosen),
             ", ".join(f"{n} x{c}" for n, c in kinds.items()))
    return chosen


def no_key_value_cache(module: nn.Module) -> None:
    """A Hugging Face model caches keys and values in forward (``config.use_cache``, on by default), and a
    checkpointed block's recomputation would add to that cache again: the recomputed attention sees twice
    the keys and torch stops the backward ("encountered during backward but not found in storage").
    Training needs no cache; turned off, as Hugging Face's own gradient checkpointing does."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            log.info("activation checkpointing: %s.config.use_cache set to False (a key/value cache filled "
                     "in forward would be filled again by the recomputation)", type(sub).__name__)


def repeated(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks whose class occurs more than once (the repeated layers), or all when none repeats."""
    counts = Counter(type(b) for b in blocks)
    kept = [b for b in blocks if counts[type(b)] > 1]
    return kept or blocks


def outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` without those nested inside another of them (a region inside a region is one region)."""
    inside = {id(d) for m in modules for d in m.modules() if d is not m}
    return [m for m in modules if id(m) not in inside]
