"""What the planner knows about a model: measured on the meta device, one child of its Sequential at a time.

Nothing here allocates memory for weights or activations: the model lives on ``meta`` (a 405B model
profiles on a laptop). For each child of the pipelined ``nn.Sequential`` we run its forward on a meta
batch of ONE sample and record

- its parameters (``numel``), and how many of them sit in modules the tensor-parallel plan splits;
- the bytes autograd saves for backward (``saved_tensors_hooks``; parameters and storages an earlier
  child saved excluded, each storage counted once; the child's input counts when the child saves it, as
  a block's norm does): the activation memory of one sample without checkpointing;
- the bytes of its input (what activation checkpointing keeps) and output (what a pipeline sends);
- what per-op checkpointing (``mode: op``) would keep of it, and the FLOPs it would recompute: the
  strategy's own ``OpSelection`` replayed on the trace;
- its forward FLOPs (``torch.utils.flop_counter``), of those the matmuls of its ``nn.Linear`` layers
  (what float8 training speeds up; attention, norms and elementwise stay in bf16) and of the layers the
  plan splits (what async TP overlaps its collectives with), and the bytes tensor parallelism
  all-reduces in forward (the outputs of row-parallel layers).

Tensor parallelism is simulated, not modelled: for degree ``tp`` the planned ``nn.Linear`` layers are
shrunk to their local shard (column-parallel: ``out_features / tp``; row-parallel: ``in_features / tp``)
before the trace, so the attention and MLP between them run on the shapes one TP rank really sees (a
forward that derives its head count from the tensor, as tensor parallelism requires anyway, just works).
Under a plan with ``SequenceParallel`` entries, what those modules save and each block's input are
sharded over the sequence: they count ``1/tp``.

Mixed precision (``16-mixed``, ``bf16-mixed``) is traced as autocast runs it, by torch's own autocast:
autocast's dispatch keys follow a tensor's device, and meta has none (``F.linear`` on meta tensors stays
fp32 inside ``torch.autocast``), so the trace runs on fake tensors (``FakeTensorMode``: meta storage, a
CPU or CUDA device, no GPU needed) under the device's autocast. Matmuls, convolutions and attention then
save their inputs' casts in the compute dtype, the ops on autocast's fp32 list save fp32, and the cast of
each weight (autocast's cache, kept for backward) counts where it is first saved. A model whose
parameters are built in the compute dtype is traced as built, on meta: it stands for a run with bf16
parameters and no autocast (torchtitan's).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from polytrain.core import lazy
from polytrain.core.batch import map_tensors, tensors_in
from polytrain.core.errors import ConfigError
from polytrain.parallel.activation_checkpointing import OpSelection
from polytrain.parallel.expert_parallel import (
    ExpertLayer,
    ExpertParallelPlanError,
    check_expert_degree,
    expert_layers,
    expert_plan,
)
from polytrain.parallel.fully_shard import blocks_to_wrap
from polytrain.parallel.pipeline_path_cut import parameter_segments, segments_of
from polytrain.parallel.tensor_parallel import resolve_key


@dataclass(frozen=True)
class ChildProfile:
    """One child of the Sequential at one tensor-parallel degree, per sample (micro-batch of 1)."""

    name: str
    kind: str  # class name: repeated kinds are the checkpointed blocks
    params: int  # every parameter, whole
    tp_params: int  # of those, in layers the plan splits (a rank holds 1/tp of them)
    saved_bytes: int  # autograd-saved activations, no checkpointing
    input_bytes: int  # kept by activation checkpointing
    output_bytes: int  # sent to the next pipeline stage
    flops: int  # forward
    tp_allreduce_bytes: int  # forward all-reduce payload (row-parallel outputs); backward has as much again
    # Defaults keep hand-built profiles (tests) short; the trace fills them in.
    linear_flops: int = 0  # of ``flops``, the matmuls of nn.Linear layers (2 x rows x in x out each)
    tp_linear_flops: int = 0  # of those, in the Linear layers the plan splits (this rank's shard)
    linear_params: int = 0  # weights of its nn.Linear layers as one TP rank holds them (float8 gathers these)
    # Elements its nn.Linear layers read and write, per sample, as one TP rank holds them (float8 casts
    # each input, and each output's gradient, to float8)
    linear_inputs: int = 0
    linear_outputs: int = 0
    # Its TP collectives are reduce-scatter + all-gather (a SequenceParallel plan)
    sequence_parallel: bool = False
    # Per-op checkpointing (activation_checkpointing mode op, ``OpSelection`` replayed on the trace):
    op_kept_bytes: int = 0  # the outputs it keeps (beyond the child's input)
    op_recompute_flops: int = 0  # forward FLOPs of the ops it recomputes
    op_recompute_matmul_flops: int = 0  # of those, matmuls (mm/addmm: Linear layers, float8 under float8)
    # The largest FSDP unit inside it, as one TP rank holds it; 0: the child is one unit. A model profiled
    # whole is sharded block by block (``blocks_to_wrap``), the rest in the root unit.
    fsdp_unit_params: int = 0
    # Backward's transients (estimate.py): the most bytes its backward has allocated at once, per sample,
    # beside what forward saved (less what it has freed by then): the gradients it makes and their
    # temporaries (with a loss: the logits' gradient and log-softmax's, two tensors as large as the logits),
    # measured by running that backward on meta (``_backward_peak``; where it is not run, a CUDA
    # mixed-precision trace, its largest saved activation, whose gradient backward makes); and its largest
    # parameter as one TP rank holds it (a fresh gradient before it is added into the kept one).
    backward_bytes: int = 0
    largest_param: int = 0
    # Under autocast: the casts of its weights it saves (autocast's cache, kept for backward), per
    # micro-batch: they do not grow with the batch. Not in ``saved_bytes``.
    cast_bytes: int = 0
    # Expert parallel (``Experts``): of ``params``, those in expert tensors (the expert on dim 0), which
    # ``ep`` splits and tensor parallelism leaves whole; the experts modules it holds; the bytes of the
    # (token, chosen expert) rows its experts modules receive, per sample (what each all-to-all of ep moves
    # before the (ep-1)/ep share that leaves the rank), measured on the trace; and, with
    # ``fsdp_unit_params``, the expert parameters inside that largest unit.
    expert_params: int = 0
    expert_modules: int = 0
    dispatch_bytes: int = 0
    fsdp_unit_experts: int = 0


@dataclass(frozen=True)
class ModelProfile:
    """Every child at one tensor-parallel degree; ``seq_len`` is the token count of one sample (or 1)."""

    tp: int
    children: tuple[ChildProfile, ...]
    seq_len: int
    param_bytes: int  # bytes per parameter as trained (4 for fp32; 2 for bf16-true or a model built in bf16)
    ties: tuple[tuple[int, int], ...] = ()  # (first, later) child indices sharing a parameter
    # Set when the model has no Sequential to cut: it is profiled whole, through its training_step, as
    # one child, and this says why (the pipeline strategy's own words, for the layouts it rules out).
    whole: str | None = None
    # Why no pipeline runs this model, however it is cut (a step driving its own optimizers), or None
    pipeline_refused: str | None = None
    # A model profiled block by block (``profile_blocks``: no Sequential, repeated blocks): the child
    # ranges a pipeline cannot cut inside (the glue before the first block goes with it, the glue after
    # the last likewise), and its ties span stages (each stage keeps a copy; gradients summed).
    units: tuple[tuple[int, int], ...] = ()
    # With ``units``: each tie's size, held again by a stage that holds the tie but not its first child
    tied_params: tuple[int, ...] = ()
    # The training precision the trace ran as (a mixed one under autocast, unless the model is built in
    # the compute dtype) and the device type whose autocast rules it followed
    precision: str = "32"
    device: str = "cuda"
    # Expert parallel: (path, num_experts) of each experts module the model's expert-parallel plan names;
    # empty for a model without experts, and then ``experts_refused`` says why (the strategy's words).
    experts: tuple[tuple[str, int], ...] = ()
    experts_refused: str | None = None
    top_k: int = 0  # experts a token is routed to, as the trace saw it (0: no experts)

    @property
    def params(self) -> int:
        return sum(c.params for c in self.children)

    @property
    def expert_counts(self) -> tuple[int, ...]:
        """The distinct expert counts of its experts modules (an ``ep`` must divide each)."""
        return tuple(sorted({count for _, count in self.experts}))

    def expert_refusal(self, ep: int, dp: int) -> str | None:
        """Why the strategy refuses ``ep`` on this model with ``dp`` data-parallel ranks, in its words, or
        None."""
        if ep == 1:
            return None
        if not self.experts:
            return self.experts_refused or (f"ep={ep}: the planner found no experts module in the part of "
                                            f"the model it costs; train it with ep=1")
        layers = [ExpertLayer(path, nn.Module(), count) for path, count in self.experts]
        try:
            check_expert_degree(layers, ep, dp)
        except ExpertParallelPlanError as err:
            return str(err)
        return None


@dataclass(frozen=True)
class Experts:
    """The experts modules of a model (paths relative to the module profiled, as its expert-parallel plan
    names them), each with its expert count and the parameters of its tensors split on the expert dim; or,
    for a model that has none (or a plan the strategy refuses), why ``ep > 1`` cannot run it."""

    paths: tuple[str, ...] = ()
    counts: tuple[int, ...] = ()
    params: tuple[int, ...] = ()
    refused: str | None = None

    def of(self, prefix: str) -> list[tuple[str, int]]:
        """(path relative to ``prefix``, expert parameters) of the experts modules under ``prefix``."""
        if not prefix:
            return list(zip(self.paths, self.params))
        return [(path[len(prefix) + 1:], n) for path, n in zip(self.paths, self.params)
                if path.startswith(f"{prefix}.")]


def find_experts(module: nn.Module) -> Experts:
    """The experts modules ``module``'s expert-parallel plan names (``expert_parallel``'s reading of a
    Hugging Face MoE model's ``_ep_plan`` or of ``expert_parallel_plan()``), as the strategy reads them."""
    try:
        layers = expert_layers(module, expert_plan(module))
    except ExpertParallelPlanError as err:
        return Experts(refused=str(err))
    params = [sum(layer.module._parameters[name].numel() for name in layer.tensors) for layer in layers]
    return Experts(paths=tuple(layer.path for layer in layers),
                   counts=tuple(layer.num_experts for layer in layers), params=tuple(params))


class _Dispatched:
    """Per experts module (by path), the bytes of the (token, chosen expert) rows it is called with: under
    ep each row goes to the rank holding its expert. Experts modules are called as ``experts(hidden_states,
    top_k_index, top_k_weights)`` (``expert_parallel``'s contract); also the ``k`` of ``top_k_index``."""

    def __init__(self, root: nn.Module, paths: list[str]) -> None:
        self.sent: dict[str, int] = {}
        self.top_k = 0
        self.handles = [root.get_submodule(path).register_forward_pre_hook(
            functools.partial(self._count, path), with_kwargs=True) for path in paths]

    def _count(self, path: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden, ids = [*args, *kwargs.values()][:2]
        self.sent[path] = self.sent.get(path, 0) + ids.numel() * hidden.shape[-1] * hidden.element_size()
        self.top_k = max(self.top_k, ids.shape[-1] if ids.dim() else 1)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# A column-parallel layer whose output every rank needs whole (a Hugging Face LM head's
# ``colwise_gather_output``): each rank computes its shard, then the shards are all-gathered.
COLWISE_GATHERED = "ColwiseParallel, output gathered"
SPLIT_STYLES = ("ColwiseParallel", COLWISE_GATHERED, "RowwiseParallel")


def style_names(plan: dict[str, Any] | None) -> dict[str, str]:
    """Plan key -> style class name (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ...;
    ``COLWISE_GATHERED`` for a column-parallel layer with a replicated output)."""
    return {key: _style_name(style) for key, style in (plan or {}).items()}


def _style_name(style: Any) -> str:
    name = type(style).__name__
    output = getattr(style, "output_layouts", None)
    if name == "ColwiseParallel" and output and output[0] is not None and output[0].is_replicate():
        return COLWISE_GATHERED
    return name


def _planned_modules(root: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name (relative to ``root``) -> style name, plan keys resolved with ``fnmatch`` per part."""
    found: dict[str, str] = {}
    for key, style in plan.items():
        for name in resolve_key(root, key):
            found[name] = style
    return found


def _shrink(linear: nn.Module, style: str, tp: int, name: str) -> None:
    """Replace a planned Linear's weights by the shard one TP rank holds (meta tensors)."""
    if not isinstance(linear, nn.Linear) or style not in SPLIT_STYLES:
        return  # embeddings, norms and custom styles keep their shape: their outputs are replicated
    out_f, in_f = linear.weight.shape
    colwise = style != "RowwiseParallel"
    dim = out_f if colwise else in_f
    if dim % tp:
        raise ConfigError(f"tp={tp} does not divide {name} ({style}): {'out' if colwise else 'in'}"
                          f"_features={dim}; choose a tp that divides it")
    shape = (out_f // tp, in_f) if colwise else (out_f, in_f // tp)
    linear.weight = nn.Parameter(torch.empty(shape, device="meta", dtype=linear.weight.dtype))
    if linear.bias is not None and colwise:
        linear.bias = nn.Parameter(torch.empty(out_f // tp, device="meta", dtype=linear.bias.dtype))


# The training precisions traced under autocast, and its compute dtype
AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
# Whose autocast rules a mixed-precision trace follows (they differ: CUDA runs layer_norm in fp32, CPU in
# the compute dtype)
TRACE_DEVICES = ("cuda", "cpu")


class _AsRun:
    """Where a profile's trace runs: on meta, as built (``precision`` 32, or a model built in the compute
    dtype); under bf16-true on meta too, on a copy converted to bf16; under a mixed precision, on fake
    tensors of ``device`` inside its autocast, so that torch's own autocast picks each op's dtype as in
    training. ``module`` and ``value`` give the trace's
    copy of a module and of its inputs; the trace runs inside ``with``."""

    def __init__(self, precision: str, device: str, module: nn.Module) -> None:
        if device not in TRACE_DEVICES:
            raise ConfigError(f"trace device '{device}' is not one of: {', '.join(TRACE_DEVICES)}")
        dtype = AUTOCAST_DTYPES.get(precision)
        built = {p.dtype for p in module.parameters() if p.is_floating_point()}
        self.dtype = dtype if dtype is not None and built - {dtype} else None
        # bf16-true trains the model converted to bf16 (``Precision.convert_module``) on inputs cast to
        # it: the trace runs on such a copy (on meta, no autocast)
        self.convert = torch.bfloat16 if precision == "bf16-true" and built - {torch.bfloat16} else None
        self.device_type = device
        # An explicit index: a fake CUDA tensor without one asks CUDA for its current device
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.mode = FakeTensorMode()
        self._stack = contextlib.ExitStack()
        self.params: set[int] = set()  # the trace's parameter storages
        self.casts: set[int] = set()  # storages of their casts, made by autocast during the trace

    def lift(self, t: Any) -> Any:
        """A tensor as a fake one of the trace's device (its shape, dtype, strides; no data); under
        bf16-true, a floating-point input as the precision casts it."""
        if self.convert is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(self.convert)
        if self.dtype is None or not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor):
            return t
        with unset_fake_temporarily():  # the meta copy is made outside the fake mode, as its element
            return FakeTensor(self.mode, t.detach().to("meta"), self.device)

    def value(self, value: Any) -> Any:
        """``value`` (a batch of any structure ``map_tensors`` walks) with each tensor lifted."""
        return map_tensors(value, self.lift)

    def module(self, module: nn.Module) -> nn.Module:
        """A copy of ``module`` with fake parameters and buffers (a parameter two modules share stays
        shared); under bf16-true a copy converted to bf16; ``module`` itself when the trace runs on meta as
        built."""
        if self.convert is not None:
            return copy.deepcopy(module).to(self.convert)
        if self.dtype is None:
            return module
        module = copy.deepcopy(module)
        lifted: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is not None:
                    if id(p) not in lifted:
                        lifted[id(p)] = nn.Parameter(self.lift(p), requires_grad=p.requires_grad)
                    sub._parameters[name] = lifted[id(p)]
            for name, b in sub._buffers.items():
                if b is not None:
                    sub._buffers[name] = self.lift(b)
        self.params = _storages(module.parameters())
        return module

    def __enter__(self) -> _AsRun:
        self._stack.enter_context(_one_sample_batch_norm())
        if self.dtype is not None:
            self._stack.enter_context(self.mode)
            self._stack.enter_context(_Lifted(self))
            self._stack.enter_context(_autocast(self.device_type, self.dtype))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


@contextlib.contextmanager
def _one_sample_batch_norm() -> Iterator[None]:
    """The trace runs one sample, and a BatchNorm whose input then holds one value per channel (a ResNet's
    last stage on 32x32 pictures is 1x1) has no batch variance to normalise by: torch refuses it. There it
    normalises by its running statistics for the trace, which saves the same tensors for backward as
    training's batch statistics (its input; per-channel vectors apart). ``nn.BatchNorm*`` look up
    ``F.batch_norm`` at each call."""
    batch_norm = F.batch_norm

    def per_sample(input: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                   weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
        if training and running_mean is not None and input.dim() > 1 and input.numel() == input.shape[1]:
            training = False
        return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)

    F.batch_norm = per_sample
    try:
        yield
    finally:
        F.batch_norm = batch_norm


class _Lifted(TorchDispatchMode):
    """Lifts the tensors a fake trace meets that are not fake yet (a loss's target, a tensor a module keeps
    outside its parameters and buffers, both on meta) to the trace's device, as they would be in training."""

    def __init__(self, run: _AsRun) -> None:
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = self.run.value((args, kwargs or {}))
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in self.run.params:
            self.run.casts.add(out.untyped_storage()._cdata)  # a weight's cast: one per step, not per sample
        return out


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """What ``torch.autocast(device_type, dtype)`` sets on entry and undoes on exit (its weight-cast cache
    included, cleared when the outermost region ends), without its check that the device exists:
    ``torch.autocast("cuda")`` turns itself off where CUDA is not available, and a plan for GPUs is made on
    any machine. Only fake tensors of that device run under it here."""
    enabled, before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(True)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, before)
        torch.set_autocast_cache_enabled(cache)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class _SavedCounter:
    """Counts the bytes autograd saves, each storage once: ``seen`` (parameters, what earlier children
    saved) is shared and grows, so a storage two children save counts with the first."""

    def __init__(self, seen: set[int], casts: set[int] | None = None) -> None:
        self.seen = seen
        self.casts = casts if casts is not None else set()
        self.total = 0
        self.cast_total = 0  # of autocast's weight casts (``casts``), not in ``total``
        self.sharded = 0  # saved while inside a SequenceParallel module
        self.in_sp = 0
        self.largest = 0  # the largest storage it saved (backward's stand-in where it cannot run)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key in self.casts and key not in self.seen:
            self.seen.add(key)
            self.cast_total += t.untyped_storage().nbytes()
        elif key not in self.seen:
            self.seen.add(key)
            size = t.untyped_storage().nbytes()
            self.total += size
            self.largest = max(self.largest, size)
            # Backward frees what forward saved as it goes: the measured backward counts it (_Allocations)
            weakref.finalize(t.untyped_storage(), _saved_freed, key, size)
            self.sharded += size if self.in_sp else 0
        return t


@dataclass
class _Traced:
    out: Any
    saved: int  # bytes, as one TP rank holds them
    flops: int
    reduced: int  # row-parallel output bytes (all-reduced)
    linear_flops: int = 0
    tp_linear_flops: int = 0
    linear_inputs: int = 0
    linear_outputs: int = 0
    op_kept: int = 0
    op_recompute: int = 0
    op_recompute_matmul: int = 0
    backward: int = 0  # the peak bytes its backward allocates (``_backward_peak``)
    largest: int = 0  # bytes of the largest activation it saved
    casts: int = 0  # bytes of the weight casts it saved (autocast)


def _largest_param(module: nn.Module) -> int:
    return max((p.numel() for p in module.parameters()), default=0)


class _OpSelectionReplay(TorchDispatchMode):
    """Replays ``OpSelection`` (what ``mode: op`` checkpointing keeps) on a child's forward: the bytes of
    the outputs it keeps and the FLOPs (``flop_counter``'s formulas) of the ops it would recompute."""

    def __init__(self, traced: _Traced) -> None:
        super().__init__()
        self.selection, self.traced = OpSelection(), traced
        self.registry = lazy.flop_counter().flop_registry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.selection.keeps(func):
            self.traced.op_kept += _nbytes(out)
        else:
            formula = self.registry.get(func._overloadpacket)
            n = formula(*args, **kwargs, out_val=out) if formula is not None else 0
            self.traced.op_recompute += n
            self.traced.op_recompute_matmul += n if func in OpSelection.MATMULS else 0
        return out


def _linear_hooks(child: nn.Module, planned: dict[str, str], traced: _Traced) -> list[Any]:
    """Count each nn.Linear's matmul FLOPs from its (already shrunk) weight: 2 x rows x in x out, the
    count ``flop_counter`` gives its mm/addmm (a bias add is not a matmul)."""
    handles = []
    for name, sub in child.named_modules():
        if isinstance(sub, nn.Linear):
            split = planned.get(name) in SPLIT_STYLES

            def hook(m: nn.Module, i: Any, o: Any, split: bool = split) -> None:
                n = 2 * (i[0].numel() // m.weight.shape[1]) * m.weight.numel()  # in_features is not shrunk
                traced.linear_flops += n
                traced.tp_linear_flops += n if split else 0
                traced.linear_inputs += i[0].numel()
                traced.linear_outputs += o.numel()
            handles.append(sub.register_forward_hook(hook))
    return handles


# The _Allocations measuring now: a saved tensor freed while one is active is counted there
_MEASURING: list[_Allocations] = []


def _saved_freed(key: int, nbytes: int) -> None:
    for allocations in _MEASURING:
        allocations.events.append((key, -nbytes))


class _Allocations(TorchDispatchMode):
    """The storages ops make while it is active, in order, and when each is freed (a weakref on the
    storage fires when the last tensor on it goes), with the saved tensors backward frees as it goes
    (``_SavedCounter`` registered them): what a backward allocates beyond what forward saved, on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (storage, +bytes when made, -bytes when freed)
        self.alive: set[int] = set()

    def __enter__(self) -> _Allocations:
        _MEASURING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _MEASURING.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in given or key in self.alive:  # a view, or an in-place op's result: nothing new
                continue
            self.alive.add(key)
            self.events.append((key, storage.nbytes()))
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.events.append((key, -nbytes))

    def peak(self, leaving_out: set[int]) -> int:
        """The most bytes alive at once beyond what was alive before, ``leaving_out`` some storages
        (gradients counted elsewhere): saved tensors freed early make room for what comes after."""
        live = top = 0
        for key, nbytes in self.events:
            if key not in leaving_out:
                live += nbytes
                top = max(top, live)
        return top


def _backward_peak(run: _AsRun, output: Any, inputs: list[torch.Tensor], incoming: Any = None,
                   parameters: bool = False) -> tuple[int | None, Any]:
    """Run the backward from ``output`` to ``inputs`` on meta (inside ``run``), as training does (outside
    autocast), from the gradient arriving (``incoming``; a scalar loss's when None): the most bytes it has
    allocated at once, and the gradients of ``inputs`` (what arrives at the child before). The arriving
    gradient is not counted: a block's residual passes it on, and autograd adds the branch's gradient into
    it in place (the trace, holding it, makes a new sum instead, which it counts). With ``parameters`` the
    inputs are parameters: their gradients are counted elsewhere (``grads``, and one fresh gradient in
    ``_transients``), so they are left out of the peak, though the temporaries that make them are not.

    None for fake CUDA tensors (a CUDA mixed-precision trace): autograd's engine asks their device for its
    context, which fails on a machine with no CUDA device and would make one on a machine with a GPU (on GPU
    0, from every rank that plans). A plan is the same wherever it is made, so it is never run there."""
    outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    if not outs or not wanted:
        return 0, None
    if any(t.device.type == "cuda" for t in outs):
        return None, None
    if incoming is None:
        incoming = [torch.empty_like(t) if t.dim() else None for t in outs]
    elif isinstance(incoming, torch.Tensor):
        incoming = [incoming]
    outside_autocast = (torch.autocast(run.device_type, enabled=False) if run.dtype is not None
                        else contextlib.nullcontext())
    with outside_autocast, _Allocations() as made:
        grads = torch.autograd.grad(outs, wanted, incoming, allow_unused=True)
    leaving_out = {g.untyped_storage()._cdata for g in grads if g is not None} if parameters else set()
    return made.peak(leaving_out), grads[0] if len(grads) == 1 else grads


def _gathered(shard: torch.Tensor, tp: int) -> torch.Tensor:
    """A column-parallel layer's output as the all-gather returns it: ``tp`` shards side by side. It stays in
    the autograd graph (what consumes it, a loss over the whole vocabulary, saves its tensors as in training;
    a fresh empty tensor would cut the graph and drop them); ``cat`` itself saves nothing."""
    return torch.cat([shard] * tp, dim=-1)


def _trace_child(child: nn.Module, x: Any, planned: dict[str, str], tp: int, seen: set[int],
                 casts: set[int] | None = None) -> _Traced:
    """Run one child on meta: its output, saved bytes, FLOPs (all, Linear, split Linear), all-reduce bytes.
    ``casts``: the storages of autocast's weight casts (filled as the trace makes them)."""
    counter = _SavedCounter(seen, casts)
    reduced = [0]
    traced = _Traced(None, 0, 0, 0)
    handles = _linear_hooks(child, planned, traced)

    def count_reduced(m: nn.Module, i: Any, o: torch.Tensor) -> None:
        reduced[0] += _nbytes(o)

    def enter_sequence_parallel(m: nn.Module, i: Any) -> None:
        counter.in_sp += 1

    def leave_sequence_parallel(m: nn.Module, i: Any, o: Any) -> None:
        counter.in_sp -= 1

    for name, style in planned.items():
        sub = child.get_submodule(name)
        if style == "RowwiseParallel":
            handles.append(sub.register_forward_hook(count_reduced))
        elif style == COLWISE_GATHERED and tp > 1:
            def gather(m: nn.Module, i: Any, o: torch.Tensor) -> torch.Tensor:
                whole = _gathered(o, tp)
                reduced[0] += _nbytes(whole)  # counted as an all-reduce's payload: an upper bound
                return whole
            handles.append(sub.register_forward_hook(gather))
        elif style == "SequenceParallel":
            handles.append(sub.register_forward_pre_hook(enter_sequence_parallel))
            handles.append(sub.register_forward_hook(leave_sequence_parallel))
    flops = lazy.flop_counter().FlopCounterMode(display=False)
    saved = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
    try:
        with saved, flops, _OpSelectionReplay(traced):
            out = child(x)
    finally:
        for h in handles:
            h.remove()
    traced.out, traced.flops, traced.reduced = out, flops.get_total_flops(), reduced[0]
    traced.saved = counter.total - counter.sharded + math.ceil(counter.sharded / tp)
    traced.largest, traced.casts = counter.largest, counter.cast_total
    return traced


def _param_counts(name: str, child: nn.Module, planned: dict[str, str], counted: set[int]) -> tuple[int, int]:
    """(parameters in layers the plan splits, the rest) of one child. A shared parameter counts once,
    in the first child holding it (``counted`` holds those of the children before), as the pipeline
    strategy weighs children and as a tied embedding and head are stored: once."""
    def relative(key: str) -> str | None:  # the planned module's name inside ``child``, or None: outside it
        if not name:  # ``child`` is the whole model: the plan's keys are its own
            return key
        return key[len(name) + 1:] if key == name or key.startswith(f"{name}.") else None

    split = {id(p) for n, s in planned.items() if s in SPLIT_STYLES and relative(n) is not None
             for p in child.get_submodule(relative(n)).parameters()}
    unique = {id(p): p for p in child.parameters() if id(p) not in counted}
    counted.update(unique)
    return (sum(p.numel() for i, p in unique.items() if i in split),
            sum(p.numel() for i, p in unique.items() if i not in split))


def _ties(seq: nn.Sequential) -> tuple[tuple[int, int], ...]:
    """(first holder, later holder) child indices of every parameter two children share."""
    first: dict[int, int] = {}
    ties: set[tuple[int, int]] = set()
    for index, child in enumerate(seq.children()):
        for p in child.parameters():
            holder = first.setdefault(id(p), index)
            if holder != index:
                ties.add((holder, index))
    return tuple(sorted(ties))


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def _flash_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as the flash kernel runs it (CUDA bf16; CPU, fp32 included): saves
    q, k, v, the output and the log-sum-exp, never the (s x s) matrix the math kernel (meta's) would save."""
    if attn_mask is not None:
        raise ConfigError("the planner's flash-attention trace does not take attn_mask; plan with "
                          "--attention math")
    kind = q.device.type
    if kind in TRACE_DEVICES and torch.is_autocast_enabled(kind):
        # SDPA is on autocast's lower-precision list (CUDA and CPU): the stand-in casts as autocast would
        dtype = torch.get_autocast_dtype(kind)
        q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
    if k.shape[1] != q.shape[1]:  # grouped-query attention: flash wants as many k/v heads as q heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


ATTENTION_KERNELS = ("flash", "math", "cpu")


def _cpu_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False,
              math_kernel: Callable[..., torch.Tensor] = F.scaled_dot_product_attention) -> torch.Tensor:
    """Torch's pick on CPU: the flash kernel, but the math kernel (the ``s x s`` matrices, the dropout mask)
    under dropout, which the CPU flash kernel does not take. (On CUDA flash takes dropout too.)"""
    if dropout_p > 0:
        return math_kernel(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return _flash_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def _autocast_off(device_type: str) -> Iterator[None]:
    """Autocast of ``device_type`` off inside, as it was after (``_autocast``'s way: no device check)."""
    enabled = torch.is_autocast_enabled(device_type)
    torch.set_autocast_enabled(device_type, False)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, enabled)


def _grouped_mm(original: Callable[..., torch.Tensor], mat_a: torch.Tensor, mat_b: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
    """A grouped matmul of rows ``(S, in)`` by experts ``(E, in, out)`` (a mixture-of-experts layer's
    experts, each row through the expert ``offs`` assigns it: Hugging Face's ``grouped_mm`` experts) as the
    trace runs it: meta's ``grouped_mm`` takes bf16 only, and the rows' experts are data. Each row goes
    through one expert's matrix, which gives the kernel's output, FLOPs (``2 x S x in x out``) and saved
    tensors (the rows; the experts are parameters). Like the kernel, it is not autocast: the rows come
    cast to the experts' dtype. Other shapes go to torch's kernel."""
    if mat_a.dim() != 2 or mat_b.dim() != 3:
        return original(mat_a, mat_b, *args, **kwargs)
    kind = mat_a.device.type
    with _autocast_off(kind) if kind in TRACE_DEVICES else contextlib.nullcontext():
        return mat_a @ mat_b[0]


@contextlib.contextmanager
def _grouped_matmuls() -> Iterator[None]:
    """``_grouped_mm`` stands in for torch's grouped matmuls (``F.grouped_mm``, ``torch._grouped_mm``:
    whichever this torch has) while a trace runs."""
    kernels = ((F, "grouped_mm"), (torch, "_grouped_mm"))
    found = [(owner, name, getattr(owner, name)) for owner, name in kernels if hasattr(owner, name)]
    for owner, name, original in found:
        setattr(owner, name, functools.partial(_grouped_mm, original))
    try:
        yield
    finally:
        for owner, name, original in found:
            setattr(owner, name, original)


@contextlib.contextmanager
def _attention_kernel(kind: str) -> Iterator[None]:
    if kind not in ATTENTION_KERNELS:
        raise ConfigError(f"attention kernel '{kind}' is not one of: flash (torch's pick on CUDA, and on CPU "
                          f"without dropout), math, cpu (torch's pick on CPU: math under dropout)")
    original = F.scaled_dot_product_attention
    if kind == "flash":
        F.scaled_dot_product_attention = _flash_sdpa
    elif kind == "cpu":
        F.scaled_dot_product_attention = functools.partial(_cpu_sdpa, math_kernel=original)
    try:
        with _grouped_matmuls():  # a mixture-of-experts layer's experts, traced too
            yield
    finally:
        F.scaled_dot_product_attention = original


def profile_sequential(seq: nn.Sequential, example: torch.Tensor, tp: int = 1,
                       plan: dict[str, str] | None = None, prefix: str = "",
                       loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       attention: str = "flash", precision: str = "32", device: str = "cuda",
                       experts: Experts = Experts()) -> ModelProfile:
    """Profile ``seq`` (on meta) at tensor-parallel degree ``tp`` on ``example`` (one sample, meta).

    ``plan`` maps plan keys (relative to the module that owns ``seq``, which ``prefix`` + "." names) to
    style class names; ``loss`` turns the last output into the loss, so its saved tensors (logits'
    softmax) are counted with the last child. ``attention``: which SDPA kernel's saved tensors to count:
    ``flash`` (the default: the kernel torch picks for bf16 on CUDA, and on CPU for fp32 too) or ``math``
    (the ``s x s`` matrix, e.g. with an ``attn_mask``). ``precision``: the training precision, traced as it
    runs (a mixed one under ``device``'s autocast: ``cuda`` or ``cpu``). ``experts``: the experts modules
    of the module owning ``seq`` (``find_experts``; paths relative to it, as the plan's keys).
    """
    with _attention_kernel(attention):
        return _profile(seq, example, tp, plan, prefix, loss, precision, device, experts)


def _profile(seq: nn.Sequential, example: torch.Tensor, tp: int, plan: dict[str, str] | None, prefix: str,
             loss: Callable[[torch.Tensor], torch.Tensor] | None, precision: str,
             device: str, experts: Experts) -> ModelProfile:
    seq = copy.deepcopy(seq) if tp > 1 else seq
    relative = {k[len(prefix) + 1:] if prefix else k: s for k, s in (plan or {}).items()
                if not prefix or k.startswith(prefix + ".")}
    planned = _planned_modules(seq, relative)
    counted: set[int] = set()
    # Counted before shrinking: the whole parameters, of which a TP rank holds its share
    counts = [_param_counts(name, child, planned, counted) for name, child in seq.named_children()]
    for name, style in planned.items():
        if tp > 1:
            _shrink(seq.get_submodule(name), style, tp, f"{prefix}.{name}" if prefix else name)
    run = _AsRun(precision, device, seq)
    traced_seq = run.module(seq)
    seen = _storages(traced_seq.parameters())
    x, children, traces, inputs = run.value(example), [], [], []
    mine = experts.of(prefix)  # the experts modules inside the Sequential, by path relative to it
    dispatched = _Dispatched(traced_seq, [path for path, _ in mine])
    # One autocast region for the whole forward, as training's step: a weight's cast is made once
    with run, contextlib.closing(dispatched):
        for index, (name, child) in enumerate(traced_seq.named_children()):
            local = {n[len(name) + 1:]: s for n, s in planned.items()
                     if n == name or n.startswith(name + ".")}
            # Sequence parallel shards a block's input (the residual stream) over the sequence.
            sp = tp > 1 and "SequenceParallel" in local.values()
            input_bytes = math.ceil(_nbytes(x) / tp) if sp else _nbytes(x)
            t = _trace_child(child, x, local, tp, seen, run.casts)
            output_bytes = _nbytes(t.out)
            if loss is not None and index == len(seq) - 1:
                lt = _trace_child(_Fn(loss), t.out, {}, tp, seen, run.casts)
                t.out, t.saved, t.flops = lt.out, t.saved + lt.saved, t.flops + lt.flops
                t.largest, t.casts = max(t.largest, lt.largest), t.casts + lt.casts
            traces.append((t, input_bytes, sp, output_bytes))
            inputs.append(x)
            x = t.out
        # Backward, child by child from the loss (or the last output), each from the gradient the next made
        incoming = None
        for (t, *_), child_input in zip(reversed(traces), reversed(inputs)):
            peak, incoming = _backward_peak(run, t.out, [child_input], incoming)
            if peak is None:  # not run (a CUDA trace): each child's largest saved activation stands in
                for other, *_ in traces:
                    other.backward = other.largest
                break
            t.backward = peak
    for index, ((name, child), (t, input_bytes, sp, output_bytes)) in enumerate(zip(seq.named_children(),
                                                                                    traces)):
        n_split, n_whole = counts[index]
        linear_params = sum(m.weight.numel() for m in child.modules() if isinstance(m, nn.Linear))
        children.append(ChildProfile(name=name, kind=type(child).__name__, params=n_split + n_whole,
                                     tp_params=n_split, saved_bytes=t.saved, input_bytes=input_bytes,
                                     output_bytes=output_bytes, flops=t.flops, tp_allreduce_bytes=t.reduced,
                                     linear_flops=t.linear_flops, tp_linear_flops=t.tp_linear_flops,
                                     linear_params=linear_params, sequence_parallel=sp,
                                     linear_inputs=t.linear_inputs, linear_outputs=t.linear_outputs,
                                     op_kept_bytes=t.op_kept,
                                     op_recompute_flops=t.op_recompute,
                                     op_recompute_matmul_flops=t.op_recompute_matmul,
                                     backward_bytes=t.backward, largest_param=_largest_param(child),
                                     cast_bytes=t.casts,
                                     expert_params=sum(n for path, n in mine if _child_of(path) == name),
                                     expert_modules=sum(_child_of(path) == name for path, _ in mine),
                                     dispatch_bytes=sum(n for path, n in dispatched.sent.items()
                                                        if _child_of(path) == name)))
    seq_len = example.shape[1] if example.dim() >= 2 and not example.is_floating_point() else 1
    first = next(traced_seq.parameters(), None)  # as trained: bf16-true converts the model
    layers = tuple((path, count) for path, count in zip(experts.paths, experts.counts)
                   if not prefix or path.startswith(f"{prefix}."))
    return ModelProfile(tp=tp, children=tuple(children), seq_len=seq_len,
                        param_bytes=first.element_size() if first is not None else 4, ties=_ties(seq),
                        precision=precision, device=device, experts=layers,
                        experts_refused=experts.refused, top_k=dispatched.top_k)


def _child_of(path: str) -> str:
    """The child of a Sequential that a path relative to it lies in."""
    return path.partition(".")[0]


def profile_whole(module: nn.Module, batch: Any, why: str, tp: int = 1,
                  plan: dict[str, str] | None = None, attention: str = "flash", precision: str = "32",
                  device: str = "cuda", step: TrainingStep | None = None,
                  experts: Experts = Experts()) -> ModelProfile:
    """Profile ``module`` (on meta) as one child: its ``training_step`` on ``batch`` (one sample of each
    tensor, meta), the loss included, at tensor-parallel degree ``tp`` (the plan's keys are relative to
    ``module``). For a model with no ``nn.Sequential`` to cut (a Hugging Face model held as one
    attribute): every layout but a pipeline can run it, and ``why`` says why not a pipeline. ``precision``
    and ``device``: as ``profile_sequential``'s; ``experts``: as ``profile_blocks``'s."""
    with _attention_kernel(attention):
        module = copy.deepcopy(module) if tp > 1 else module
        planned = _planned_modules(module, plan or {})
        n_split, n_whole = _param_counts("", module, planned, set())  # before shrinking
        for name, style in planned.items():
            if tp > 1:
                _shrink(module.get_submodule(name), style, tp, name)
        wrapped = blocks_to_wrap(module, None)
        blocks = [sum(p.numel() for p in block.parameters()) for block in wrapped]
        root = sum(p.numel() for p in module.parameters()) - sum(blocks)  # local sizes: shrunk above
        # The expert parameters of each unit (the root's remainder holds none: experts sit in blocks)
        inside = [{id(m) for m in block.modules()} for block in wrapped]
        unit_experts = [0, *(sum(n for path, n in experts.of("") if id(module.get_submodule(path)) in ids)
                             for ids in inside)]
        run = _AsRun(precision, device, module)
        traced = run.module(module)
        traced_step = _TrainingStep(traced, run.value(batch), step or training_step_loss)
        dispatched = _Dispatched(traced, list(experts.paths))
        try:
            with run:
                t = _trace_child(traced_step, None, {f"module.{k}": v for k, v in planned.items()}, tp,
                                 _storages(traced.parameters()), run.casts)
                # Nothing flows back to a batch: the backward runs to the parameters, their gradients left
                # out
                peak, _ = _backward_peak(run, t.out, list(traced.parameters()), parameters=True)
                t.backward = t.largest if peak is None else peak
        finally:
            dispatched.close()
    units = [root, *blocks]
    largest_unit = units.index(max(units))
    linear_params = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    child = ChildProfile(name=type(module).__name__, kind=type(module).__name__, params=n_split + n_whole,
                         tp_params=n_split, saved_bytes=t.saved, input_bytes=_nbytes(tensors_in(batch)),
                         output_bytes=0,
                         flops=t.flops, tp_allreduce_bytes=t.reduced, linear_flops=t.linear_flops,
                         linear_inputs=t.linear_inputs, linear_outputs=t.linear_outputs,
                         tp_linear_flops=t.tp_linear_flops, linear_params=linear_params,
                         op_kept_bytes=t.op_kept, op_recompute_flops=t.op_recompute,
                         op_recompute_matmul_flops=t.op_recompute_matmul,
                         fsdp_unit_params=max([root, *blocks]), backward_bytes=t.backward,
                         largest_param=_largest_param(module), cast_bytes=t.casts,
                         expert_params=sum(experts.params), expert_modules=len(experts.paths),
                         dispatch_bytes=sum(dispatched.sent.values()),
                         fsdp_unit_experts=unit_experts[largest_unit])
    seq_len = _seq_len(batch)
    first = next(traced.parameters(), None)  # as trained: bf16-true converts the model
    return ModelProfile(tp=tp, children=(child,), seq_len=seq_len,
                        param_bytes=first.element_size() if first is not None else 4, whole=why,
                        precision=precision, device=device, experts=tuple(zip(experts.paths, experts.counts)),
                        experts_refused=experts.refused, top_k=dispatched.top_k)


def profile_blocks(module: nn.Module, batch: Any, tp: int = 1,
                   plan: dict[str, str] | None = None, attention: str = "flash", precision: str = "32",
                   device: str = "cuda", step: TrainingStep | None = None,
                   experts: Experts = Experts()) -> ModelProfile:
    """Profile ``module`` (on meta) through its ``training_step`` on ``batch`` (one sample of each tensor,
    meta, the loss included) as its repeated blocks (``blocks_to_wrap``: FSDP's units, where the pipeline
    cuts a model that is not one Sequential) with the glue before the first and after the last as children
    of their own: ``[before, block 0, ..., block n-1, after]``. Parameters weigh where they are registered
    (a tie once, where first), as the strategy's cut weighs them; saved bytes and FLOPs where they run.
    ``precision`` and ``device``: as ``profile_sequential``'s; ``experts``: the model's experts modules
    (``find_experts``), counted in the blocks holding them."""
    with _attention_kernel(attention):
        module = copy.deepcopy(module) if tp > 1 else module
        planned = _planned_modules(module, plan or {})
        blocks = blocks_to_wrap(module, None)
        names = {id(m): n for n, m in module.named_modules()}
        split_ids = {id(p) for n, s in planned.items() if s in SPLIT_STYLES
                     for p in module.get_submodule(n).parameters()}
        segment = segments_of(module, blocks)
        weighs = parameter_segments(module, segment)  # before shrinking: whole parameters
        n_split, n_whole = [0] * (len(blocks) + 2), [0] * (len(blocks) + 2)
        for param_id, (index, param) in weighs.items():
            (n_split if param_id in split_ids else n_whole)[index] += param.numel()
        linears = [0] * (len(blocks) + 2)
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                linears[segment[id(sub)]] += sub.weight.numel()
        # A tie: the child where the parameter weighs, each other child holding it, and its size
        tied: dict[tuple[int, int], int] = {}
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                pair = (weighs[id(p)][0], segment[id(sub)])
                if pair[0] != pair[1]:
                    tied[pair] = tied.get(pair, 0) + p.numel()
        for name, style in planned.items():
            if tp > 1:
                _shrink(module.get_submodule(name), style, tp, name)
        local_blocks = [sum(p.numel() for p in block.parameters()) for block in blocks]
        largest = [0] * (len(blocks) + 2)  # after shrinking: as one TP rank holds them
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                largest[segment[id(sub)]] = max(largest[segment[id(sub)]], p.numel())
        root = sum(p.numel() for p in module.parameters()) - sum(local_blocks)
        expert_params, expert_modules = [0] * (len(blocks) + 2), [0] * (len(blocks) + 2)
        for path, n in experts.of(""):
            expert_params[segment[id(module.get_submodule(path))]] += n
            expert_modules[segment[id(module.get_submodule(path))]] += 1
        run = _AsRun(precision, device, module)
        twin = run.module(module)
        traced_step = _TrainingStep(twin, run.value(batch), step or training_step_loss)
        dispatched = _Dispatched(twin, list(experts.paths))
        try:
            with run:
                traced, inputs = _trace_segments(run, traced_step,
                                                 [twin.get_submodule(names[id(b)]) for b in blocks],
                                                 {f"module.{k}": v for k, v in planned.items()}, tp,
                                                 _storages(twin.parameters()), run.casts)
        finally:
            dispatched.close()
    dispatch = [0] * (len(blocks) + 2)
    for path, n in dispatched.sent.items():
        dispatch[segment[id(module.get_submodule(path))]] += n
    label = ["before " + names[id(blocks[0])], *(names[id(b)] for b in blocks),
             "after " + names[id(blocks[-1])]]
    children = []
    batch_bytes = _nbytes(tensors_in(batch))
    for index, t in enumerate(traced):
        glue = index in (0, len(traced) - 1)
        children.append(ChildProfile(
            name=label[index], kind=type(module).__name__ if glue else type(blocks[index - 1]).__name__,
            params=n_split[index] + n_whole[index], tp_params=n_split[index], saved_bytes=t.saved,
            input_bytes=batch_bytes if index == 0 else inputs[index - 1] if not glue or index == 1 else 0,
            output_bytes=inputs[index] if index < len(blocks) else 0, flops=t.flops,
            tp_allreduce_bytes=t.reduced, linear_flops=t.linear_flops, tp_linear_flops=t.tp_linear_flops,
            linear_inputs=t.linear_inputs, linear_outputs=t.linear_outputs,
            linear_params=linears[index], op_kept_bytes=t.op_kept, op_recompute_flops=t.op_recompute,
            op_recompute_matmul_flops=t.op_recompute_matmul, fsdp_unit_params=root if glue else 0,
            backward_bytes=t.backward, largest_param=largest[index], cast_bytes=t.casts,
            expert_params=expert_params[index], expert_modules=expert_modules[index],
            dispatch_bytes=dispatch[index]))
    last = len(children) - 1
    seq_len = _seq_len(batch)
    first = next(twin.parameters(), None)  # as trained: bf16-true converts the model
    return ModelProfile(tp=tp, children=tuple(children), seq_len=seq_len,
                        param_bytes=first.element_size() if first is not None else 4, ties=tuple(tied),
                        tied_params=tuple(tied.values()), precision=precision, device=device,
                        units=((0, 2), *((i, i + 1) for i in range(2, last - 1)), (last - 1, last + 1)),
                        experts=tuple(zip(experts.paths, experts.counts)), experts_refused=experts.refused,
                        top_k=dispatched.top_k)


class _Current:
    """Writes its attributes to the segment running now (``segments[current[0]]``)."""

    def __init__(self, segments: list[_Traced], current: list[int]) -> None:
        object.__setattr__(self, "_where", (segments, current))

    def __getattr__(self, name: str) -> Any:
        segments, current = object.__getattribute__(self, "_where")
        return getattr(segments[current[0]], name)

    def __setattr__(self, name: str, value: Any) -> None:
        segments, current = object.__getattribute__(self, "_where")
        setattr(segments[current[0]], name, value)


class _FlopsHere(TorchDispatchMode):
    """Each op's forward FLOPs (``flop_counter``'s formulas) to the segment running now."""

    def __init__(self, where: _Current) -> None:
        super().__init__()
        self.where = where
        self.registry = lazy.flop_counter().flop_registry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            self.where.flops += formula(*args, **kwargs, out_val=out)
        return out


def _trace_segments(run: _AsRun, step: nn.Module, blocks: list[nn.Module], planned: dict[str, str], tp: int,
                    seen: set[int], casts: set[int] | None = None) -> tuple[list[_Traced], list[int]]:
    """Run the step on meta once (inside ``run``), attributing what ``_trace_child`` measures to the glue
    before the first block, each block (with the glue up to the next), and the glue after the last (the
    loss with it); then its backward, segment by segment from the loss (``_backward_peak``). Also returns
    the bytes of each block's input (its first tensor argument: what a pipeline sends)."""
    segments = [_Traced(None, 0, 0, 0) for _ in range(len(blocks) + 2)]
    counters = [_SavedCounter(seen, casts) for _ in segments]
    current, inputs = [0], [0] * len(blocks)
    # Where each segment's backward starts and ends: the blocks' inputs, and the last block's output
    starts: list[torch.Tensor | None] = [None] * len(blocks)
    last_output: list[torch.Tensor | None] = [None]
    here = _Current(segments, current)

    def enter(index: int) -> Any:
        def hook(m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            current[0] = index + 1
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            inputs[index] = _nbytes(tensors[0]) if tensors else 0
            starts[index] = tensors[0] if tensors else None
        return hook

    def leave_last(m: nn.Module, i: Any, o: Any) -> None:
        current[0] = len(blocks) + 1
        last_output[0] = next((t for t in tree_leaves(o) if isinstance(t, torch.Tensor)), None)

    handles = [block.register_forward_pre_hook(enter(i), with_kwargs=True) for i, block in enumerate(blocks)]
    handles.append(blocks[-1].register_forward_hook(leave_last))
    handles += _linear_hooks(step, planned, here)
    for name, style in planned.items():
        sub = step.get_submodule(name)
        if style == "RowwiseParallel":
            def reduce(m: nn.Module, i: Any, o: torch.Tensor) -> None:
                here.reduced += _nbytes(o)
            handles.append(sub.register_forward_hook(reduce))
        elif style == COLWISE_GATHERED and tp > 1:
            def gather(m: nn.Module, i: Any, o: torch.Tensor) -> torch.Tensor:
                whole = _gathered(o, tp)
                here.reduced += _nbytes(whole)  # as in _trace_child: an all-reduce's payload, an upper bound
                return whole
            handles.append(sub.register_forward_hook(gather))
    try:
        with (torch.autograd.graph.saved_tensors_hooks(lambda t: counters[current[0]].pack(t), lambda t: t),
              _FlopsHere(here), _OpSelectionReplay(here)):  # type: ignore[arg-type]
            loss = step(None)
    finally:
        for h in handles:
            h.remove()
    for segment, counter in zip(segments, counters):
        segment.saved, segment.largest, segment.casts = counter.total, counter.largest, counter.cast_total
    # The glue before the first block gets no gradient to pass on (its input is the batch): its backward is
    # its parameters' gradients, costed apart (a fresh one in ``_transients``)
    ends = [*starts[1:], last_output[0], loss]
    incoming = None
    for index in range(len(segments) - 1, 0, -1):
        start = last_output[0] if index == len(segments) - 1 else starts[index - 1]
        if start is None or ends[index - 1] is None:
            break
        peak, incoming = _backward_peak(run, ends[index - 1], [start], incoming)
        if peak is None:  # not run (a CUDA trace): each segment's largest saved activation stands in
            for segment in segments:
                segment.backward = segment.largest
            break
        segments[index].backward = peak
    return segments, inputs


# How the trace runs the module's step on its batch: ``(module, batch) -> loss``. The trainer passes its own
# (trainer/launch/planned.py: logs muted, manual optimisation's backward calls collected into the loss).
TrainingStep = Callable[[nn.Module, Any], torch.Tensor]


def training_step_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """``module.training_step(batch, 0)``'s loss: the tensor, or a dict's ``loss``."""
    out = module.training_step(batch, 0)
    return out["loss"] if isinstance(out, Mapping) else out


def _seq_len(batch: Any) -> int:
    """The sequence length of a batch of token ids (its first tensor: integers, at least 2-D), else 1."""
    tensors = tensors_in(batch)
    first = tensors[0] if tensors else None
    return first.shape[1] if first is not None and first.dim() >= 2 and not first.is_floating_point() else 1


class _TrainingStep(nn.Module):
    """The module's training step on one batch as a forward, for the trace."""

    def __init__(self, module: nn.Module, batch: Any, step: TrainingStep) -> None:
        super().__init__()
        self.module, self.batch, self.step = module, batch, step

    def forward(self, _: Any) -> torch.Tensor:
        return self.step(self.module, self.batch)


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
