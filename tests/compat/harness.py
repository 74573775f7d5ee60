"""Run a compat module (``modules.py``) under PyTorch Lightning or polytrain and record what happened.

``modules.py`` imports its framework on one line marked ``# <framework>``; ``load_modules(framework)``
executes the file's text with that line replaced (``FRAMEWORK_LINES``), so both frameworks run the
very same classes. ``run_case`` runs one case on this process; ``run_case_distributed`` runs it on N
gloo processes that we start ourselves (``tests/distributed.py``: MASTER_ADDR, MASTER_PORT, RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and GROUP_RANK are set in each). Lightning treats such a
process as an already-launched worker because ``LOCAL_RANK`` is set (its ``LightningEnvironment``
then reports ``creates_processes_externally``), so ``Trainer(strategy="ddp", devices=N)`` joins the
process group instead of re-launching the script.

A run returns a ``RunResult``:

- ``events``: every hook call, in order, as dicts ``{who, hook, args, depth, epoch, step, training,
  grad, rng_in, rng_out}``. ``who`` is ``module``, ``datamodule``, ``callback`` (the recording
  callback, first in the Trainer's list) or ``callback:<Class>`` (a case's own callback), and
  ``harness`` for stage markers and, with ``trace_rng=True``, for global-RNG events (``rng:...``: a
  DataLoader iterator drawing its base seed, a ``RandomSampler`` drawing its seed, ``manual_seed``,
  ``get_rng_state``/``set_rng_state``). ``depth`` is the nesting (a hook called from inside another,
  e.g. ``training_step`` inside ``optimizer_step``'s closure). ``rng_in``/``rng_out`` are short hashes of
  the global torch RNG state at entry and exit: a hook that draws changes it.
- ``losses``: what each ``training_step`` returned (tensors cloned), in call order.
- ``state_dict``: the module's weights after the last stage; ``metrics``: the trainer's
  ``callback_metrics``/``logged_metrics``/``progress_bar_metrics`` as floats; ``outputs``: what
  validate/test/predict returned; ``global_step``, ``current_epoch``; ``extra``: case-specific data
  (the reconstruction grids of the autoencoder's callback).

``events_text(events)`` renders the sequence one call per line for reading and diffing;
``comparable(events)`` reduces it to what two frameworks must agree on and ``first_difference``
shows where two such lists part.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

MODULES_FILE = Path(__file__).with_name("modules.py")
SURFACE_FILE = Path(__file__).with_name("surface_modules.py")  # the names around the module (loggers, ...)
DETAIL_FILE = Path(__file__).with_name("detail_modules.py")  # the details real projects hit
MARKER = "# <framework>"
FRAMEWORK_LINES = {
    "lightning": "import lightning.pytorch as pl  # <framework>",
    "polytrain": "import polytrain as pl  # <framework>",
}

CALLBACK_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end",
    "on_test_batch_start", "on_test_batch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_predict_batch_start", "on_predict_batch_end",
    "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
    "on_save_checkpoint", "on_load_checkpoint", "on_exception",
)
CALLBACK_STATE_HOOKS = ("state_dict", "load_state_dict")

MODULE_HOOKS = (
    "prepare_data", "setup", "teardown", "configure_model", "configure_callbacks", "configure_optimizers",
    "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
    "on_validation_start", "on_validation_end", "on_test_start", "on_test_end",
    "on_predict_start", "on_predict_end",
    "on_train_epoch_start", "on_train_epoch_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_test_epoch_start", "on_test_epoch_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end",
    "on_validation_model_zero_grad", "on_validation_model_eval", "on_validation_model_train",
    "on_test_model_eval", "on_test_model_train", "on_predict_model_eval",
    "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "training_step", "validation_step", "test_step", "predict_step",
    "on_before_zero_grad", "optimizer_zero_grad", "backward", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "configure_gradient_clipping", "clip_gradients", "optimizer_step",
    "lr_scheduler_step", "manual_backward", "toggle_optimizer", "untoggle_optimizer",
    "on_save_checkpoint", "on_load_checkpoint", "state_dict", "load_state_dict",
)
# Inside these, the recorder notes what trainer.callback_metrics holds (a callback's at entry, the module's
# at exit, after what the hook itself logged).
EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")

DATAMODULE_HOOKS = (
    "prepare_data", "setup", "teardown", "train_dataloader", "val_dataloader", "test_dataloader",
    "predict_dataloader", "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "state_dict", "load_state_dict", "on_exception",
)

# Quiet, fast, file-free defaults; Lightning's names (polytrain is expected to accept them too).
DEFAULT_TRAINER = dict(
    accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
)

_get_rng_state = torch.get_rng_state  # the recorder's own reads must not show up as traced events


# ----------------------------------------------------------------------------------------------
# loading the modules under a framework


_loaded: dict[str, types.ModuleType] = {}


def module_source(framework: str, path: Path = MODULES_FILE) -> str:
    lines = path.read_text().splitlines(keepends=True)
    marked = [i for i, line in enumerate(lines) if line.rstrip().endswith(MARKER)]
    if len(marked) != 1:
        raise RuntimeError(f"{path} must have exactly one line ending in {MARKER!r}, found {len(marked)}")
    lines[marked[0]] = FRAMEWORK_LINES[framework] + "\n"
    return "".join(lines)


def load_modules(framework: str, path: Path = MODULES_FILE) -> types.ModuleType:
    """``modules.py`` (or ``path``) executed with its framework line for ``framework``
    (cached per process)."""
    key = framework if path == MODULES_FILE else f"{framework}:{path.stem}"
    if key not in _loaded:
        name = f"compat_modules_{framework}" if path == MODULES_FILE else f"compat_{path.stem}_{framework}"
        spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
        mod = importlib.util.module_from_spec(spec)
        mod.__file__ = str(path)
        sys.modules[name] = mod  # classes must be findable by module name (pickling, dataclasses, inspect)
        exec(compile(module_source(framework, path), str(path), "exec"), mod.__dict__)
        _loaded[key] = mod
    return _loaded[key]


def case_builder(framework: str, case: str) -> tuple[types.ModuleType, Callable[..., dict[str, Any]]]:
    """The framework namespace and the function that builds ``case`` (from either modules file)."""
    for path in (MODULES_FILE, SURFACE_FILE, DETAIL_FILE):
        ns = load_modules(framework, path)
        if case in ns.CASES:
            return ns, ns.CASES[case]
    raise KeyError(f"no compat case {case!r}")


# ----------------------------------------------------------------------------------------------
# recording


def rng_fingerprint() -> str:
    return hashlib.blake2b(_get_rng_state().numpy().tobytes(), digest_size=4).hexdigest()


def summarize(value: Any, depth: int = 0) -> Any:
    """A JSON-able description of a hook argument: its kind and shape, not its values."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return f"scheduler:{type(value).__name__}"
    if isinstance(value, torch.optim.Optimizer):
        return f"optimizer:{type(value).__name__}"
    if hasattr(value, "optimizer") and isinstance(getattr(value, "optimizer", None), torch.optim.Optimizer):
        return f"wrapped-optimizer:{type(value).__name__}({type(value.optimizer).__name__})"
    if isinstance(value, Enum):  # Lightning passes ``stage`` as a str-valued enum (TrainerFn)
        return value.value
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.device):
        return f"device:{value.type}"
    if depth >= 3:
        return type(value).__name__
    if isinstance(value, Mapping):
        if "state_dict" in value and ("epoch" in value or "global_step" in value):
            return f"checkpoint(keys={sorted(map(str, value))})"
        if len(value) > 12:
            return f"dict(keys={sorted(map(str, value))})"
        return {str(k): summarize(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [summarize(v, depth + 1) for v in value]
    if callable(value) and not isinstance(value, (torch.nn.Module, type)) and not hasattr(value, "fit"):
        return "closure"  # optimizer_step's closure: Lightning's Closure object, or any function/partial
    return type(value).__name__


@dataclass
class Recorder:
    events: list[dict[str, Any]] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    depth: int = 0
    trainer: Any = None

    def _state(self) -> dict[str, Any]:
        trainer = self.trainer
        state: dict[str, Any] = {}
        if trainer is not None:
            for key, attr in (("epoch", "current_epoch"), ("step", "global_step")):
                try:
                    state[key] = int(getattr(trainer, attr))
                except Exception:  # noqa: BLE001 - not every trainer state is readable at every moment
                    state[key] = None
        return state

    def enter(self, who: str, hook: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
              module: Any = None) -> dict[str, Any]:
        event = {"who": who, "hook": hook, "args": [summarize(a) for a in args], "depth": self.depth}
        if kwargs:
            event["kwargs"] = {k: summarize(v) for k, v in kwargs.items()}
        event.update(self._state())
        if module is not None and isinstance(module, torch.nn.Module):
            event["training"] = module.training
        event["grad"] = torch.is_grad_enabled()
        event["rng_in"] = rng_fingerprint()
        self.events.append(event)
        self.depth += 1
        return event

    def exit(self, event: dict[str, Any]) -> None:
        self.depth -= 1
        event["rng_out"] = rng_fingerprint()

    def note(self, hook: str, **info: Any) -> None:
        event = {"who": "harness", "hook": hook, "depth": self.depth, **info}
        event.update(self._state())
        event["rng_in"] = event["rng_out"] = rng_fingerprint()
        self.events.append(event)

    def wrap(self, obj: Any, who: str, names: Iterable[str], module: Any = None, skip_args: int = 0) -> None:
        """Record calls of ``obj``'s methods ``names`` (instance attributes wrapping the bound methods;
        ``functools.wraps`` keeps Lightning's "is this hook overridden?" checks answering as before).
        ``skip_args``: leading arguments not recorded (a callback's trainer and module)."""
        for name in names:
            bound = getattr(obj, name, None)
            if bound is None or not callable(bound) or name in obj.__dict__:
                continue
            obj.__dict__[name] = self._wrapper(bound, who, name, module if module is not None else obj,
                                               skip_args)

    def _wrapper(self, bound: Callable, who: str, name: str, module: Any, skip_args: int = 0) -> Callable:
        recorder = self

        @functools.wraps(bound)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            event = recorder.enter(who, name, args[skip_args:], kwargs, module=module)
            try:
                result = bound(*args, **kwargs)
            finally:
                recorder.exit(event)
            if name in EPOCH_END_HOOKS and recorder.trainer is not None:
                event["callback_metrics"] = _floats(recorder.trainer.callback_metrics)
            if name == "training_step":
                recorder.losses.append(_detached(result))
            return result

        return wrapper

    def make_callback(self, pl: Any) -> Any:
        """An instance of a ``pl.Callback`` subclass that records every callback hook (and is stateful)."""
        recorder = self

        def hook(name: str) -> Callable:
            def method(self: Any, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
                recorder.trainer = trainer
                event = recorder.enter("callback", name, args, kwargs, module=pl_module)
                if name in EPOCH_END_HOOKS:
                    event["callback_metrics"] = _floats(trainer.callback_metrics)
                recorder.exit(event)

            method.__name__ = name
            return method

        namespace: dict[str, Any] = {name: hook(name) for name in CALLBACK_HOOKS}

        def state_dict(self: Any) -> dict[str, Any]:
            recorder.exit(recorder.enter("callback", "state_dict"))
            return {"events_so_far": len(recorder.events)}

        def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
            recorder.exit(recorder.enter("callback", "load_state_dict", (state_dict,)))

        namespace.update(state_dict=state_dict, load_state_dict=load_state_dict)
        return type("HookRecorder", (pl.Callback,), namespace)()


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


_EVENT_KEYS = {"who", "hook", "args", "kwargs", "depth", "epoch", "step", "training", "grad", "rng_in",
               "rng_out", "rng_before", "callback_metrics"}


def events_text(events: Iterable[Mapping[str, Any]], rng: bool = False) -> str:
    """One line per event: indentation for nesting, ``who.hook(args)``, and the RNG hashes if asked."""
    lines = []
    for e in events:
        args = ", ".join(map(repr, e.get("args", [])))
        if e.get("kwargs"):
            args += (", " if args else "") + ", ".join(f"{k}={v!r}" for k, v in e["kwargs"].items())
        if e["who"] == "harness":
            info = {k: v for k, v in e.items() if k not in _EVENT_KEYS}
            args = ", ".join(f"{k}={v!r}" for k, v in info.items())
        line = f"{'  ' * e['depth']}{e['who']}.{e['hook']}({args})"
        if rng:
            line += f"  rng {e.get('rng_in')}->{e.get('rng_out')}"
        lines.append(line)
    return "\n".join(lines)


_WRAPPER_PREFIX = re.compile(r"^(optimizer:)(?:Lightning|Step)(?=[A-Z])")


def _normalize(value: Any) -> Any:
    if isinstance(value, str):
        if value.startswith("checkpoint(keys="):
            return "checkpoint"  # each framework writes its own keys
        return _WRAPPER_PREFIX.sub(r"\1", value)  # Lightning's optimizer wrapper is "Lightning<Optimizer>"
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return value


def comparable(events: Iterable[Mapping[str, Any]], rng: bool = True) -> list[tuple[Any, ...]]:
    """What two frameworks running the same case must agree on, one tuple per hook call: who, hook,
    argument kinds, nesting depth, the trainer's epoch and global step, train/eval mode and grad mode,
    and (``rng=True``, for one-process runs) the global RNG fingerprints at entry and exit. Stage
    markers are kept; the RNG tracer's own notes are left out (they are diagnostics: how a framework
    isolates its RNG is its business, the fingerprints on the hooks are what must match). Checkpoint
    dicts compare as ``checkpoint`` and a wrapped optimizer by its optimizer class."""
    out = []
    for e in events:
        if e["who"] == "harness" and not e["hook"].startswith("stage:"):
            continue
        item = (e["who"], e["hook"], repr(_normalize(e.get("args", []))),
                repr(_normalize(e.get("kwargs", {}))),
                e["depth"], e.get("epoch"), e.get("step"), e.get("training"), e.get("grad"))
        if rng:
            item += (e.get("rng_in"), e.get("rng_out"))
        out.append(item)
    return out


def epoch_end_metrics(events: Iterable[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """``(who, hook, epoch, step, callback_metrics)`` for every epoch-end hook call the recorder noted."""
    return [(e["who"], e["hook"], e.get("epoch"), e.get("step"), e["callback_metrics"]) for e in events
            if "callback_metrics" in e]


def first_difference(a: Sequence[Any], b: Sequence[Any], context: int = 3) -> str | None:
    """None if equal, else a readable excerpt around the first position where the sequences differ."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None:
        if len(a) == len(b):
            return None
        n = min(len(a), len(b))
    lo = max(0, n - context)
    left = "\n".join(f"  {i}: {x}" for i, x in enumerate(a[lo:n + context], lo))
    right = "\n".join(f"  {i}: {x}" for i, x in enumerate(b[lo:n + context], lo))
    return f"first difference at event {n} (lengths {len(a)} vs {len(b)})\nfirst:\n{left}\nsecond:\n{right}"


# ----------------------------------------------------------------------------------------------
# tracing the global RNG


class RngTracer:
    """While active, notes every draw from or reseed of the global torch RNG that goes through the
    usual data-loading paths, as ``harness`` events named ``rng:...``: the base seed a DataLoader
    iterator draws when created, the seed a ``RandomSampler`` without a generator draws on its first
    ``next``, ``torch.manual_seed`` / ``torch.set_rng_state`` / ``torch.get_rng_state`` calls. (Draws inside
    ops, such as dropout masks, show only as a changed ``rng_in``/``rng_out`` of the enclosing hook.)"""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._undo: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def __enter__(self) -> RngTracer:
        from torch.utils.data import RandomSampler
        from torch.utils.data import dataloader as dl

        rec = self.recorder
        base_init = dl._BaseDataLoaderIter.__init__

        def iter_init(it: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
            before = rng_fingerprint()
            base_init(it, loader, *args, **kwargs)
            rec.note("rng:dataloader_iter", dataset=type(loader.dataset).__name__, n=len(loader.dataset)
                     if hasattr(loader.dataset, "__len__") else None, sampler=type(loader.sampler).__name__,
                     own_generator=loader.generator is not None, rng_before=before)

        self._patch(dl._BaseDataLoaderIter, "__init__", iter_init)
        sampler_iter = RandomSampler.__iter__

        def random_sampler_iter(sampler: Any) -> Any:
            before = rng_fingerprint()
            inner = sampler_iter(sampler)
            first = next(inner, None)  # the seed is drawn on the first next(), as in the original
            if sampler.generator is None:
                rec.note("rng:random_sampler_seed", n=len(sampler.data_source), rng_before=before)
            if first is None:
                return
            yield first
            yield from inner

        self._patch(RandomSampler, "__iter__", random_sampler_iter)
        from torch.utils.data.distributed import DistributedSampler

        set_epoch = DistributedSampler.set_epoch

        def traced_set_epoch(sampler: Any, epoch: int) -> None:
            rec.note("data:set_epoch", epoch_arg=int(epoch), sampler=type(sampler).__name__)
            set_epoch(sampler, epoch)

        self._patch(DistributedSampler, "set_epoch", traced_set_epoch)
        for name in ("manual_seed", "set_rng_state", "get_rng_state"):
            original = getattr(torch, name)

            def traced(*args: Any, _name: str = name, _original: Callable = original, **kwargs: Any) -> Any:
                before = rng_fingerprint()
                result = _original(*args, **kwargs)
                info = {"seed": int(args[0])} if _name == "manual_seed" and args else {}
                rec.note(f"rng:{_name}", rng_before=before, **info)
                return result

            self._patch(torch, name, traced)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()


# ----------------------------------------------------------------------------------------------
# running


@dataclass
class RunResult:
    framework: str
    case: str
    rank: int
    world_size: int
    events: list[dict[str, Any]]
    losses: list[Any]
    state_dict: dict[str, torch.Tensor]
    metrics: dict[str, dict[str, float]]
    outputs: dict[str, Any]
    global_step: int
    current_epoch: int
    extra: dict[str, Any]


Stage = str | tuple[str, Mapping[str, Any]]


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in dict(metrics).items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            out[k] = repr(v)
    return out


def quiet() -> None:
    """Silence Lightning's info lines and the warnings tiny demo runs provoke."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "polytrain"):
        logging.getLogger(name).setLevel(logging.ERROR)


@functools.cache
def _scratch_dir() -> str:
    """One directory per test process for the runs given no ``root_dir``, removed when the process ends:
    a run's files outlive the call (results point into them) but not the session."""
    scratch = tempfile.TemporaryDirectory(prefix="compat-")
    _SCRATCH_DIRS.append(scratch)
    return scratch.name


_SCRATCH_DIRS: list[tempfile.TemporaryDirectory] = []


def run_case(framework: str, case: str, *, case_kwargs: Mapping[str, Any] | None = None,
             trainer_kwargs: Mapping[str, Any] | None = None, stages: Sequence[Stage] = ("fit",),
             seed: int | None = 0, seed_fn: str = "seed_everything", trace_rng: bool = False,
             root_dir: str | None = None, world_size: int = 1, rank: int = 0) -> RunResult:
    """Build ``case`` from the modules loaded for ``framework`` and run ``stages`` on one Trainer.

    ``seed_fn``: ``"seed_everything"`` (``pl.seed_everything(seed)``, which also sets PL_GLOBAL_SEED),
    ``"manual_seed"`` (``torch.manual_seed(seed)`` only) or ``"none"``; done just before the case is built.
    A stage is a name (``fit``, ``validate``, ``test``, ``predict``, ``save_checkpoint``) or
    ``(name, kwargs)``; kwargs go to that Trainer method, except ``trainer``: keywords for a *new*
    Trainer from then on (e.g. more epochs and ``ckpt_path`` to resume); ``{root}`` in a string value
    stands for ``root_dir``. ``save_checkpoint`` takes ``path`` (default ``<root_dir>/saved.ckpt``).
    """
    quiet()
    torch.set_num_threads(1)
    ns, build_case = case_builder(framework, case)
    pl = ns.pl
    root_dir = root_dir or tempfile.mkdtemp(prefix=f"{framework}-{case}-", dir=_scratch_dir())
    # A seed left in the environment by an earlier run (or inherited from a fork server) would make
    # Lightning's DDP reseed at setup: only this run's seed_fn decides.
    os.environ.pop("PL_GLOBAL_SEED", None)
    os.environ.pop("PL_SEED_WORKERS", None)
    if seed is not None and seed_fn == "seed_everything":
        pl.seed_everything(seed)
    elif seed is not None and seed_fn == "manual_seed":
        torch.manual_seed(seed)

    recorder = Recorder()
    tracer = RngTracer(recorder) if trace_rng else None
    if tracer is not None:
        tracer.__enter__()
    try:
        kwargs = dict(case_kwargs or {})
        if case == "autoencoder":
            kwargs.setdefault("data_dir", os.path.join(root_dir, "data"))
        if "save_dir" in inspect.signature(build_case).parameters:
            kwargs.setdefault("save_dir", root_dir)
        built = build_case(**kwargs)
        model, datamodule = built["model"], built.get("datamodule")
        user_callbacks = list(built.get("callbacks", []))
        recorder.wrap(model, "module", MODULE_HOOKS)
        if datamodule is not None:
            recorder.wrap(datamodule, "datamodule", DATAMODULE_HOOKS, module=model)
        for cb in user_callbacks:
            recorder.wrap(cb, f"callback:{type(cb).__name__}", CALLBACK_HOOKS, module=model, skip_args=2)
            recorder.wrap(cb, f"callback:{type(cb).__name__}", CALLBACK_STATE_HOOKS, module=model)

        def make_trainer(overrides: Mapping[str, Any]) -> Any:
            tk = dict(DEFAULT_TRAINER, default_root_dir=root_dir)
            if world_size > 1:
                tk.update(strategy=built.get("ddp_strategy", "ddp"), devices=world_size)
            tk.update(built.get("trainer", {}))
            tk.update(trainer_kwargs or {})
            tk.update(overrides)
            tk["callbacks"] = [recorder.make_callback(pl), *user_callbacks, *tk.get("callbacks", [])]
            trainer = pl.Trainer(**tk)
            recorder.trainer = trainer
            return trainer

        trainer = make_trainer({})
        outputs: dict[str, Any] = {}
        after_stage: list[dict[str, Any]] = []
        for stage in stages:
            name, stage_kwargs = (stage, {}) if isinstance(stage, str) else (stage[0], dict(stage[1]))
            stage_kwargs = {k: v.replace("{root}", root_dir) if isinstance(v, str) else v
                            for k, v in stage_kwargs.items()}
            if "trainer" in stage_kwargs:
                trainer = make_trainer(stage_kwargs.pop("trainer"))
            recorder.note(f"stage:{name}")
            if name == "save_checkpoint":
                trainer.save_checkpoint(stage_kwargs.get("path", os.path.join(root_dir, "saved.ckpt")))
                continue
            if name == "call":  # the case's own step between Trainer calls
                # (change the Trainer, add a callback)
                built["calls"][stage_kwargs["fn"]](trainer, model)
                continue
            if name in ("fit", "validate", "test", "predict"):
                if datamodule is not None:
                    stage_kwargs.setdefault("datamodule", datamodule)
                expect_error = stage_kwargs.pop("expect_error", False)
                try:
                    result = getattr(trainer, name)(model, **stage_kwargs)
                except Exception as err:  # noqa: BLE001 - a case that fails on purpose records why
                    if not expect_error:
                        raise
                    after_stage.append({"stage": name, "error": f"{type(err).__name__}: {err}"})
                    break
                if name != "fit":
                    outputs.setdefault(name, []).append(_detached(result))
                after_stage.append(snapshot(name, trainer, model))
                continue
            raise ValueError(f"unknown stage {name!r}")
    finally:
        if tracer is not None:
            tracer.__exit__(None, None, None)

    extra: dict[str, Any] = {"train_sampler": describe_sampler(getattr(trainer, "train_dataloader", None)),
                             "seen_in_hooks": list(getattr(model, "seen_in_hooks", [])),
                             "rank_zero_notes": list(getattr(model, "rank_zero_notes", [])),
                             "log_dir": trainer.log_dir, "root_dir": root_dir,
                             "logger_dirs": {type(lg).__name__: lg.log_dir for lg in trainer.loggers},
                             "after_stage": after_stage,
                             "optimizer_builds": getattr(model, "optimizer_builds", None)}
    for cb in user_callbacks:
        if hasattr(cb, "images"):
            extra["images"] = [img.clone() for img in cb.images]
    return RunResult(
        framework=framework, case=case, rank=rank, world_size=world_size, events=recorder.events,
        losses=recorder.losses,
        state_dict={k: v.detach().clone() for k, v in type(model).state_dict(model).items()},
        metrics={name: _floats(getattr(trainer, name, {}) or {})
                 for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics")},
        outputs=outputs, global_step=int(trainer.global_step), current_epoch=int(trainer.current_epoch),
        extra=extra,
    )


def snapshot(stage: str, trainer: Any, model: Any) -> dict[str, Any]:
    """What a user can read after a Trainer call: the three metrics dicts, the weights and buffers, the
    step and epoch, and the rows of the CSV logger's file (read back from disk, as written so far)."""
    rows = None
    for lg in trainer.loggers:
        if type(lg).__name__ == "CSVLogger":
            lg.save()  # what a user reading the file after the call sees: it is written at stage end anyway
            path = os.path.join(lg.log_dir, "metrics.csv")
            if os.path.exists(path):
                with open(path, newline="", encoding="utf-8") as fh:
                    rows = list(csv.DictReader(fh))
    return {"stage": stage, "metrics": {name: _floats(getattr(trainer, name, {}) or {})
                                        for name in ("callback_metrics", "logged_metrics",
                                                     "progress_bar_metrics")},
            "state_dict": {k: v.detach().clone() for k, v in type(model).state_dict(model).items()},
            "global_step": int(trainer.global_step), "current_epoch": int(trainer.current_epoch), "csv": rows}


def describe_sampler(loader: Any) -> dict[str, Any] | None:
    """The sampler of a (processed) DataLoader: its class and the DistributedSampler settings if any."""
    if loader is None or callable(loader) and not hasattr(loader, "sampler"):
        return None
    loaders = getattr(loader, "flattened", None) or [loader]  # Lightning's CombinedLoader
    sampler = getattr(loaders[0], "sampler", None)
    if sampler is None:
        return None
    out: dict[str, Any] = {"class": type(sampler).__name__}
    for attr in ("num_replicas", "rank", "shuffle", "seed", "drop_last", "epoch"):
        if hasattr(sampler, attr):
            out[attr] = getattr(sampler, attr)
    out["batch_size"] = getattr(loaders[0], "batch_size", None)
    out["loader_drop_last"] = getattr(loaders[0], "drop_last", None)
    return out


def _distributed_worker(rank: int, world_size: int, framework: str, case: str,
                        kwargs: dict[str, Any]) -> RunResult:
    return run_case(framework, case, world_size=world_size, rank=rank, **kwargs)


def run_case_distributed(framework: str, case: str, world_size: int = 2, *, timeout: float = 300.0,
                         **kwargs: Any) -> list[RunResult]:
    """``run_case`` on ``world_size`` fresh gloo processes (one result per rank); every rank shares
    one ``root_dir``. The processes come from ``tests/distributed.py``'s fork server."""
    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import distributed

    if distributed._context is None and "lightning.pytorch" not in distributed._PRELOAD:
        # Lightning takes seconds to import: import it once in the fork server, not in every rank.
        if importlib.util.find_spec("lightning") is not None:
            distributed._PRELOAD.append("lightning.pytorch")
    kwargs.setdefault("root_dir", tempfile.mkdtemp(prefix=f"{framework}-{case}-ddp-", dir=_scratch_dir()))
    return distributed.run_distributed(_distributed_worker, world_size, framework, case, kwargs,
                                       timeout=timeout)
