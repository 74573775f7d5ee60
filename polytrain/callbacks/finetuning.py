"""Lightning's ``BaseFinetuning`` and ``BackboneFinetuning``: freeze part of a model before training and
unfreeze it later, each unfrozen part joining the optimizer as a parameter group of its own.

A subclass says what to freeze (``freeze_before_training``, called in ``setup``) and what to unfreeze
when (``finetune_function``, called for every optimizer as each training epoch starts). The parameter
groups each optimizer holds after that call are recorded by parameter name, and so is what trains then
(the parameters that require gradients, the BatchNorm layers that track statistics): a resumed fit
freezes and unfreezes as recorded and rebuilds the groups (``restore_param_groups``) before the
optimizer's saved state is loaded into them (Lightning restores the groups alone, so a backbone
unfrozen before the checkpoint stays frozen after the resume). The resume
(``trainer/persistence/resume.py``) calls it between reading the callbacks' states and loading the
optimizers, the order Lightning's ``on_fit_start`` restore relies on.

One process only: a data-parallel wrapper registers the parameters that train when it is built, so one
unfrozen later would train on each rank's gradients alone. ``setup`` refuses more than one process."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from polytrain.callbacks.base import Callback
from polytrain.core.errors import ConfigError
from polytrain.core.rank_zero import rank_zero_warn

log = logging.getLogger("polytrain")

Modules = nn.Module | Iterable[Any]


class BaseFinetuning(Callback):
    """Freezing and unfreezing, with the optimizers' parameter groups kept across a resume. Subclasses
    implement ``freeze_before_training(module)`` and ``finetune_function(module, epoch, optimizer)``."""

    def __init__(self) -> None:
        # optimizer index -> its parameter groups, each with parameter names in place of the tensors
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False
        # what trains, as the newest epoch start left it: parameter names requiring gradients, and the
        # BatchNorm layers tracking statistics (None: no epoch started)
        self._trainable: dict[str, list[str]] | None = None

    # ------------------------------------------------------------------ what a subclass implements
    def freeze_before_training(self, pl_module: nn.Module) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement freeze_before_training(pl_module)")

    def finetune_function(self, pl_module: nn.Module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement finetune_function(pl_module, epoch, "
                                  f"optimizer)")

    # ------------------------------------------------------------------ the hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.world_size > 1:
            raise ConfigError(f"{type(self).__name__} runs on one process only ({trainer.world_size} here): "
                              f"the data-parallel wrapper is built with the parameters that train then, so a "
                              f"part unfrozen later would not have its gradients averaged across ranks. "
                              f"Train with devices=1, or leave the parts trainable and give them a zero "
                              f"learning rate until they are to train")
        self.freeze_before_training(pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        for index, optimizer in enumerate(trainer.optimizers):
            groups_before = len(optimizer.param_groups)
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            self._record_groups(pl_module, index, optimizer.param_groups, groups_before)
        self._trainable = {
            "params": [name for name, p in pl_module.named_parameters() if p.requires_grad],
            "tracking": [name for name, m in pl_module.named_modules()
                         if isinstance(m, _BatchNorm) and m.track_running_stats]}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"internal_optimizer_metadata": self._internal_optimizer_metadata}
        if self._trainable is not None:
            state["trainable"] = self._trainable
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        self._trainable = state_dict.get("trainable")
        # files of Lightning versions that kept the mapping itself as the state
        metadata = state_dict.get("internal_optimizer_metadata",
                                  {k: v for k, v in state_dict.items() if k != "trainable"})
        self._internal_optimizer_metadata = dict(metadata)

    def restore_param_groups(self, pl_module: nn.Module, optimizers: list[torch.optim.Optimizer],
                             state: dict[str, Any]) -> None:
        """A resume: each optimizer gets back the parameter groups ``state`` recorded (by name), before its
        saved state is loaded into them."""
        self.load_state_dict(state)
        by_name = dict(pl_module.named_parameters())
        if self._trainable is not None:  # what froze and unfroze before the checkpoint
            trainable, tracking = set(self._trainable["params"]), set(self._trainable["tracking"])
            for name, param in by_name.items():
                param.requires_grad = name in trainable
            for name, module in pl_module.named_modules():
                if isinstance(module, _BatchNorm):
                    module.track_running_stats = name in tracking
        for index, optimizer in enumerate(optimizers):
            recorded = self._internal_optimizer_metadata.get(index)
            if recorded is None:
                continue
            missing = sorted({name for group in recorded for name in group["params"]} - set(by_name))
            if missing:
                raise ConfigError(f"{type(self).__name__}: the checkpoint's optimizer {index} holds "
                                  f"parameters this module lacks: {missing[:5]}; resume with the model it "
                                  f"was saved with")
            optimizer.param_groups = [_with_params(group, lambda name: by_name[name]) for group in recorded]
        self._restarting = False

    def _record_groups(self, pl_module: nn.Module, index: int, groups: list[dict[str, Any]],
                       groups_before: int) -> None:
        name_of = {param: name for name, param in pl_module.named_parameters()}
        known = self._internal_optimizer_metadata.get(index)
        if known is None:
            self._internal_optimizer_metadata[index] = [_with_params(g, name_of.__getitem__) for g in groups]
        elif len(groups) != groups_before:  # the groups finetune_function just added
            known.extend(_with_params(g, name_of.__getitem__) for g in groups[groups_before:])

    # ------------------------------------------------------------------ helpers (Lightning's static methods)
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules under ``modules`` (a module, a ModuleDict, or an iterable of either), and the
        non-leaf ones that hold parameters of their own."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, nn.Module):
            found: Iterable[nn.Module] = modules.modules()
        else:
            found = [m for item in modules for m in BaseFinetuning.flatten_modules(item)]
        return [m for m in found if not list(m.children()) or list(m.parameters(recurse=False))]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True,
                      requires_grad: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm's only with
        ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for param in module.parameters(recurse=False):  # a parent's own, once
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """No gradients for ``module``'s own parameters; a BatchNorm also stops tracking its statistics."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer,
                            params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` that no group of ``optimizer`` holds yet (the others are named in a warning)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        fresh = [p for p in params if id(p) not in held]
        if len(fresh) != len(params):
            rank_zero_warn(f"The provided params to be frozen already exist within another group of this "
                           f"optimizer: {len(params) - len(fresh)} of them are skipped. Did you init your "
                           f"optimizer in `configure_optimizers` with only the trainable parameters, e.g. "
                           f"{type(optimizer).__name__}(filter(lambda p: p.requires_grad, "
                           f"self.parameters()), ...)?")
        return fresh

    @staticmethod
    def unfreeze_and_add_param_group(modules: Modules, optimizer: torch.optim.Optimizer,
                                     lr: float | None = None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        """Make ``modules`` trainable and add their parameters the optimizer does not hold yet as a new
        group, at ``lr`` (default: the first group's rate divided by ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        rate = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": rate})


def _with_params(group: dict[str, Any], convert: Callable[[Any], Any]) -> dict[str, Any]:
    """``group`` with each of its parameters converted (a tensor to its name, or back)."""
    converted = {k: v for k, v in group.items() if k != "params"}
    converted["params"] = [convert(p) for p in group["params"]]
    return converted


def multiplicative(epoch: int) -> float:
    """BackboneFinetuning's default schedule: the backbone's rate doubles each epoch."""
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """Freeze ``module.backbone`` until epoch ``unfreeze_backbone_at_epoch``; then train it in a group of its
    own, starting at ``backbone_initial_lr`` (default: the first group's rate times
    ``backbone_initial_ratio_lr``) and multiplied by ``lambda_func(epoch + 1)`` each epoch after, never above
    the first group's rate when ``should_align``."""

    def __init__(self, unfreeze_backbone_at_epoch: int = 10,
                 lambda_func: Callable[[int], float] = multiplicative,
                 backbone_initial_ratio_lr: float = 1e-1, backbone_initial_lr: float | None = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = False,
                 verbose: bool = False, rounding: int = 12) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict.get("previous_backbone_lr")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "previous_backbone_lr"})

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), nn.Module):
            raise ConfigError(f"BackboneFinetuning needs the module to have an nn.Module `backbone` "
                              f"attribute; {type(pl_module).__name__} has none")
        super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: nn.Module) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: nn.Module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch < self.unfreeze_backbone_at_epoch:
            return
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                           else current_lr * self.backbone_initial_ratio_lr)
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, backbone_lr,
                                              train_bn=self.train_bn, initial_denom_lr=self.initial_denom_lr)
        else:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
        self.previous_backbone_lr = backbone_lr
        if self.verbose:
            log.info("Current lr: %s, Backbone lr: %s", round(current_lr, self.rounding),
                     round(backbone_lr, self.rounding))
