"""Every hook goes through one funnel: the callbacks that override it (in list order), then the module.

Which callbacks override a hook is worked out once per run, so a hook no one overrides costs a dict
lookup and an empty loop; the training loop reads its per-batch plans once per epoch. Names follow
Lightning's (``trainer/call.py``'s order too): callbacks before the module, except that callbacks that
watch metrics (checkpointing, early stopping, loggers) run their ``on_train_epoch_end`` after the
module's, so they see what it logged there. A hook name that nothing calls, defined on a module or a
callback (``on_train_epoch_begin``, a Lightning hook polytrain lacks), warns once.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Callable
from typing import Any

from polytrain.callbacks.base import Callback
from polytrain.trainer.module import TrainModule

# Hooks called on callbacks, with (trainer, module, *args).
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
_AFTER_MODULE = frozenset({"on_train_epoch_end"})
# Module hooks whose default body does the work (switching to eval mode, freeing gradients): called
# whether or not the module overrides them.
ALWAYS_CALLED = frozenset({"on_validation_model_eval", "on_validation_model_zero_grad", "on_test_model_eval",
                           "on_predict_model_eval"})


def overridden(obj: Any, name: str, base: type) -> bool:
    """False only when ``obj.name`` is ``base``'s own method (not redefined by its class or instance).
    For hooks Lightning always calls: skipping one nobody redefined is then invisible."""
    return name in getattr(obj, "__dict__", {}) or getattr(type(obj), name, None) is not getattr(base, name, None)


def defines(obj: Any, name: str, base: type) -> bool:
    """Whether ``obj`` has its own code for ``name`` (seen through ``functools.wraps`` wrappers): for
    hooks Lightning calls only when the module defines them (``prepare_data``, ``configure_model``,
    ``on_validation_model_train``, ...)."""
    attr = getattr(obj, "__dict__", {}).get(name)
    fn = getattr(type(obj), name, None) if attr is None else getattr(attr, "__wrapped__", attr)
    fn = getattr(fn, "__func__", fn)
    return fn is not getattr(base, name, None)


def runs_after_module(callback: Callback) -> bool:
    return bool(getattr(callback, "watches_metrics", False))


_read: set[tuple[type, type]] = set()  # classes already read: dir() of a module class is ~30 us, 7 per fit


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
        warnings.warn(f"{type(obj).__name__}.{name} is never called by polytrain: it is not one of its hooks.{hint}",
                      stacklevel=3)


def _idle(hook: Callable, name: str) -> bool:
    """A callback's per-batch hook that does nothing with the callback's present options (it lists it in
    ``idle_batch_hooks``, asked again each epoch): the loop does not call it."""
    return name in getattr(getattr(hook, "__self__", None), "idle_batch_hooks", ())


class Hooks:
    """The funnel for one run: ``hooks(name, *args)`` calls the overriding callbacks
    (``cb.name(trainer, module, *args)``) then the module's ``name(*args)`` if it has one."""

    def __init__(self, trainer: Any, module: TrainModule, callbacks: list[Callback]) -> None:
        self.trainer = trainer
        self.module = module
        self.callbacks = callbacks
        self._module_base = TrainModule
        self._plans: dict[str, tuple[list[Callable], list[Callable], Callable | None]] = {}
        profiler = getattr(trainer, "profiler", None)  # trainer.profiler: each planned call timed when on
        self._profiler = profiler if getattr(profiler, "enabled", False) else None

    def plan(self, name: str) -> tuple[list[Callable], list[Callable], Callable | None]:
        """(callbacks before the module, callbacks after it, the module's hook or None)."""
        cached = self._plans.get(name)
        if cached is None:
            before, after = [], []
            for cb in self.callbacks:
                if overridden(cb, name, Callback):
                    (after if name in _AFTER_MODULE and runs_after_module(cb) else before).append(getattr(cb, name))
            module_hook = getattr(self.module, name, None) \
                if name in ALWAYS_CALLED or overridden(self.module, name, self._module_base) else None
            cached = (before, after, module_hook)
            if self._profiler is not None:
                cached = self._profiler.wrap_plan(name, cached)
            self._plans[name] = cached
        return cached

    def batch_plan(self, name: str) -> list[Callable]:
        """One list of callables taking the hook's own arguments, for hooks called every batch."""
        before, after, module_hook = self.plan(name)
        trainer, module = self.trainer, self.module
        # functools.partial is written in C: binding (trainer, module) adds no Python frame per call.
        calls: list[Callable] = [functools.partial(fn, trainer, module) for fn in before if not _idle(fn, name)]
        if module_hook is not None:
            calls.append(module_hook)
        calls.extend(functools.partial(fn, trainer, module) for fn in after if not _idle(fn, name))
        return calls

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        before, after, module_hook = self.plan(name)
        for fn in before:
            fn(self.trainer, self.module, *args, **kwargs)
        result = module_hook(*args, **kwargs) if module_hook is not None else None
        for fn in after:
            fn(self.trainer, self.module, *args, **kwargs)
        return result

    def callbacks_only(self, name: str, *args: Any, **kwargs: Any) -> None:
        before, after, _ = self.plan(name)
        for fn in (*before, *after):
            fn(self.trainer, self.module, *args, **kwargs)

    def module_overrides(self, name: str) -> bool:
        return self.plan(name)[2] is not None
