"""Every hook goes through one funnel (``Hooks``), and one function answers "is this hook overridden?".

The funnel's verbs, in the spirit of Lightning's ``trainer/call.py``:

- ``hooks(name, *args)``: the callbacks that override ``name`` (in list order), then the module;
- ``hooks.callbacks(name, *args)``: the callbacks only (``setup``, ``on_exception``, ``on_log``, ...);
- ``hooks.module(name, *args)``: the module only (``configure_optimizers``, ``lr_scheduler_step``, ...);
- ``hooks.datamodule(name, *args)``: the DataModule only (``prepare_data``, ``on_exception``, ...);
- ``hooks.batch_plan(name)``: the callables a per-batch hook runs, bound once per epoch;
- ``hooks.epoch_end(name, after_module)``: an epoch-end hook with the epoch's reduction between the
  module's hook and the callbacks that watch metrics;
- ``hooks.transfer_plan()``: the batch-transfer hooks anyone overrides (the DataModule's first).

Which callables override a hook is worked out once per stage (``plan``), so a hook no one overrides
costs a dict lookup and an empty loop. A profiler wraps the plan's callables when it is built, so
every hook is timed here and nowhere else. Callbacks that watch metrics (checkpointing, early stopping,
loggers) run their ``on_train_epoch_end`` after the module's, so they see what it logged there
(Lightning's exception to "callbacks first"). A hook name that nothing calls, defined on a module, a
callback or a DataModule (``on_train_epoch_begin``), warns once per class.
"""

from __future__ import annotations

import difflib
import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

from polytrain.callbacks.base import Callback
from polytrain.trainer.api.datamodule import DataModule
from polytrain.trainer.api.module import TrainModule

# Hooks called on callbacks, with (trainer, module, *args); on_log with (trainer, *args).
CALLBACK_HOOKS = frozenset({
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
    "on_save_checkpoint", "on_load_checkpoint", "on_exception", "on_log",
})
# Hooks and overridable methods called on the module (besides those it shares with callbacks).
MODULE_ONLY_HOOKS = frozenset({
    "prepare_data", "configure_callbacks", "configure_model", "configure_optimizers",
    "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
    "training_step", "validation_step", "test_step", "predict_step", "forward", "backward",
    "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping",
    "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "on_validation_model_eval", "on_validation_model_train", "on_validation_model_zero_grad",
    "on_test_model_eval", "on_test_model_train", "on_predict_model_eval",
})
MODULE_HOOKS = (CALLBACK_HOOKS - {"on_sanity_check_start", "on_sanity_check_end", "on_exception", "on_log"}
                ) | MODULE_ONLY_HOOKS
DATAMODULE_HOOKS = frozenset({
    "prepare_data", "setup", "teardown", "train_dataloader", "val_dataloader", "test_dataloader",
    "predict_dataloader", "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "state_dict", "load_state_dict", "on_exception",
})
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
_AFTER_MODULE = frozenset({"on_train_epoch_end"})
_WITHOUT_MODULE = frozenset({"on_log"})  # Callback.on_log(trainer, metrics, step)
# Module hooks whose default body does the work (switching to eval mode, freeing gradients): called
# whether or not the module overrides them.
ALWAYS_CALLED = frozenset({"on_validation_model_eval", "on_validation_model_zero_grad", "on_test_model_eval",
                           "on_predict_model_eval"})


def is_overridden(obj: Any, name: str, base: type, *, patched: bool = False) -> bool:
    """Whether ``obj`` brings its own code for ``name`` instead of ``base``'s (Lightning's rule: seen
    through ``functools.wraps`` wrappers; a ``Mock`` counts as overridden).

    Lightning asks this for hooks it calls only when defined (``prepare_data``, ``configure_model``,
    the ``*_dataloader`` methods, ``on_validation_model_train``). Every other hook Lightning calls
    always; polytrain skips those nobody overrides, and there ``patched=True`` also counts a callable
    set on the instance (a wrapper, a mock): skipping it would then be visible."""
    if patched and name in getattr(obj, "__dict__", {}):
        return True
    attr = getattr(obj, name, None)
    if attr is None:
        return False
    attr = getattr(attr, "__wrapped__", attr)
    mock = sys.modules.get("unittest.mock")  # a Mock can only exist once its module was imported
    if mock is not None and isinstance(attr, mock.NonCallableMock):
        return True
    return getattr(attr, "__func__", attr) is not getattr(base, name, None)


# classes already read: dir() of a module class is slow, and asked often
_read: set[tuple[type, type]] = set()


def warn_unknown_hooks(obj: Any, known: frozenset[str], base: type) -> None:
    """Warn once per class about ``on_*`` methods nothing calls: a typo, or a hook polytrain lacks."""
    if (type(obj), base) in _read:
        return
    _read.add((type(obj), base))
    for name in dir(type(obj)):
        if not name.startswith("on_") or name in known:
            continue
        if not callable(getattr(type(obj), name, None)) or hasattr(base, name):
            continue
        renamed = name.replace("_begin", "_start")  # Lightning 0.x's names (on_epoch_begin, ...)
        close = [renamed] if renamed in known else difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        warnings.warn(f"{type(obj).__name__}.{name} is never called by polytrain: it is not one of its "
                      f"hooks.{hint}",
                      stacklevel=3)


def _idle(hook: Callable, name: str) -> bool:
    """A callback's per-batch hook that does nothing with the callback's present options (it lists it in
    ``idle_batch_hooks``, asked again each epoch): the loop does not call it."""
    owner = getattr(getattr(hook, "__wrapped__", hook), "__self__", None)  # through a profiler's wrapper
    return name in getattr(owner, "idle_batch_hooks", ())


Plan = tuple[list[Callable], list[Callable], Callable | None]


def _no_wrap(row: str, fn: Callable) -> Callable:
    return fn


class Hooks:
    """The funnel of one stage: ``hooks(name, *args)`` calls the overriding callbacks
    (``cb.name(trainer, module, *args)``) then the module's ``name(*args)`` if it has one.

    ``instrument(row, fn)`` (a profiler's) wraps each planned callable once; the default returns it."""

    def __init__(self, trainer: Any, module: TrainModule, callbacks: list[Callback],
                 datamodule: DataModule | None = None,
                 instrument: Callable[[str, Callable], Callable] | None = None
                 ) -> None:
        self.trainer = trainer
        self._module = module
        self._callbacks = callbacks
        self._datamodule = datamodule
        self.instrument = instrument or _no_wrap
        self._plans: dict[str, Plan] = {}
        self._datamodule_hooks: dict[str, Callable | None] = {}

    def plan(self, name: str) -> Plan:
        """(callbacks before the module, callbacks after it, the module's hook or None)."""
        cached = self._plans.get(name)
        if cached is None:
            before, after = [], []
            for cb in self._callbacks:
                if is_overridden(cb, name, Callback, patched=True):
                    (after if name in _AFTER_MODULE and cb.watches_metrics else before).append(
                        self.instrument(f"[Callback]{cb.state_key}.{name}", getattr(cb, name)))
            module_hook = None
            if name in MODULE_HOOKS and (name in ALWAYS_CALLED or name in MODULE_ONLY_HOOKS
                                          or is_overridden(self._module, name, TrainModule, patched=True)):
                module_hook = self.instrument(f"[LightningModule]{type(self._module).__name__}.{name}",
                                              getattr(self._module, name))
            cached = self._plans[name] = (before, after, module_hook)
        return cached

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        before, after, module_hook = self.plan(name)
        trainer, module = self.trainer, self._module
        for fn in before:
            fn(trainer, module, *args, **kwargs)
        result = module_hook(*args, **kwargs) if module_hook is not None else None
        for fn in after:
            fn(trainer, module, *args, **kwargs)
        return result

    def epoch_end(self, name: str, after_module: Callable[[], None]) -> None:
        """``name`` with ``after_module()`` between the module's hook and the callbacks that watch metrics
        (the epoch's values logged in the module's hook are reduced there, before those callbacks read
        them)."""
        before, after, module_hook = self.plan(name)
        trainer, module = self.trainer, self._module
        for fn in before:
            fn(trainer, module)
        if module_hook is not None:
            module_hook()
        after_module()
        for fn in after:
            fn(trainer, module)

    def callbacks(self, name: str, *args: Any, **kwargs: Any) -> None:
        before, after, _ = self.plan(name)
        bound = (self.trainer,) if name in _WITHOUT_MODULE else (self.trainer, self._module)
        for fn in (*before, *after):
            fn(*bound, *args, **kwargs)

    def module(self, name: str, *args: Any, **kwargs: Any) -> Any:
        module_hook = self.plan(name)[2]
        return module_hook(*args, **kwargs) if module_hook is not None else None

    def datamodule(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._datamodule is None:
            return None
        if name not in self._datamodule_hooks:
            row = f"[LightningDataModule]{type(self._datamodule).__name__}.{name}"
            self._datamodule_hooks[name] = self.instrument(row, getattr(self._datamodule, name))
        return self._datamodule_hooks[name](*args, **kwargs)

    def overrides(self, name: str) -> bool:
        """Whether the module overrides ``name`` (a hook with a default body the loop may skip)."""
        return is_overridden(self._module, name, TrainModule, patched=True)

    def module_hook(self, name: str) -> Callable | None:
        """The module's ``name`` as the funnel calls it, when the module overrides it (else None: the loop
        does what the default would, without the call)."""
        return self.plan(name)[2] if self.overrides(name) else None

    def batch_plan(self, name: str) -> list[Callable]:
        """One list of callables taking the hook's own arguments, for hooks called every batch."""
        before, after, module_hook = self.plan(name)
        trainer, module = self.trainer, self._module
        # functools.partial is written in C: binding (trainer, module) adds no Python frame per call.
        calls: list[Callable] = [functools.partial(fn, trainer, module) for fn in before
                                 if not _idle(fn, name)]
        if module_hook is not None:
            calls.append(module_hook)
        calls.extend(functools.partial(fn, trainer, module) for fn in after if not _idle(fn, name))
        return calls

    def transfer_plan(self) -> tuple[Callable | None, Callable | None, Callable | None]:
        """The batch-transfer hooks (``on_before_batch_transfer``, ``transfer_batch_to_device``,
        ``on_after_batch_transfer``): the DataModule's where it defines one (as Lightning), else the
        module's where it overrides one; None where nobody does (Lightning calls them always: skipping one
        nobody redefined changes nothing)."""
        chosen: list[Callable | None] = []
        for name in TRANSFER_HOOKS:
            if self._datamodule is not None and is_overridden(self._datamodule, name, DataModule):
                chosen.append(functools.partial(self.datamodule, name))
            elif is_overridden(self._module, name, TrainModule, patched=True):
                chosen.append(self.plan(name)[2])
            else:
                chosen.append(None)
        return chosen[0], chosen[1], chosen[2]
