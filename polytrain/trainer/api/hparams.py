"""Hyperparameters: ``save_hyperparameters()`` from ``__init__`` arguments, ``self.hparams``, and
rebuilding a module or DataModule from a checkpoint (``load_from_checkpoint``), as Lightning does.

A checkpoint stores the hyperparameters as plain values (``hyper_parameters``): numbers, strings,
lists, dicts. Anything else (an ``nn.Module`` argument, say) is stored by its ``repr`` and must be
passed again to ``load_from_checkpoint``; ``save_hyperparameters(ignore=[...])`` leaves it out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from omegaconf import OmegaConf
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


def _collect_init_args(frame: types.FrameType | None) -> dict[str, Any]:
    """The ``__init__`` arguments ``save_hyperparameters`` takes, by Lightning's rule: from the calling
    method outwards, the unbroken run of frames of methods (they use ``super()``, so they hold
    ``__class__``) on objects that keep hyperparameters, the outermost winning. That is the subclasses'
    ``__init__`` chain, and, in a composition, a module built inside another such module's ``__init__``
    takes that module's arguments too; a plain object's ``__init__`` (or a decorator's wrapper) ends it."""
    chain: list[dict[str, Any]] = []
    inside = False
    while frame is not None:
        local = frame.f_locals
        if "__class__" in local and isinstance(local.get("self"), HyperparametersMixin):
            chain.append(_init_args(frame))
            inside = True
        elif inside:
            break
        frame = frame.f_back
    found: dict[str, Any] = {}
    for args in chain:
        found.update(args)
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
        if dataclasses.is_dataclass(self):  # its generated __init__ is no method chain: its init fields
            init_args = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        else:
            init_args = _collect_init_args(frame)
        container: tuple[str | None, str] | None = None
        if len(args) == 1 and not isinstance(args[0], str):
            source = args[0]
            if isinstance(source, (bool, int, float)):
                raise ValueError(f"save_hyperparameters({source!r}): Primitives {(bool, int, float, str)} "
                                 f"are not allowed; pass argument names, a dict, a Namespace or a DictConfig")
            # A dict (or DictConfig), or a namespace (argparse.Namespace, SimpleNamespace): remembered with
            # the __init__ argument that held it, so load_from_checkpoint passes it back the same way.
            name = next((k for k, v in init_args.items() if v is source), None)
            container = (name, _container_type(source))
            values = (_to_plain_container(source) if isinstance(source, Mapping) else dict(vars(source)))
        elif args:
            values_given = [a for a in args if isinstance(a, (bool, int, float))]
            if values_given:  # save_hyperparameters(arg1, arg2): values where their names belong
                raise ValueError(f"save_hyperparameters{args}: Primitives {(bool, int, float, str)} are not "
                                 f"allowed as hyperparameters themselves; {values_given} look like values. "
                                 f"Pass the names of {type(self).__name__}.__init__'s arguments "
                                 f"({', '.join(init_args) or 'none'}), or one dict, Namespace or DictConfig")
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
        # as Lightning: a later call (a subclass's) adds to what an earlier one saved, and its ignore= also
        # drops those names from it
        hparams = self.__dict__.setdefault("_hparams", AttributeDict())
        hparams.update(values)
        for name in ignore:
            hparams.pop(name, None)
        self.__dict__["_hparams_initial"] = copy.deepcopy(AttributeDict(hparams))
        self.__dict__["_log_hyperparams"] = logger
        if container is not None:
            self.__dict__["_hparams_name"], self.__dict__["_hparams_type"] = container
            if container[1] == "DictConfig":  # an OmegaConf config stays one, as in Lightning
                self.__dict__["_hparams"] = self.__dict__["_hparams_initial"] = copy.deepcopy(source)

    @property
    def hparams(self) -> AttributeDict:
        return self.__dict__.setdefault("_hparams", AttributeDict())

    @property
    def hparams_initial(self) -> AttributeDict:
        return copy.deepcopy(self.__dict__.get("_hparams_initial", AttributeDict()))


def _container_type(source: Any) -> str:
    if _is_omegaconf(source):
        return "DictConfig"
    return "Namespace" if not isinstance(source, Mapping) else "dict"


def _is_omegaconf(value: Any) -> bool:
    return type(value).__module__.startswith("omegaconf")


def _to_plain_container(source: Mapping[str, Any]) -> dict[str, Any]:
    if _is_omegaconf(source):
        return OmegaConf.to_container(source, resolve=True)
    return dict(source)


def _rebuilt_container(values: dict[str, Any], kind: str | None) -> Any:
    """The hyperparameters as the ``__init__`` argument took them (``_container_type``)."""
    if kind == "DictConfig":
        return OmegaConf.create(values)
    if kind == "Namespace":
        return argparse.Namespace(**values)
    return values


def hparams_container(obj: Any) -> dict[str, Any]:
    """What a checkpoint records beside ``obj``'s hyperparameters when one dict, Namespace or DictConfig held
    them: the ``__init__`` argument it came in (``hparams_name``) and its kind (``hparams_type``); and which
    hyperparameters were OmegaConf configs (``hparams_omegaconf``: stored as plain dicts and lists, so the
    file loads with ``weights_only=True``, and rebuilt as configs by ``load_from_checkpoint``, where
    Lightning pickles them). A plain function, not a method: a module's namespace holds Lightning's names
    and the user's own only."""
    name, kind = obj.__dict__.get("_hparams_name"), obj.__dict__.get("_hparams_type")
    record: dict[str, Any] = {} if kind is None else {"hparams_name": name, "hparams_type": kind}
    hparams = obj.__dict__.get("_hparams")
    configs = [str(k) for k, v in (hparams or {}).items() if _is_omegaconf(v)] if kind is None else []
    if configs:
        record["hparams_omegaconf"] = configs
    return record


def plain(value: Any) -> Any:
    """What ``torch.load(weights_only=True)`` can read back: plain values kept, others by ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _is_omegaconf(value):
        return plain(_to_plain_container(value))
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return repr(value)


def init_arguments(cls: type, checkpoint: dict[str, Any], prefix: str, overrides: dict[str, Any]
                   ) -> dict[str, Any]:
    """The keywords to rebuild ``cls`` from a checkpoint, as Lightning's: the saved hyperparameters (passed
    back as the one dict, Namespace or DictConfig argument that held them, where one did), ``overrides``
    winning, and, for an ``__init__`` without ``**kwargs``, only the names it takes."""
    # older Lightning files kept them under "hparams" or "module_arguments" (a module's, not a DataModule's)
    keys = [f"{prefix}hyper_parameters"] + ([] if prefix else ["hparams", "module_arguments"])
    saved = dict(next((checkpoint[key] for key in keys if checkpoint.get(key) is not None), {}))
    for key in checkpoint.get(f"{prefix}hparams_omegaconf", ()):
        if isinstance(saved.get(key), (dict, list)):
            saved[key] = OmegaConf.create(saved[key])
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # [0] is self
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    name = checkpoint.get(f"{prefix}hparams_name")
    if name and name in named:  # (Lightning writes "kwargs" for init arguments: those are spread)
        saved = {name: _rebuilt_container(saved, checkpoint.get(f"{prefix}hparams_type"))}
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return {**saved, **overrides}
    unknown = sorted(set(overrides) - named)
    if unknown:
        warnings.warn(f"{cls.__name__}.load_from_checkpoint: {unknown} ignored: not arguments of "
                      f"{cls.__name__}.__init__ ({', '.join(sorted(named)) or 'none'}), as Lightning drops "
                      f"them", stacklevel=4)
    return {k: v for k, v in {**saved, **overrides}.items() if k in named}


def load_module_from_checkpoint(cls: type, path: str, map_location: Any = None, strict: bool = True,
                                weights_only: bool | None = None, **kwargs: Any) -> Any:
    """``cls(**saved hyperparameters, **kwargs)`` with the checkpoint's weights (any polytrain checkpoint:
    a file, or a sharded directory read whole in this process)."""
    checkpoint = read_checkpoint(path, weights_only=weights_only is not False)
    hparams = init_arguments(cls, checkpoint, "", kwargs)
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


def load_datamodule_from_checkpoint(cls: type, path: str, weights_only: bool | None = None,
                                    **kwargs: Any) -> Any:
    checkpoint = read_checkpoint(path, weights_only=weights_only is not False)
    datamodule = cls(**init_arguments(cls, checkpoint, "datamodule_", kwargs))
    state = checkpoint.get("datamodule", {}).get(type(datamodule).__qualname__)
    if state is not None:
        datamodule.load_state_dict(state)
    return datamodule
