"""The verb set every strategy answers. The Trainer talks to strategies only through these.

The composed strategy (``ParallelStrategy``) and the two that place layers themselves (``dp``,
``layers``) subclass ``Strategy``; the presets (single, ddp, fsdp, model_parallel, pipeline) subclass
``ParallelStrategy`` and only map their options to a layout. Pieces two strategies share are plain
functions (``polytrain.core``, ``polytrain.parallel``, ``polytrain.checkpoint``,
``polytrain.data``). Strategies import only those lower layers, never the Trainer or callbacks.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from polytrain.checkpoint.checkpoint_io import CheckpointIO, ReplicatedCheckpointIO
from polytrain.checkpoint.state import Parts, apply_loaded, full_optimizer_state, live_state, part_state
from polytrain.core import heartbeat
from polytrain.core.batch import move_to_device
from polytrain.core.environment import ClusterEnvironment
from polytrain.core.precision import Precision
from polytrain.core.process_group import destroy_process_group
from polytrain.data.loaders import distribute_dataloader
from polytrain.strategies.collective_verbs import CollectiveVerbs
from polytrain.strategies.router import StepRouter, step_args, user_step
from polytrain.strategies.train_step import StepPlan
from polytrain.strategies.whole_model import WholeModel


class Strategy(CollectiveVerbs, ABC):
    """One parallelism's answer to every verb. Built by ``registry.build_strategy``, which hands it
    its collaborators: the ``Precision`` object, the ``ParallelDims`` (strategies with a device mesh),
    the resolved compile and activation-checkpointing options and, when the caller chooses one, the
    ``CheckpointIO``; a strategy built by hand gets them the same way (``Precision.for_accelerator``,
    ``parallel_dims``)."""

    name: ClassVar[str]
    Options: ClassVar[type]
    # other names for this strategy with options (Lightning's)
    aliases: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, options: Any, *, accelerator: str, devices: int, num_nodes: int,
                 precision: Precision, timeout: float, env: ClusterEnvironment,
                 dims: Any = None, checkpoint_io: CheckpointIO | None = None,
                 compile_options: dict[str, Any] | None = None,
                 activation_checkpointing_options: dict[str, Any] | None = None) -> None:
        self.options = options
        self.accelerator = accelerator
        self.devices = devices
        self.num_nodes = num_nodes
        self.timeout = timeout
        self.env = env
        self.precision = precision
        self.dims = dims if dims is not None else self.parallel_dims(options, env, num_nodes)
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else self.default_checkpoint_io()
        # trainer.compile / trainer.activation_checkpointing, resolved (None: off); applied in setup_module.
        self.compile_options = compile_options
        self.activation_checkpointing_options = activation_checkpointing_options
        # Module paths whose weights are filled once setup_module returns (trainer.init_weights): built on
        # the meta device, they are allocated, not initialised (expect_weights_after_setup).
        self.filled_after_setup: Callable[[str], bool] | None = None
        self.module: nn.Module | None = None  # the user's TrainModule, unwrapped
        self.model: nn.Module | None = None  # what forward runs through (maybe wrapped)
        self.optimizers: list[torch.optim.Optimizer] = []
        self._device = torch.device("cpu")
        # What runs the training step (strategies/train_step.py): the whole model here; the composed strategy
        # chooses a pipeline's when it has stages.
        self.executor: Any = self.new_executor()

    @property
    def precision_name(self) -> str:
        return self.precision.name

    def adopt_model_transforms(self, compile_options: dict[str, Any] | None,
                               activation_checkpointing_options: dict[str, Any] | None) -> None:
        """A strategy built by hand and handed to a Trainer: the Trainer's ``compile`` and
        ``activation_checkpointing`` apply unless the strategy was built with its own."""
        if self.compile_options is None:
            self.compile_options = compile_options
        if self.activation_checkpointing_options is None:
            self.activation_checkpointing_options = activation_checkpointing_options

    def expect_weights_after_setup(self, filled: Callable[[str], bool] | None) -> None:
        """The modules (by path) whose persistent tensors are filled after ``setup_module`` (a Hugging Face
        directory's weights, ``trainer.init_weights``): where they are built on the meta device the strategy
        allocates their shards and leaves the values to the filling."""
        self.filled_after_setup = filled

    def new_executor(self) -> Any:
        """The executor this strategy starts with: ``WholeModel`` (every rank runs every layer)."""
        return WholeModel(self)

    def bind_step(self, plan: StepPlan) -> Callable[[Any, int, int, bool], Any]:
        """The fit's training step, ``train_step(batch, batch_idx, epoch, end_of_window) -> (result,
        stepped)``: the executor's, bound to ``plan`` (the hooks, clipping, the guard) for this fit. The
        Trainer calls it once per fit, after ``setup_optimizers``."""
        self.executor.bind(plan)
        return self.executor.train_step

    @classmethod
    def build(cls, options: Any, **kwargs: Any) -> Strategy:
        """The strategy for ``options`` (``registry.build_strategy`` calls this) with the job's
        ``ParallelDims``: an instance of this class, unless a class hands some of its options to another
        (model_parallel's layers mode)."""
        dims = cls.parallel_dims(options, kwargs["env"], kwargs["num_nodes"])
        return cls(options, dims=dims, **kwargs)

    @classmethod
    def parallel_dims(cls, options: Any, env: ClusterEnvironment, num_nodes: int) -> Any:
        """The job's ``ParallelDims`` for these options (None: this strategy has no device mesh).
        Raises ``ConfigError`` naming every degree when they do not fit the world size."""
        return None

    @classmethod
    def check_options(cls, options: Any, device_type: str) -> None:
        """At config load: raise ``ConfigError`` for options this strategy cannot run on ``device_type``."""
        return None

    def default_checkpoint_io(self) -> CheckpointIO:
        """The checkpoint I/O this strategy's layout needs when none is handed to it."""
        return ReplicatedCheckpointIO()

    @classmethod
    def processes_per_node(cls, devices: int, options: Any = None) -> int:
        """How many worker processes ``devices`` means on one node (dp: one process, many GPUs).

        ``options`` is the validated strategy mapping (or options object) when the launcher has it:
        model_parallel's layers mode reads ``devices_per_process`` from it."""
        return devices

    # ------------------------------------------------------------------ topology
    @property
    def global_rank(self) -> int:
        return self.env.global_rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def is_logging_rank(self) -> bool:
        """The rank whose loggers write; a pipeline's last stage overrides this."""
        return self.is_global_zero

    @property
    def root_device(self) -> torch.device:
        return self._device

    @property
    def dp_group(self) -> Any:
        return None  # None means the world group

    @property
    def replicated(self) -> bool:
        """True when every rank holds the whole model (checkpoints come from rank 0 alone): a property
        of the checkpoint I/O object, not a second place deciding it."""
        return self.checkpoint_io.replicated

    # ------------------------------------------------------------------ setup
    @abstractmethod
    def setup_environment(self) -> None: ...

    def join_process_group(self) -> None:
        """Join the job's process group now, with no module (``connect()``). Strategies that join in
        ``setup_environment`` have nothing left to do; one that defers the rendezvous to
        ``setup_module`` (to check the module first) joins here."""
        return None

    @abstractmethod
    def setup_module(self, module: nn.Module) -> nn.Module: ...

    def model_init_context(self) -> contextlib.AbstractContextManager:
        """Context under which ``configure_model`` builds layers (sharded strategies use meta)."""
        return contextlib.nullcontext()

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        self.precision.check_optimizers(optimizers)
        self.optimizers = list(optimizers)
        return self.optimizers

    def process_dataloader(self, loader: DataLoader, stage: str, seed: int,
                           use_sampler: bool | str) -> DataLoader:
        # On CUDA a rebuilt loader pins its batches (unless the user chose), so batch_to_device copies async.
        return distribute_dataloader(loader, self.dp_size, self.dp_rank, seed, stage, use_sampler,
                                     pin_memory=self.root_device.type == "cuda")

    def batch_to_device(self, batch: Any) -> Any:
        # self._device, not the root_device property: one call fewer on every batch.
        batch = move_to_device(batch, self._device)
        return self.precision.convert_input(batch) if self.precision.casts_input else batch

    def batch_mover(self) -> Callable[[Any], Any]:
        """``batch_to_device`` as the loops call it on every batch, bound once the device is set: with no
        input cast (and no override), ``move_to_device`` with the device bound in C, a Python call fewer."""
        if type(self).batch_to_device is Strategy.batch_to_device and not self.precision.casts_input:
            return functools.partial(move_to_device, device=self._device)
        return self.batch_to_device

    # ------------------------------------------------------------------ step
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Manual optimisation's step: the user's ``training_step`` alone (it drives the optimizers)."""
        return self.executor.run_user_step(batch, batch_idx)

    def training_step_function(self) -> Callable[[Any, int], Any]:
        """The user's training step as the executor calls it, asked once per fit (the model is wrapped by
        then): through the wrapper (DDP, DataParallel: see StepRouter), or straight on the module when
        nothing wraps or hooks the router (an nn.Module call fewer per step); under autocast when the
        precision asks for it."""
        model = self.model
        # The router must run when it wraps or carries hooks (tensor parallel swaps replicated DTensor
        # parameters for local views around the step in the router's hooks).
        routed = type(model) is not StepRouter or bool(model._forward_pre_hooks or model._forward_hooks)
        step = (functools.partial(model, "training_step") if routed
                else user_step(self.module, "training_step"))
        if self.precision.autocast_dtype is None:
            return step
        context = self.precision.forward_context

        def autocast_step(batch: Any, batch_idx: int) -> Any:
            with context():
                return step(batch, batch_idx)

        return autocast_step

    def prepare_evaluation(self) -> None:
        """Every rank, before an evaluation pass's first batch (whatever number of batches it has): what a
        wrapper would do in its first evaluation forward (DDP broadcasts rank 0's buffers)."""

    def counts_over_stages(self, counts: dict[str, Any]) -> dict[str, Any]:
        """Parameter counts of this rank's part of the model (``callbacks.summary.parameter_counts``) as the
        whole model's: every rank holds every layer here, so they are."""
        return counts

    def eval_step(self, stage: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        # Evaluation runs on the unwrapped module: no gradient hooks, no buffer broadcasts, so a
        # rank with fewer evaluation batches cannot leave the others waiting in a collective.
        with self.precision.forward_context():
            return user_step(self.module, f"{stage}_step")(*step_args(batch, batch_idx, dataloader_idx))

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The precision's scaling, then the module's ``backward`` (``loss.backward()`` by default)."""
        self.executor.scaled_backward(loss, *args, **kwargs)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``self.manual_backward(loss)`` under manual optimisation: hooks, the precision's scaling,
        the module's ``backward``."""
        plan = self.executor.plan
        for hook in plan.before_backward:
            hook(loss)
        self.prepare_manual_backward(loss)
        self.backward(loss, *args, **kwargs)
        for hook in plan.after_backward:
            hook()

    def prepare_manual_backward(self, loss: torch.Tensor) -> None:
        """What a wrapper needs before each of several backward passes of one step (DDP's reducer)."""
        return None

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float,
                       algorithm: str) -> torch.Tensor | None:
        """Clip ``optimizer``'s gradients (unscaled first) by ``value`` (``norm`` | ``value``): the total norm
        when by norm, reduced over ranks where the gradients are spread over them."""
        return self.executor.clip_gradients(optimizer, value, algorithm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None,
                       **kwargs: Any) -> Any:
        """One optimizer's update, as ``opt.step(closure, **kwargs)`` asks it (manual optimisation, a
        module's ``optimizer_step``): the executor's ``update`` (unscaling, on_before_optimizer_step, the
        GradScaler)."""
        return self.executor.update(optimizer, closure, **kwargs)

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on non-final micro-batches of an accumulation window."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints
    def state_parts(self) -> Parts:
        """The model this rank holds and its optimizers, as checkpoints read and write them."""
        return [(self.module, list(self.optimizers))]

    @property
    def gathers_state(self) -> bool:
        """Whether the whole model must be gathered from several ranks (sharded or pipelined): then
        ``module_state_dict`` is a collective, and the checkpoint I/O is the sharded one."""
        return False

    def module_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict under single-device names (on global rank 0 at least)."""
        return self.module.state_dict()

    def checkpoint_state(self, module_state: dict[str, Any] | None = None,
                         weights_only: bool = False) -> dict[str, Any]:
        """Model and optimizer state as this strategy's checkpoint I/O writes it: whole (on global rank 0;
        a collective where parameters are sharded) for a file, each rank's own slices for a sharded
        directory. ``module_state``: the module's ``state_dict()``, reused when it is the whole model;
        ``weights_only``: the model alone."""
        parts = [(module, [] if weights_only else optimizers) for module, optimizers in self.state_parts()]
        if not self.checkpoint_io.replicated:
            return live_state(parts)
        model = (module_state if module_state is not None and not self.gathers_state
                 else self.module_state_dict())
        if weights_only:
            return {"model": model}
        return {"model": model, "optimizer": full_optimizer_state(parts)}

    def save_checkpoint(self, payload: dict[str, Any], path: str, async_save: bool = False) -> None:
        """Every rank calls it. ``payload``'s ``state_dict`` (the live state hooks read) is not written: the
        model goes under ``model``, as the checkpoint I/O's format holds it; a payload marked
        ``weights_only`` gets no optimizer state. ``async_save``: returns once the state is staged; the write
        goes on in the background (``checkpoint_io.finish`` waits for it)."""
        state = {k: v for k, v in payload.items() if k != "state_dict"}
        state.update(self.checkpoint_state(payload.get("state_dict"), bool(payload.get("weights_only"))))
        if async_save:  # what the optimizers update may be copied in the background, until their next step
            self.checkpoint_io.async_save(state, path,
                                          [opt for _, opts in self.state_parts() for opt in opts])
        else:
            self.checkpoint_io.save(state, path)

    def load_checkpoint(self, path: str, weights_only: bool = False) -> dict[str, Any]:
        """Restore model and optimizer state (with ``weights_only``: the model alone) from any checkpoint;
        return the rest of the payload. Every rank calls it."""
        parts = [(module, [] if weights_only else optimizers) for module, optimizers in self.state_parts()]
        states = [part_state(module, optimizers) for module, optimizers in parts]  # the live state, once
        loaded = self.checkpoint_io.load(
            path, into=None if self.checkpoint_io.replicated else live_state(parts, states))
        apply_loaded(parts, loaded, path, states)
        return loaded.payload

    def teardown(self) -> None:
        heartbeat.stop()  # before the store it writes to goes away
        destroy_process_group()

