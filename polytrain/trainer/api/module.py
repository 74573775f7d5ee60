"""``TrainModule``: the user's model plus the steps and hooks the Trainer calls.

The hooks, their names, arguments and order are Lightning's (``LightningModule``), so a module
written for Lightning runs with its import renamed (``polytrain.LightningModule`` is this class).
Hooks with a default body (``optimizer_step``, ``backward``, ``transfer_batch_to_device``, ...) are
the default behaviour: override them to change it. docs/migrating-from-lightning.md lists them all.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from polytrain.core.errors import ConfigError
from polytrain.core.protocol import LOG_TAP, MUTED
from polytrain.trainer.api.data_hooks import DataHooks
from polytrain.trainer.api.hparams import HyperparametersMixin, load_module_from_checkpoint
from polytrain.trainer.observability.metrics import is_metric_object

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer


class TrainModule(HyperparametersMixin, DataHooks, nn.Module):
    """Subclass this; override ``training_step`` and ``configure_optimizers`` at least."""

    # Lightning's attribute; set it to describe an input (unused by polytrain)
    example_input_array: Any = None
    strict_loading: bool = True  # load_from_checkpoint's default for strict=None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Stored outside nn.Module's registries: the trainer is not a submodule or a buffer.
        self.__dict__["_trainer"] = None
        self.__dict__["_automatic_optimization"] = True
        self.__dict__["_param_requires_grad_state"] = {}

    # ------------------------------------------------------------------ trainer access
    @property
    def trainer(self) -> Trainer:
        trainer = self.__dict__.get("_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a `Trainer`; "
                               f"call trainer.fit(module) first")
        return trainer

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:  # Lightning code sets it to attach a module by hand
        self._attach(trainer)

    def _attach(self, trainer: Trainer | None) -> None:
        self.__dict__["_trainer"] = trainer

    def __getstate__(self) -> dict[str, Any]:
        # Sent to spawned workers without the parent's trainer.
        state = self.__dict__.copy()
        state["_trainer"] = None
        return state

    @property
    def automatic_optimization(self) -> bool:
        return self.__dict__.get("_automatic_optimization", True)

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self.__dict__["_automatic_optimization"] = bool(value)

    @property
    def dtype(self) -> torch.dtype:
        """The floating-point dtype of the parameters (float32 when there are none)."""
        param = next((p for p in self.parameters() if p.is_floating_point()), None)
        return param.dtype if param is not None else torch.float32

    @property
    def device(self) -> torch.device:
        trainer = self.__dict__.get("_trainer")
        if trainer is not None and trainer.strategy is not None:
            return trainer.strategy.root_device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _trainer_value(self, name: str, default: Any) -> Any:
        trainer = self.__dict__.get("_trainer")
        return getattr(trainer, name) if trainer is not None else default

    @property
    def global_rank(self) -> int:
        return self._trainer_value("global_rank", 0)

    @property
    def local_rank(self) -> int:
        return self._trainer_value("local_rank", 0)

    @property
    def current_epoch(self) -> int:
        return self._trainer_value("current_epoch", 0)

    @property
    def global_step(self) -> int:
        return self._trainer_value("global_step", 0)

    @property
    def logger(self) -> Any:
        return self._trainer_value("logger", None)

    @property
    def loggers(self) -> list[Any]:
        return self._trainer_value("loggers", [])

    # ------------------------------------------------------------------ logging
    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: str = "mean",
            enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
            add_dataloader_idx: bool = True, batch_size: int | None = None,
            metric_attribute: str | None = None, rank_zero_only: bool = False) -> None:
        """Record a metric. Training steps log per step by default; evaluation per epoch; epoch hooks
        per epoch. Epoch values are reduced (``reduce_fx``) over the epoch and across data-parallel
        ranks; ``sync_dist=True`` also reduces per-step values, on the steps that are logged.
        ``rank_zero_only`` is accepted for Lightning code and changes nothing (every rank logs)."""
        trainer = self.__dict__.get("_trainer")
        if trainer is None:
            return
        if add_dataloader_idx and "/dataloader_idx_" in name:
            raise ConfigError(f"You called `self.log` with the key `{name}` but it should not contain "
                              f"information about `dataloader_idx`: the suffix is polytrain's, added where "
                              f"several evaluation loaders run. Log the name alone, or pass "
                              f"add_dataloader_idx=False to keep it as written")
        if isinstance(value, nn.Module) and is_metric_object(value):
            check_metric_attribute(self, name, value, metric_attribute)
        if add_dataloader_idx and trainer.metrics.dataloader_idx is not None:
            name = f"{name}/dataloader_idx_{trainer.metrics.dataloader_idx}"  # several evaluation loaders
        tap = self.__dict__.get(LOG_TAP)  # set by a strategy around a padding batch or a pipeline stage
        if tap is not None:
            if tap is MUTED:
                return
            tap.append((name, torch.as_tensor(value).detach().reshape(()).float(),
                        dict(prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch,
                             reduce_fx=reduce_fx, sync_dist=sync_dist, batch_size=batch_size,
                             add_dataloader_idx=False)))  # the name is final: logged again as it is
            if getattr(tap, "silent", False):
                return  # recorded only (protocol.recorded_logs: a pipeline stage logs the mean later)
        trainer.metrics.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist,
                            batch_size)

    def log_dict(self, dictionary: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.global_rank == 0:
            builtins.print(*args, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``data`` (tensors, or dicts/lists of them) stacked along a new first dimension;
        unchanged on one process."""
        trainer = self.__dict__.get("_trainer")
        if trainer is None or trainer.world_size == 1:
            return data
        if isinstance(data, Mapping):
            return {k: self.all_gather(v, group, sync_grads) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.all_gather(v, group, sync_grads) for v in data)
        tensor = torch.as_tensor(data, device=self.device)
        return trainer.strategy.all_gather(tensor, group)

    # ------------------------------------------------------------------ model and optimisation
    def configure_model(self) -> None:
        """Build layers here instead of ``__init__`` to have sharded strategies create them
        directly on the meta device (never materialising the whole model on one rank)."""

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define configure_optimizers() returning an optimizer, "
            f"(optimizer, scheduler), ([optimizers], [schedulers]) or a dict"
        )

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs; they replace the Trainer's callbacks of the same type."""
        return []

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizers (one, or a list), wrapped so ``step()`` goes through the strategy (precision,
        hooks, step counting); ``use_pl_optimizer=False`` gives the raw torch ones."""
        opts = self.trainer.stepping_optimizers if use_pl_optimizer else self.trainer.optimizers
        return opts[0] if len(opts) == 1 else list(opts)

    def lr_schedulers(self) -> Any:
        scheds = [s["scheduler"] for s in self.trainer.lr_scheduler_configs]
        return None if not scheds else scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` for manual optimisation: scaled under ``16-mixed``, with the gradient
        all-reduce of data-parallel strategies (skipped while ``trainer.accumulating``)."""
        self.trainer.manual_backward(loss, *args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Called with the (precision-scaled) loss; override for e.g. ``retain_graph``."""
        loss.backward(*args, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require grad until ``untoggle_optimizer`` (GANs)."""
        raw = getattr(optimizer, "optimizer", optimizer)
        own = {id(p) for g in raw.param_groups for p in g["params"]}
        state = self.__dict__["_param_requires_grad_state"]
        for opt in self.trainer.strategy.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in own:
                        state.setdefault(id(p), (p, p.requires_grad))
                        p.requires_grad = False

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``with self.toggled_optimizer(opt):`` toggle_optimizer on entry, untoggle_optimizer on exit."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        state = self.__dict__["_param_requires_grad_state"]
        for p, requires_grad in state.values():
            p.requires_grad = requires_grad
        state.clear()

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Clip the gradients of ``optimizer``'s parameters (unscaled first under ``16-mixed``). As Lightning,
        an argument left out is the Trainer's (``gradient_clip_val``, ``gradient_clip_algorithm``), and one
        given that contradicts the Trainer's is refused: which of the two was meant cannot be guessed."""
        trainer = self.trainer
        set_val, set_algorithm = trainer.config.gradient_clip_val, trainer.config.gradient_clip_algorithm
        if gradient_clip_val is None:
            gradient_clip_val = set_val or 0.0
        elif set_val is not None and set_val != gradient_clip_val:
            raise ConfigError(f"You have set `Trainer(gradient_clip_val={set_val!r})` and have passed "
                              f"`clip_gradients(gradient_clip_val={gradient_clip_val!r})`. Please use only "
                              f"one of them")
        if gradient_clip_algorithm is None:
            gradient_clip_algorithm = set_algorithm or "norm"
        else:
            gradient_clip_algorithm = gradient_clip_algorithm.lower()
            if set_algorithm is not None and set_algorithm != gradient_clip_algorithm:
                given = gradient_clip_algorithm
                raise ConfigError(f"You have set `Trainer(gradient_clip_algorithm={set_algorithm!r})` and "
                                  f"have passed `clip_gradients(gradient_clip_algorithm={given!r})`. Please "
                                  f"use only one of them")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ConfigError(f"`gradient_clip_algorithm` {gradient_clip_algorithm!r} is invalid. Allowed "
                              f"algorithms: ['value', 'norm']")
        if gradient_clip_val == 0:
            return
        trainer.clip_gradients(getattr(optimizer, "optimizer", optimizer), float(gradient_clip_val),
                               gradient_clip_algorithm)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def freeze(self) -> None:
        for p in self.parameters():
            p.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        for p in self.parameters():
            p.requires_grad = True
        self.train()

    # ------------------------------------------------------------------ steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define training_step(self, batch, batch_idx) returning a loss tensor"
        )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch)

    # ------------------------------------------------------------------ lifecycle hooks (no-ops)
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...

    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_validation_model_train(self) -> None:
        self.train()

    def on_validation_model_zero_grad(self) -> None:
        self.zero_grad(set_to_none=True)

    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        self.train()

    def on_predict_model_eval(self) -> None:
        self.eval()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, map_location: Any = None,
                             hparams_file: str | None = None,
                             strict: bool | None = None, weights_only: bool | None = None,
                             **kwargs: Any) -> TrainModule:
        """A new module built from the checkpoint's saved hyperparameters (``**kwargs`` win) with its
        weights, from any polytrain checkpoint: a file or a sharded directory. ``weights_only=False``
        unpickles without restriction (a Lightning file holding pickled objects; trusted files only)."""
        if hparams_file is not None:
            raise ValueError("hparams_file is not supported: polytrain checkpoints carry their "
                             "hyperparameters")
        strict = cls.strict_loading if strict is None else strict
        return load_module_from_checkpoint(cls, checkpoint_path, map_location, strict, weights_only, **kwargs)


def check_metric_attribute(module: nn.Module, name: str, metric: nn.Module, attribute: str | None) -> None:
    """A logged torchmetrics ``Metric`` must be one of the module's submodules, as Lightning requires: one
    that is not is never moved to the module's device (its update fails there) nor reset with it.
    ``attribute`` (``metric_attribute=``) names it; without it the module is searched (the names found
    are kept, so a step logging the same metric searches no more)."""
    if attribute is not None:
        if getattr(module, attribute, None) is not metric:
            raise ConfigError(f"self.log({name!r}, ..., metric_attribute={attribute!r}): "
                              f"{type(module).__name__}.{attribute} is not the metric being logged")
        return
    known: dict[int, str] = module.__dict__.setdefault("_metric_attributes", {})
    if id(metric) in known:
        return
    known.clear()
    known.update({id(m): n for n, m in module.named_modules() if n and is_metric_object(m)})
    if id(metric) in known:
        return
    if known:
        raise ConfigError(f"Could not find the `LightningModule` attribute for the `torchmetrics.Metric` "
                          f"logged as {name!r}. You can fix this by calling `self.log({name}, ..., "
                          f"metric_attribute=name)` where `name` is one of {sorted(known.values())}")
    raise ConfigError(f"Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged "
                      f"as {name!r}. You can fix this by setting an attribute for the metric in your "
                      f"`LightningModule` (self.my_metric = Accuracy(...) in __init__), so it moves to the "
                      f"module's device and is reset with it")


# torch.jit.script compiles a module's properties too; these belong to training (the Trainer, hparams,
# the device it was placed on), not to the computation being scripted.
TrainModule.__jit_unused_properties__ = sorted(
    {name for cls in TrainModule.__mro__ if cls is not nn.Module
     for name, value in vars(cls).items() if isinstance(value, property)})

LightningModule = TrainModule  # Lightning's name for it

