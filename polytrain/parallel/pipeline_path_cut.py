"""Pipeline stages cut at module paths, for models that are not one ``nn.Sequential``.

A library model (Hugging Face's GPT-2 and Llama, torchvision's ResNet and ViT) runs its own forward:
glue between its blocks (embeddings, position ids, masks, a final norm and head) that polytrain does
not rewrite. So every stage runs the user's step itself, and the cut lives in the module tree:

- Split points are module paths (``model.model.layers.4``): stage k begins at the input of split
  point k. Without split points, the model's repeated blocks (the largest run of same-class blocks in
  a ``ModuleList`` or ``Sequential``) are cut into stages of balanced parameter counts.
- A module holding parameters belongs to the stage in which it is registered: modules registered
  (``named_modules`` order) before the first split point are stage 0's, and so on. Library models
  register their modules in the order their forward runs them; where one does not, the stage that
  meets the misplaced module says so, naming it (``Elsewhere.forward``).
- A rank keeps its stages' modules. Every other module holding parameters is replaced by a stand-in
  that computes shapes only (a parameterless copy on the meta device) and returns zeros: the glue
  before a stage's first block runs for real (masks, position embeddings, whose modules hold no
  parameters and stay on every rank), while earlier stages' blocks cost nothing.
- Stage k stops the step at the input of split point k+1 and sends that first tensor argument on;
  stage k+1 runs the step again and swaps the same argument for the activation it received.
- A parameter used by modules of two stages (GPT-2's head tied to its embedding) lives on both; its
  gradients are summed over the pipeline before each step so both copies stay one parameter, as
  Megatron keeps its embedding tie.

All functions here are local (no process group): a bad cut fails before any communication.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from polytrain.parallel.fully_shard import blocks_to_wrap
from polytrain.parallel.pipeline_sequential_cut import PipelineSplitError, balance


@dataclass
class PathCut:
    """Where a model is cut and which stage each module holding parameters belongs to."""

    split_paths: list[str]
    stage_of: dict[str, int]  # module path (modules with parameters of their own) -> stage
    n_stages: int
    # Each parameter used by modules of several stages: its names and those stages.
    ties: list[tuple[list[str], list[int]]] = field(default_factory=list)

    def describe(self, module: nn.Module) -> str:
        """``stage 0: model.transformer.wte .. model.transformer.h.0 (1,234 params); ...``"""
        params = dict(module.named_modules())
        parts = []
        for stage in range(self.n_stages):
            paths = [p for p, s in self.stage_of.items() if s == stage]
            count = sum(t.numel() for p in paths for t in params[p].parameters(recurse=False))
            span = paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"
            parts.append(f"stage {stage}: {span} ({count:,} params)")
        return "; ".join(parts)


def default_split_paths(module: nn.Module, n_stages: int) -> list[str]:
    """Split points cutting the model's repeated blocks (those FSDP makes its units: a transformer's
    layers, every ResNet bottleneck) into ``n_stages`` balanced by parameters; what lies before, between
    or after the blocks weighs on the block it follows (the first block for what comes before)."""
    blocks = blocks_to_wrap(module, None)
    if len(blocks) < max(n_stages, 2):
        raise PipelineSplitError(
            f"{type(module).__name__} has no nn.Sequential child and {len(blocks)} repeated blocks (in a "
            f"ModuleList or Sequential) to cut into {n_stages} pipeline stages; name the cut with strategy "
            f"option split_points: [module.path, ...] (the first module of stages 1..{n_stages - 1}), or "
            f"lower pp or stages_per_rank")
    costs = [0] * len(blocks)
    for index, param in parameter_segments(module, segments_of(module, blocks)).values():
        costs[min(max(index - 1, 0), len(blocks) - 1)] += param.numel()  # glue: with the block beside it
    names = {id(m): name for name, m in module.named_modules()}
    return [names[id(blocks[i])] for i in balance(costs, n_stages)]


def segments_of(module: nn.Module, blocks: list[nn.Module]) -> dict[int, int]:
    """Each module (by id) -> where it lies in registration order: 0 before the first block, ``i + 1``
    inside block ``i`` or between it and the next, ``n + 1`` after the last block."""
    index_of = {id(block): i + 1 for i, block in enumerate(blocks)}
    inside = {id(m): i + 1 for i, block in enumerate(blocks) for m in block.modules()}
    in_last = {id(m) for m in blocks[-1].modules()}
    out: dict[int, int] = {}
    current, past_last = 0, False
    for sub in module.modules():
        current = index_of.get(id(sub), current)
        past_last = past_last or (current == len(blocks) and id(sub) not in in_last)
        out[id(sub)] = inside.get(id(sub), len(blocks) + 1 if past_last else current)
    return out


def parameter_segments(module: nn.Module, segments: dict[int, int]) -> dict[int, tuple[int, nn.Parameter]]:
    """Each parameter (by id, once: a tie where first registered) -> its module's segment, and itself."""
    out: dict[int, tuple[int, nn.Parameter]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            out.setdefault(id(p), (segments[id(sub)], p))
    return out


def cut_at_paths(module: nn.Module, split_paths: Sequence[str], n_stages: int) -> PathCut:
    """Check ``split_paths`` against ``module`` and assign each module holding parameters to a stage."""
    split_paths = [str(p) for p in split_paths]
    if len(split_paths) != n_stages - 1:
        raise PipelineSplitError(
            f"split_points={split_paths} give {len(split_paths) + 1} stages but the pipeline has {n_stages} "
            f"(pp x stages_per_rank); give exactly {n_stages - 1} module paths, each the first module of a "
            f"stage")
    order = [name for name, _ in module.named_modules()]
    position = {name: index for index, name in enumerate(order)}
    for path in split_paths:
        if path not in position:
            parent = path.rpartition(".")[0]
            while parent and parent not in position:
                parent = parent.rpartition(".")[0]
            children = [n for n, _ in module.get_submodule(parent).named_children()]
            hint = f"; {parent or type(module).__name__} holds {children}" if children else ""
            raise PipelineSplitError(f"split point {path!r} names no module of {type(module).__name__}{hint}")
    at = [position[p] for p in split_paths]
    if any(b <= a for a, b in zip(at, at[1:])):
        raise PipelineSplitError(f"split_points={split_paths} must follow the order the modules are "
                                 f"registered in (named_modules), each after the one before")
    nested = [(a, b) for a in split_paths for b in split_paths if b.startswith(a + ".")]
    if nested:
        raise PipelineSplitError(f"split point {nested[0][1]!r} lies inside split point {nested[0][0]!r}")
    stage_of: dict[str, int] = {}
    param_stages: dict[int, tuple[list[str], set[int]]] = {}
    for index, (name, child) in enumerate(module.named_modules()):
        own = [(n, p) for n, p in child.named_parameters(recurse=False)]
        if not own:
            continue
        stage = sum(index >= a for a in at)
        stage_of[name] = stage
        for n, p in own:
            names, stages = param_stages.setdefault(id(p), ([], set()))
            names.append(f"{name}.{n}" if name else n)
            stages.add(stage)
    empty = [s for s in range(n_stages) if s not in stage_of.values()]
    if empty:
        raise PipelineSplitError(f"split_points={split_paths} leave pipeline stage(s) {empty} without a "
                                 f"module holding parameters; move the split points apart")
    ties = [(names, sorted(stages)) for names, stages in param_stages.values() if len(stages) > 1]
    return PathCut(split_paths, stage_of, n_stages, ties)


def _subtree_stages(module: nn.Module, cut: PathCut) -> dict[str, set[int]]:
    """Each module path -> the stages of the modules holding parameters at or below it."""
    found: dict[str, set[int]] = {}
    for name, _ in module.named_modules():
        found[name] = set()
    for path, stage in cut.stage_of.items():
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            found[".".join(parts[:depth])].add(stage)
    return found


def meta_twin(child: nn.Module) -> nn.Module:
    """A copy of ``child`` on the meta device, made without copying its tensors."""
    memo: dict[int, Any] = {}
    for p in child.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in child.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(child, memo)


def keep_stages(module: nn.Module, cut: PathCut, local: set[int]) -> list[Elsewhere]:
    """Replace, in place, every largest subtree holding parameters of other stages only by an
    ``Elsewhere`` stand-in (a container's children, not the container); returns the stand-ins. Modules
    without parameters stay (glue)."""
    stages = _subtree_stages(module, cut)
    stand_ins: list[Elsewhere] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            held = stages.get(path, set())
            # A container is iterated or indexed by the model's forward (``for block in self.h``): it stays,
            # its children stand in one by one.
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
            if held and not held & local and not container:
                stand_in = Elsewhere(meta_twin(child), path, sorted(held))
                parent._modules[name] = stand_in
                stand_ins.append(stand_in)
            elif held:
                visit(path, child)

    visit("", module)
    _drop_foreign_parameters(module, cut, local)
    return stand_ins


def _drop_foreign_parameters(module: nn.Module, cut: PathCut, local: set[int]) -> None:
    """A kept container's own parameters of another stage (ViT's class token and position embedding sit
    on the model and its encoder, which hold blocks of every stage) become zeros that are no parameter:
    the glue before this stage's first split point still reads them, and what it computes from them
    is replaced there. Only the stage that owns them trains and saves them."""
    tied_here = {name for names, stages in cut.ties if set(stages) & local for name in names}
    for path, child in module.named_modules():
        stage = cut.stage_of.get(path)
        if stage is None or stage in local or isinstance(child, Elsewhere):
            continue
        for name, param in list(child.named_parameters(recurse=False)):
            if (f"{path}.{name}" if path else name) in tied_here:
                continue
            del child._parameters[name]
            child.register_buffer(name, torch.zeros_like(param, requires_grad=False), persistent=False)


# --------------------------------------------------------------------------- the pass through a stage


class ReachedSplit(Exception):  # noqa: N818 (a signal, not an error)
    """Raised at the input of the stage's end: the step went as far as this stage runs."""

    def __init__(self, activation: torch.Tensor) -> None:
        super().__init__()
        self.activation = activation


@dataclass
class StagePass:
    """One run of the user's step as stage ``stage`` (``inject``: the activation received)."""

    stage: int
    inject: torch.Tensor | None
    device: torch.device
    injected: bool = False


_local = threading.local()


def current_pass() -> StagePass | None:
    return getattr(_local, "active", None)


class running_as:
    """``with running_as(StagePass(...)):`` the stand-ins and split points act for that stage."""

    def __init__(self, stage_pass: StagePass) -> None:
        self.stage_pass = stage_pass

    def __enter__(self) -> StagePass:
        self.outer = current_pass()
        _local.active = self.stage_pass
        return self.stage_pass

    def __exit__(self, *exc: Any) -> None:
        _local.active = self.outer


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> tuple[int | str, torch.Tensor] | None:
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            return index, value
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return key, value
    return None


def add_split_hooks(module: nn.Module, cut: PathCut, local: set[int]) -> list[Any]:
    """A pre-hook on each split point next to a local stage: stage k-1 stops at split point k, stage
    k swaps in what it received. Where split point k lies inside a stand-in (a container of stage k's
    blocks, e.g. ResNet's ``layer3`` for ``layer3.0``), the stand-in takes the hook: it is called with
    what its first block would be."""
    handles = []
    for k, path in enumerate(cut.split_paths, start=1):
        if k - 1 in local or k in local:
            target = _reachable(module, path)
            handles.append(target.register_forward_pre_hook(_split_hook(k, path), with_kwargs=True))
    return handles


def _reachable(module: nn.Module, path: str) -> nn.Module:
    """The module at ``path``, or the stand-in that took its place or its container's."""
    current = module
    for part in path.split("."):
        if isinstance(current, Elsewhere):
            return current
        current = current.get_submodule(part)
    return current


def _split_hook(k: int, path: str) -> Any:
    def hook(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        stage_pass = current_pass()
        if stage_pass is None or stage_pass.stage not in (k - 1, k):
            return None
        found = _first_tensor(args, kwargs)
        if found is None:
            raise RuntimeError(f"pipeline split point {path} was called without a tensor argument: a split "
                               f"point must take the activation that flows between stages (e.g. a block's "
                               f"hidden states)")
        where, value = found
        if stage_pass.stage == k - 1:
            raise ReachedSplit(value.contiguous())  # torch's stage receives its gradient into a dense buffer
        if stage_pass.injected:
            raise RuntimeError(f"pipeline split point {path} ran twice in one step; a split point must run "
                               f"once per forward (choose a module the model calls once)")
        stage_pass.injected = True
        received = stage_pass.inject
        if received is None or received.shape != value.shape:
            got = None if received is None else tuple(received.shape)
            raise RuntimeError(f"pipeline stage {k} received {got} for split point {path}, which the step "
                               f"called with {tuple(value.shape)} here")
        if isinstance(where, int):
            return (*args[:where], received, *args[where + 1:]), kwargs
        return args, {**kwargs, where: received}

    return hook


class Elsewhere(nn.Module):
    """Stands in for a module of other pipeline stages: returns zeros shaped as its output (its meta
    twin computes the shapes), and refuses to be reached where the cut says it cannot run."""

    def __init__(self, twin: nn.Module, path: str, stages: list[int]) -> None:
        super().__init__()
        self.__dict__["twin"] = twin  # not a submodule: no parameters, no state_dict entries
        self.path, self.stages = path, stages

    def extra_repr(self) -> str:
        return f"{self.path} on pipeline stage(s) {self.stages}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stage_pass = current_pass()
        if stage_pass is None:
            raise RuntimeError(f"{self.path} lives on pipeline stage(s) {self.stages}, not on this rank; "
                               f"outside the training and evaluation steps it cannot be called here")
        if min(self.stages) > stage_pass.stage:
            raise RuntimeError(
                f"pipeline stage {stage_pass.stage} ran {self.path} (of stage {min(self.stages)}) before "
                f"reaching its own end: the model runs it earlier than it registers it, and stages are cut "
                f"in registration order. Choose split_points so that {self.path} falls in the stage that "
                f"runs it")
        if max(self.stages) < stage_pass.stage and stage_pass.injected:
            raise RuntimeError(
                f"pipeline stage {stage_pass.stage} ran {self.path} (of stage {max(self.stages)}) after its "
                f"first split point: the model runs it later than it registers it, and stages are cut in "
                f"registration order. Choose split_points so that {self.path} falls in the stage that "
                f"runs it")
        with torch.no_grad():
            meta = tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), (args, kwargs))
            out = self.twin(*meta[0], **meta[1])
        device = stage_pass.device
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), out)


class PathStage(nn.Module):
    """The module torch's ``PipelineStage`` runs for stage ``index``: it holds the stage's own modules
    (their parameters are the stage's) and its forward is ``run(index, x)``, the user's step run as
    this stage."""

    def __init__(self, index: int, held: list[nn.Module], run: Any) -> None:
        super().__init__()
        self.index = index
        self.held = nn.ModuleList(held)
        self.__dict__["run"] = run
        self.probing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.index, x, self.probing)


def held_modules(module: nn.Module, cut: PathCut, stage: int) -> list[nn.Module]:
    """The largest subtrees of the kept ``module`` (after ``keep_stages``) whose parameters are all stage
    ``stage``'s: the whole module where a rank runs one stage. A ``PathStage`` holds them, so its
    parameters are the stage's, and FSDP's root over it takes what no block unit took."""
    below: dict[str, set[int]] = {}
    for path, child in module.named_modules():
        if isinstance(child, Elsewhere) or next(child.parameters(recurse=False), None) is None:
            continue
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            below.setdefault(".".join(parts[:depth]), set()).add(cut.stage_of[path])
    held: list[nn.Module] = []

    def visit(path: str, child: nn.Module) -> None:
        stages = below.get(path, set())
        if stages == {stage}:
            held.append(child)
        elif stage in stages:
            for name, grandchild in child.named_children():
                visit(f"{path}.{name}" if path else name, grandchild)

    visit("", module)
    return held


def tied_parameters(module: nn.Module, cut: PathCut) -> Iterator[tuple[list[str], nn.Parameter | None]]:
    """Each tie across stages with this rank's copy (None where this rank holds none of its modules)."""
    for names, _ in cut.ties:
        found = None
        for name in names:
            try:
                found = module.get_parameter(name)
                break
            except AttributeError:
                continue
        yield names, found
