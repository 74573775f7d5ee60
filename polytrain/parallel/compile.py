"""``torch.compile`` as plain functions: which modules to compile, and compiling them in place.

A chosen module is not wrapped in an ``OptimizedModule``: its class is swapped for a subclass of the
same name whose ``forward`` is ``torch.compile(original forward, **options)`` (as activation
checkpointing does, and FSDP2's ``fully_shard``). So parameter names (state dicts, checkpoints,
optimizer state) do not change, and the hooks that FSDP, DDP and the user register on a module run
eagerly around its compiled region instead of being traced. ``training_step`` is never compiled:
``self.log``, the hooks and the loss bookkeeping around it would each break the graph. What is
compiled depends on how the model runs (``compile_targets``; ``parallel.apply`` picks the scope):

- ``scope="model"`` (one replica, or DDP): the ``TrainModule``'s own ``forward`` when it defines one,
  else each top-level submodule that holds parameters (``self.net``: the whole network in one graph).
  Under DDP these regions run inside DDP's forward, so dynamo's DDPOptimizer splits their graphs at
  DDP's bucket boundaries and each bucket's all-reduce overlaps the rest of backward (torch's
  recommended way to compile DDP).
- ``scope="blocks"`` (FSDP, tensor parallel, layers placement): each block of the FSDP wrap policy
  (``blocks_to_wrap``; its repeated classes, as activation checkpointing chooses), compiled after
  ``parallelize_module`` and before ``fully_shard``: one FSDP unit is one compiled region and FSDP's
  gathers stay outside it; the root's one-off layers (embeddings, head) stay eager, as in
  torchtitan. Identical blocks share one graph (dynamo caches per code object; parameters are graph
  inputs), so 12 blocks compile once.
- ``scope="stages"`` (pipeline without FSDP or tensor parallel): each of this rank's stage modules,
  after the stages are cut.
- ``modules: [ClassName, ...]`` in the options: the submodules of those classes, in any scope.

Order with the other parallelisms (torchtitan's): TP -> activation checkpointing -> compile -> FSDP.
Compilation itself happens at the first forward (and the first backward); the ``CompileTime``
callback logs how long it took.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from polytrain.core.errors import ConfigError
from polytrain.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    outermost,
    repeated,
    swap_class,
)
from polytrain.parallel.fully_shard import blocks_to_wrap

log = logging.getLogger("polytrain")

COMPILED = "_polytrain_compiled_from"  # on a compiled class: the class it was made from
POLYTRAIN_KEYS = ("modules",)
SCOPES = ("model", "blocks", "stages")


def compile_keywords() -> tuple[str, ...]:
    """The keyword arguments this torch's ``torch.compile`` accepts (``fullgraph``, ``mode``, ...)."""
    return tuple(n for n in inspect.signature(torch.compile).parameters if n != "model")


def resolve_compile(spec: Any, key: str = "trainer.compile") -> dict[str, Any] | None:
    """The config value as a dict of ``torch.compile`` keywords (plus ``modules``), or None when off.

    ``true`` compiles with torch's defaults; a mapping passes its keys to ``torch.compile`` (``mode``,
    ``fullgraph``, ``dynamic``, ``backend``, ``options``...) except ``modules``, polytrain's own: the
    class names of the submodules to compile."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}={spec!r} is not valid; use true, false, "
                          f"or a mapping of torch.compile keywords "
                          f"such as {{mode: max-autotune, fullgraph: true}}")
    valid = compile_keywords() + POLYTRAIN_KEYS
    unknown = sorted(set(spec) - set(valid))
    if unknown:
        raise ConfigError(f"{key} has unknown key(s) {unknown}; "
                          f"valid (torch {torch.__version__}'s torch.compile "
                          f"keywords, and polytrain's 'modules'): {', '.join(valid)}")
    modules = spec.get("modules")
    if isinstance(modules, str):
        modules = [modules]
    if modules is not None and not (isinstance(modules, (list, tuple)) and modules
                                    and all(isinstance(m, str) for m in modules)):
        raise ConfigError(f"{key}.modules={spec.get('modules')!r} must be a list of submodule class names")
    out = dict(spec)
    if modules is not None:
        out["modules"] = list(modules)
    return out


def _defines_forward(module: nn.Module) -> bool:
    return getattr(type(module), "forward", None) is not nn.Module.forward


def compile_targets(module: nn.Module, options: dict[str, Any], scope: str = "model",
                    wrap_modules: list[str] | None = None,
                    stages: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules whose ``forward`` to compile (see the module docstring). ``wrap_modules`` are the
    FSDP block classes, used by ``scope="blocks"`` when the options name none; ``stages`` are this
    rank's pipeline stages (``scope="stages"``)."""
    if scope not in SCOPES:
        raise ValueError(f"compile scope {scope!r}; valid: {', '.join(SCOPES)}")
    names = options.get("modules")
    if names is not None:
        return outermost(list(reversed(blocks_to_wrap(module, names))))  # model order; checks the names exist
    if scope == "stages":
        return list(stages or [])
    if scope == "blocks":
        blocks = blocks_to_wrap(module, wrap_modules)
        return blocks if wrap_modules is not None else repeated(blocks)
    if _defines_forward(module):
        return [module]
    return [child for child in module.children() if next(child.parameters(), None) is not None]


def compile_module(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Make ``module``'s forward ``torch.compile(forward, **kwargs)`` (idempotent). Every module of one
    class compiled with the same keywords shares one compiled function, so dynamo's cache (per code
    object, parameters as graph inputs) serves them all with one graph."""
    if not hasattr(type(module), COMPILED):
        swap_class(module, COMPILED, repr(sorted(kwargs.items())),
                   lambda cls: torch.compile(cls.forward, **kwargs))


def apply_compile(targets: list[nn.Module], options: dict[str, Any] | None) -> list[nn.Module]:
    """Compile each of ``targets`` with ``options`` (``resolve_compile``'s result; None: nothing)."""
    if options is None:
        return []
    kwargs = {k: v for k, v in options.items() if k not in POLYTRAIN_KEYS}
    if not targets:
        log.warning("torch.compile: nothing to compile (no submodule holds parameters); "
                    "name the classes with compile: {modules: [MyBlock]}")
        return []
    for target in targets:
        compile_module(target, kwargs)
    kinds = Counter(type(t).__name__ for t in targets)
    log.info("torch.compile: %d module(s) (%s)%s; compiled at the first step", len(targets),
             ", ".join(f"{n} x{c}" for n, c in kinds.items()), f" with {kwargs}" if kwargs else "")
    return list(targets)


def checkpoint_and_compile(module: nn.Module, checkpointing: dict[str, Any] | None,
                           compile_options: dict[str, Any] | None, scope: str = "model") -> None:
    """Activation checkpointing, then compile, for the strategies outside the device mesh (``dp``,
    ``model_parallel`` layers mode); ``parallel.apply`` runs the same two steps in its own order."""
    apply_activation_checkpointing(module, checkpointing)
    if compile_options is not None:
        apply_compile(compile_targets(module, compile_options, scope), compile_options)
