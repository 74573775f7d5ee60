"""Hyperparameters: ``save_hyperparameters()`` from ``__init__`` arguments, ``self.hparams``, and
rebuilding a module or DataModule from a checkpoint (``load_from_checkpoint``), as Lightning does.

A checkpoint stores the hyperparameters as plain values (``hyper_parameters``): numbers, strings,
lists, dicts. Anything else (an ``nn.Module`` argument, say) is stored by its ``repr`` and must be
passed again to ``load_from_checkpoint``; ``save_hyperparameters(ignore=[...])`` leaves it out.
"""

from __future__ import annotations

import copy
import inspect
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from polytrain.checkpoint.reading import read_checkpoint


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``hparams.lr`` and ``hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(f"no hyperparameter {key!r}; saved: {', '.join(self) or '(none)'}") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def _init_args(frame: types.FrameType) -> dict[str, Any]:
    """The arguments of the ``__init__`` running in ``frame``, ``**kwargs`` spread out."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    local = frame.f_locals
    args = {n: local[n] for n in names[1:] if n in local}  # [0] is self
    if code.co_flags & inspect.CO_VARKEYWORDS:
        extra = code.co_varnames[code.co_argcount + code.co_kwonlyargcount
                                 + bool(code.co_flags & inspect.CO_VARARGS)]
        args.update(local.get(extra) or {})
    return args


def _collect_init_args(frame: types.FrameType, owner: Any) -> dict[str, Any]:
    """Arguments of every ``__init__`` of ``owner`` on the stack, outermost (the subclass's) winning."""
    found: dict[str, Any] = {}
    while frame is not None:
        if frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is owner:
            found = {**_init_args(frame), **found}
        frame = frame.f_back
    return found


class HyperparametersMixin:
    """``save_hyperparameters``, ``hparams``, ``hparams_initial`` for modules and DataModules. Also usable
    on any class (Lightning's composition: a plain object or an ``nn.Module`` that saves its own)."""

    # Lightning's names for the checkpoint keys that hold the hyperparameters
    CHECKPOINT_HYPER_PARAMS_KEY = "hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "hparams_name"
    CHECKPOINT_HYPER_PARAMS_TYPE = "hparams_type"

    def save_hyperparameters(self, *args: Any, ignore: Sequence[str] | str | None = None,
                             frame: types.FrameType | None = None, logger: bool = True) -> None:
        """Store ``__init__``'s arguments (or the names given, or one dict/namespace) in ``self.hparams``;
        they go into every checkpoint and to the loggers."""
        ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
        if frame is None:
            frame = inspect.currentframe().f_back  # the __init__ that called us
        init_args = _collect_init_args(frame, self)
        if len(args) == 1 and not isinstance(args[0], str):
            source = args[0]
            # A dict (or DictConfig), or a namespace (argparse.Namespace, SimpleNamespace).
            values = dict(source) if isinstance(source, Mapping) else dict(vars(source))
        elif args:
            unknown = [a for a in args if a not in init_args]
            if unknown:
                raise ValueError(f"save_hyperparameters{args}: {unknown} are not arguments of "
                                 f"{type(self).__name__}.__init__ ({', '.join(init_args) or 'none'})")
            values = {a: init_args[a] for a in args}
        else:
            values = {k: v for k, v in init_args.items() if k not in ignore}
        modules = [k for k, v in values.items() if isinstance(v, nn.Module)]
        if modules:
            warnings.warn(f"{type(self).__name__}.save_hyperparameters(): {modules} each is an instance "
                          f"of `nn.Module` and is already saved with the weights; pass ignore={modules} to "
                          f"leave them out", stacklevel=2)
        hparams = self.__dict__.setdefault("_hparams", AttributeDict())
        hparams.update(values)
        self.__dict__["_hparams_initial"] = copy.deepcopy(AttributeDict(hparams))
        self.__dict__["_log_hyperparams"] = logger

    @property
    def hparams(self) -> AttributeDict:
        return self.__dict__.setdefault("_hparams", AttributeDict())

    @property
    def hparams_initial(self) -> AttributeDict:
        return copy.deepcopy(self.__dict__.get("_hparams_initial", AttributeDict()))


def plain(value: Any) -> Any:
    """What ``torch.load(weights_only=True)`` can read back: plain values kept, others by ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return repr(value)


def load_module_from_checkpoint(cls: type, path: str, map_location: Any = None, strict: bool = True,
                                **kwargs: Any) -> Any:
    """``cls(**saved hyperparameters, **kwargs)`` with the checkpoint's weights (any polytrain checkpoint:
    a file, or a sharded directory read whole in this process)."""
    checkpoint = read_checkpoint(path)
    hparams = {**checkpoint.get("hyper_parameters", {}), **kwargs}
    try:
        module = cls(**hparams)
    except TypeError as err:
        raise TypeError(f"{cls.__name__}.load_from_checkpoint({path!r}): cannot build {cls.__name__}(**"
                        f"{sorted(hparams)}): {err}. Pass missing or non-plain arguments "
                        f"as keywords") from None
    if callable(getattr(module, "configure_model", None)):
        module.configure_model()
    state = checkpoint.get("model", {})
    checkpoint.setdefault("state_dict", state)  # the key Lightning code reads in on_load_checkpoint
    module.on_load_checkpoint(checkpoint)
    device = _mapped_device(map_location)
    if device is not None:
        state = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    module.load_state_dict(state, strict=strict)
    if device is not None:
        module.to(device)
    return module.train()  # as Lightning


def _mapped_device(map_location: Any) -> torch.device | None:
    """Where the weights go (they are read to the CPU): a device or its name, or ``torch.load``'s dict form
    ``{"cuda:0": "cpu"}`` applied to the CPU tensors read; None keeps them on the CPU."""
    if map_location is None:
        return None
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return torch.device(target) if target is not None else None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise TypeError(f"load_from_checkpoint(map_location={map_location!r}): give a device, a device name or "
                    f"a dict such as {{'cuda:0': 'cpu'}} (the weights are read to the CPU first)")


def load_datamodule_from_checkpoint(cls: type, path: str, **kwargs: Any) -> Any:
    checkpoint = read_checkpoint(path)
    datamodule = cls(**{**checkpoint.get("datamodule_hyper_parameters", {}), **kwargs})
    state = checkpoint.get("datamodule", {}).get(type(datamodule).__qualname__)
    if state is not None:
        datamodule.load_state_dict(state)
    return datamodule
