"""Pipeline parallelism inside the composed strategy (``parallel``, and its ``pipeline`` preset).

The module's ``nn.Sequential`` is cut into stages (``parallel.pipeline_sequential_cut``); each rank keeps only
its stages' children under their original names (checkpoints match every other layout's), and the
composed strategy then parallelises what it kept inside this stage's sub-mesh (tensor parallel, FSDP:
``parallel.apply``). A ``torch.distributed.pipelining`` schedule runs the micro-batches.

The loss on the last stage, per micro-batch, comes from one of two steps (``PipelineSettings.step``):

- ``training_step`` (the default of ``parallel``): the user's own ``training_step`` on that micro-batch
  of the batch, with the pipelined Sequential replaced by a stand-in returning the micro-batch's
  stage output. What it logs is recorded, averaged over the micro-batches and logged once on every
  stage, so every rank's callbacks see what one device's would. The first stage finds the
  Sequential's input the same way: it runs the step until the step calls the Sequential.
- ``pipeline_loss`` (the ``pipeline`` preset, its contract since it exists): batches are ``(inputs,
  targets)`` and the last stage calls ``module.pipeline_loss(outputs, targets)``; ``train/loss`` is
  logged on every rank.

Evaluation runs the user's step on the last stage with the stand-in (the whole batch through the
stages, point to point); what it logs is copied to the other stages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from polytrain.checkpoint.state import gathered_stage_state
from polytrain.core import collectives as C
from polytrain.core.errors import ConfigError
from polytrain.core.protocol import SilentRecords, captured_logs, extract_loss, muted_logs, recorded_logs
from polytrain.data.padding import PaddingState
from polytrain.parallel import pipeline_path_cut as P
from polytrain.parallel import pipeline_sequential_cut as S
from polytrain.parallel import tensor_parallel as tp_fn
from polytrain.parallel.activation_checkpointing import checkpoint_targets
from polytrain.parallel.apply import PipelineSettings, local_plan
from polytrain.parallel.choices import SCHEDULES
from polytrain.parallel.dims import ParallelDims
from polytrain.parallel.pipeline_schedules import (
    MANUAL_OPTIMISATION_REFUSED,
    recv_tensor,
    schedule_class,
    send_tensor,
    stage_class,
    stage_owners,
)
from polytrain.strategies.pipeline_batches import batch_rows, leading_size, signature, split_batch
from polytrain.strategies.pipeline_stand_in import Captured, StandIn
from polytrain.strategies.router import PADDING_BATCH, StepResult, step_args, user_step
from polytrain.strategies.train_step import StepExecutor

log = logging.getLogger("polytrain")


class PipelineRunner(StepExecutor):
    """The executor of a composed strategy with ``pp > 1``: the cut, the schedules, the step and
    evaluation. It answers what ``strategies/whole_model.py``'s ``WholeModel`` answers without a
    pipeline; ``train_step`` is ``StepExecutor``'s, around this class's ``forward_backward``."""

    def __init__(self, strategy: Any, settings: PipelineSettings, dims: ParallelDims,
                 averages_grads: bool, padding: PaddingState | None) -> None:
        if schedule_class(settings.schedule) is None:
            # Checked here, not in the options: importing torch's pipelining costs a second.
            raise ConfigError(f"pipeline schedule={settings.schedule!r} needs torch.distributed.pipelining."
                              f"{SCHEDULES[settings.schedule][0]}, which torch {torch.__version__} lacks")
        super().__init__(strategy)
        self.settings, self.dims = settings, dims
        # No wrapper around the stages (data_parallel all_reduce): this runner averages the gradients over
        # the stage's replicas after each step. With FSDP in the stages, torch's stage reduces them itself.
        self.averages_grads = averages_grads
        self.n_stages = dims.pp * settings.stages_per_rank
        self.n_microbatches = settings.n_microbatches or self.n_stages
        self.owner = stage_owners(dims.pp, self.n_stages, settings.schedule)
        self.local_stages = [s for s in range(self.n_stages) if self.owner[s] == dims.pp_rank]
        self.is_last_stage = self.owner[self.n_stages - 1] == dims.pp_rank
        self.pp_ranks = dims.group_ranks("pp")  # global rank of each stage rank
        self.last_rank = self.pp_ranks[self.owner[self.n_stages - 1]]
        self.sync_grads = True
        self.padding = padding if padding is not None else PaddingState()  # the FSDP backend's, when sharded
        self.optimizers_checked = False  # reset by each fit's setup_optimizers
        self.by_paths = False  # cut at module paths (check_module), not one Sequential's children
        self.ties: list[nn.Parameter | None] = []
        self.counted_elsewhere: set[int] = set()
        # evaluation: (the whole batch, the step's name, the arguments after batch_idx)
        self._whole: tuple[Any, str, tuple[Any, ...]] | None = None
        self._counts: list[int] = []  # micro-batches each stage ran in this step

    @property
    def pp_group(self) -> Any:
        return self.dims.get_mesh("pp").get_group()

    def is_logging_rank(self) -> bool:
        """The last stage's first data-parallel replica (tp/cp rank 0): it holds the loss."""
        d = self.dims
        return self.is_last_stage and d.dp_rank == 0 and d.tp_rank == 0 and d.cp_rank == 0

    # ------------------------------------------------------------------ the cut
    def check_module(self, module: nn.Module) -> None:
        points = self.settings.split_points
        named = points is not None and any(isinstance(p, str) for p in points)
        sequentials = [c for c in module.children() if isinstance(c, nn.Sequential)]
        # A model that is not one Sequential (a library model held as an attribute) is cut at module paths.
        self.by_paths = named or (points is None and self.settings.sequential is None and not sequentials)
        if self.by_paths:
            self._check_path_cut(module, points)
            return
        if self.settings.step == "pipeline_loss" and not callable(getattr(module, "pipeline_loss", None)):
            raise ConfigError(f"{type(module).__name__} needs pipeline_loss(self, outputs, targets) -> "
                              f"Tensor for the pipeline strategy: the loss of the Sequential's outputs, run "
                              f"on the last stage")
        self.seq_name, seq = S.find_sequential(module, self.settings.sequential)
        S.check_params_inside(module, self.seq_name)

    def _check_path_cut(self, module: nn.Module, points: list[Any] | None) -> None:
        if points is not None and not all(isinstance(p, str) for p in points):
            raise ConfigError(f"split_points={points} mixes module paths and child indices; give module "
                              f"paths (e.g. model.layers.4) or indices into the nn.Sequential, not both")
        if self.settings.step != "training_step":
            raise ConfigError(f"the pipeline preset's pipeline_loss step cuts one nn.Sequential; "
                              f"{type(module).__name__} has none, so it is cut at module paths and every "
                              f"stage runs training_step: use strategy name: parallel with pp > 1")
        self.cut = P.cut_at_paths(module, points if points is not None else
                                  P.default_split_paths(module, self.n_stages), self.n_stages)

    def cut_model(self, module: nn.Module, plan: dict[str, Any] | None, is_global_zero: bool
            ) -> tuple[dict[str, Any] | None, Any]:
        """Prune ``module`` to this rank's stages: ``(the tensor-parallel plan of what this rank keeps, the
        activation-checkpointed blocks)``. The blocks are chosen on the whole model first, so every rank
        chooses alike."""
        s = self.strategy
        chosen = checkpoint_targets(module, s.activation_checkpointing_options, s.layout.fsdp.wrap_modules)
        self.split(module, is_global_zero)
        return local_plan(module, plan), chosen

    def roots(self, router: nn.Module) -> list[nn.Module]:
        """What ``parallel.apply`` parallelises: each stage on its own (the router is not run in training)."""
        return list(self.stage_modules.values())

    def split(self, module: nn.Module, is_global_zero: bool) -> list[nn.Module]:
        """Prune ``module`` to this rank's stages; returns the stage modules (the kept children)."""
        if self.by_paths:
            return self._split_at_paths(module, is_global_zero)
        seq = getattr(module, self.seq_name)
        costs = S.child_costs(seq)
        points = (S.check_split_points(self.settings.split_points, len(seq), self.n_stages)
                  if self.settings.split_points is not None else S.balance(costs, self.n_stages))
        children = S.stage_children(seq, points)
        S.check_no_shared_across_ranks(self.seq_name, seq, children, self.owner)
        if is_global_zero:
            log.info("pipeline %s over pp=%d x dp=%d: %s", self.settings.schedule, self.dims.pp,
                     self.dims.dp_size, S.describe(self.seq_name, children, costs))
        S.prune(seq, {n for s in self.local_stages for n in children[s]})
        self.stage_modules = {s: S.stage_module(seq, children[s]) for s in self.local_stages}
        return list(self.stage_modules.values())

    def _split_at_paths(self, module: nn.Module, is_global_zero: bool) -> list[nn.Module]:
        cut, local = self.cut, set(self.local_stages)
        if is_global_zero:
            log.info("pipeline %s over pp=%d x dp=%d cut at %s: %s", self.settings.schedule, self.dims.pp,
                     self.dims.dp_size, cut.split_paths, cut.describe(module))
        # Every rank sums every tie (zeros where it holds no copy): one collective, alike on all ranks.
        tied = [module.get_parameter(names[0]) for names, _ in cut.ties]
        self.tie_shapes = [(p.shape, p.dtype) for p in tied]
        P.keep_stages(module, cut, local)
        P.add_split_hooks(module, cut, local)
        held = {s: P.held_modules(module, cut, s) for s in local}
        self.stage_modules = {s: P.PathStage(s, held[s], self._run_stage) for s in local}
        return list(self.stage_modules.values())

    def build(self, module: nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device
        if self.by_paths and self.cut.ties:
            # Read once the stages are parallelised (FSDP replaces the parameters): each tie's copy on this
            # rank (None: none here); its norm counts on its first stage's rank only.
            self.ties = [param for _, param in P.tied_parameters(module, self.cut)]
            self.counted_elsewhere = {id(param) for param, (_, stages) in zip(self.ties, self.cut.ties)
                                      if param is not None and self.owner[stages[0]] != self.dims.pp_rank}
        self.stages: list[Any] = []  # of every schedule: torch's shape probe may run in any of them
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._spare = self._new_schedule()  # built now so a bad n_microbatches fails before any data

    def _schedule(self, key: tuple[Any, ...]) -> Any:
        """One schedule per batch shape: stages fix their buffers' shapes on their first step."""
        if key not in self._schedules:
            self._schedules[key] = self._spare or self._new_schedule()
            self._spare = None
        return self._schedules[key]

    def _new_schedule(self) -> Any:
        stages = [stage_class()(self.stage_modules[s], s, self.n_stages, self.device, group=self.pp_group)
                  for s in self.local_stages]
        self.stages += stages
        name = self.settings.schedule
        try:
            # scale_grads=False: the loss is scaled instead, so gradients accumulated over several
            # trainer micro-batches are not divided again.
            return schedule_class(name)(stages if SCHEDULES[name][1] else stages[0],
                                        n_microbatches=self.n_microbatches, loss_fn=self._loss_fn,
                                        scale_grads=False)
        except ValueError as err:
            raise ConfigError(f"pipeline schedule={name!r} with n_microbatches={self.n_microbatches}, pp="
                              f"{self.dims.pp}, stages_per_rank={self.settings.stages_per_rank}: "
                              f"{err}") from None

    # ------------------------------------------------------------------ data
    def check_batch_size(self, batch_size: int, where: str) -> None:
        m = self.n_microbatches
        if batch_size % m:
            fits = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
            raise ValueError(
                f"n_microbatches={m} does not divide the per-rank batch size {batch_size} ({where}; global "
                f"batch = {batch_size} x dp={self.dims.dp_size}). Choose n_microbatches in {fits} or a batch "
                f"size divisible by {m}"
            )

    def check_train_loader(self, loader: Any) -> None:
        """Every training batch (the last, short one too) splits into ``n_microbatches``."""
        if not (isinstance(loader, DataLoader) and loader.batch_size):
            return
        self.check_batch_size(loader.batch_size, "train DataLoader batch_size")
        with contextlib.suppress(TypeError):
            tail = len(loader.sampler) % loader.batch_size
            if tail and not loader.drop_last:
                self.check_batch_size(tail, f"the last batch of each epoch holds {tail} of "
                                            f"{len(loader.sampler)} samples; or set drop_last=True")

    # ------------------------------------------------------------------ step
    def check_manual_optimisation(self) -> None:
        raise ConfigError(MANUAL_OPTIMISATION_REFUSED)

    def new_optimizers(self) -> None:
        """A fit configured its optimizers: check anew that they line up over the stages."""
        self.optimizers_checked = False

    def clip_norm(self, optimizer: torch.optim.Optimizer, value: float) -> torch.Tensor:
        """Optimizer ``optimizer``'s norm over every stage (a tie's copies counted once) and tensor-parallel
        shard; its gradients scaled to ``value``."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.check_optimizers_line_up(self.strategy.optimizers)
        tp_fn.reduce_partial_grads(params)  # idempotent: clipping by hand under manual optimisation
        return tp_fn.clip_grad_norm(params, value, self.pp_group, self.counted_elsewhere)

    def forward_backward(self, batch: Any, batch_idx: int, epoch: int) -> StepResult:
        """One batch through the schedule, in this order:

        1. the first stage finds what the user's step feeds the model (``_stage_input``: the step runs
           until it calls the pipelined Sequential; cut at module paths, the batch's row indices);
        2. zero_grad on a window's first batch (before any backward, which the schedule interleaves);
        3. torch's schedule runs every micro-batch's forward and backward; on the last stage its loss
           function runs the user's ``training_step`` on that micro-batch's rows (``_loss_fn``), its loss
           scaled by ``1 / (n_microbatches x accumulate)``;
        4. the batch's loss (the mean over micro-batches) is sent from the last stage to every stage;
           gradients are averaged over the stage's replicas and tied copies summed (window's end only);
        5. what the step logged is averaged over micro-batches and logged on every stage; then
           on_before_backward and on_after_backward, on every stage, with the batch's loss. Backward has
           already run inside the schedule by then: a micro-batch's backward starts before later
           micro-batches' forwards, so no single "before backward" moment exists (docs/strategies/
           pipeline.md)."""
        s, plan = self.strategy, self.plan
        accumulate = plan.accumulate
        user_step = self.settings.step == "training_step"
        if user_step:
            size, key = leading_size(batch), signature(batch)
            inputs = self._stage_input("training_step", batch, batch_idx) if 0 in self.local_stages else None
            if inputs is not None and inputs.shape[0] != size:
                raise ValueError(f"self.{self.seq_name} was called on {inputs.shape[0]} rows of a batch of "
                                 f"{size}; under pipeline parallelism its input must hold one row per sample")
            targets = torch.arange(size)  # the last stage's loss finds its micro-batch's rows by index
        else:
            inputs, targets = split_batch(batch)
            size, key = inputs.shape[0], (tuple(inputs.shape), inputs.dtype)
        self.check_batch_size(size, f"batch {batch_idx}")
        schedule = self._schedule(key)
        if batch_idx % accumulate == 0:
            self.zero_grad(epoch, batch_idx)
        self._loss_factor = 1.0 / (accumulate * self.n_microbatches)
        self._batch, self._batch_idx, self._records = batch, batch_idx, SilentRecords()
        self._counts = [0] * self.n_stages
        losses: list[torch.Tensor] = []  # one per micro-batch, as scaled by _loss_fn
        with s.precision.forward_context():
            schedule.step(*((inputs,) if 0 in self.local_stages else ()),
                          target=targets if self.is_last_stage else None, losses=losses, return_outputs=False)
        self._batch = None
        if self.is_last_stage:
            local = torch.stack([x.detach() for x in losses]).sum() * accumulate  # = mean of the raw losses
        else:
            local = torch.zeros((), device=s.root_device)
        loss = C.broadcast(local.float(), self.last_rank, self.pp_group)
        if self.sync_grads and self.averages_grads:
            self.average_grads_over_dp()
        if self.sync_grads and self.ties:
            self.sum_tied_grads()
        if user_step:
            self.share_logged(_mean_records(self._records), log_here=True)
            for hook in plan.before_backward:
                hook(loss)
        for hook in plan.after_backward:
            hook()
        if not user_step and hasattr(s.module, "log"):
            s.module.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return StepResult(loss / accumulate if accumulate != 1 else loss, loss)

    def _loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.settings.step == "pipeline_loss":
            return self.module.pipeline_loss(outputs, targets) * self._loss_factor
        if any(stage.probing for stage in self.stages) or self._batch is None:
            # torch's shape probe on placeholder outputs: no user code. Multiplied before the sum, so the
            # gradient it sends back is dense (a sum's alone is expanded, stride 0, and gloo refuses it).
            return (outputs.float() * 0.0).sum()
        size = leading_size(self._batch)
        start, stop = int(targets[0]), int(targets[-1]) + 1
        micro = batch_rows(self._batch, start, stop, size)
        with recorded_logs(self.module, self._records), self._as_last_stage(outputs):
            output = user_step(self.module, "training_step")(micro, self._batch_idx)
        loss = extract_loss(output)
        if loss is None:
            raise RuntimeError("training_step returned None under pipeline parallelism: every micro-batch of "
                               "a batch must give a loss (all stages run the batch's schedule together)")
        return loss * self._loss_factor

    def _stage_input(self, step: str, batch: Any, batch_idx: int,
                     dataloader_idx: int | None = None) -> torch.Tensor:
        """What the user's ``step`` feeds the Sequential: the step runs until it calls it (logs muted).
        Cut at module paths, the first stage runs the step itself: it gets the batch's row indices."""
        if self.by_paths:
            return torch.arange(leading_size(batch), device=self.strategy.root_device)
        stand_in = StandIn(None, self.seq_name)
        with muted_logs(self.module), self._sequential_as(stand_in), torch.no_grad():
            with contextlib.suppress(Captured), self.strategy.precision.forward_context():
                user_step(self.module, step)(*step_args(batch, batch_idx, dataloader_idx))
        if stand_in.input is None:
            raise RuntimeError(f"{type(self.module).__name__}.{step} returned without calling "
                               f"self.{self.seq_name}: under pipeline parallelism the first stage needs the "
                               f"Sequential's input")
        return stand_in.input

    def _run_stage(self, index: int, x: torch.Tensor, probing: bool) -> torch.Tensor:
        """Stage ``index`` of a cut at module paths: the user's step on this stage's micro-batch (the whole
        batch in evaluation), from the activation received to the next split point. The last stage
        passes what it received to the loss function (or to ``eval_step``), which runs the step there."""
        if index == self.n_stages - 1:
            # A copy, not x itself: given its own input back as output, torch 2.11's stage finds no input
            # gradient to send ("has gradients None"); and FSDP warns of a view (an in-place op on it would
            # drop its pre-backward hook).
            return x.clone()
        extra: tuple[Any, ...] = ()
        if self._whole is not None:
            batch, step, extra = self._whole
        else:
            # torch's shape probe asks for the first micro-batch's shapes
            micro = 0 if probing else self._counts[index]
            if not probing:
                self._counts[index] += 1
            size = leading_size(self._batch)
            rows = size // self.n_microbatches
            batch, step = batch_rows(self._batch, micro * rows, (micro + 1) * rows, size), "training_step"
        stage_pass = P.StagePass(index, x if index > 0 else None, self.strategy.root_device)
        with P.running_as(stage_pass), muted_logs(self.module):
            try:
                user_step(self.module, step)(batch, self._batch_idx, *extra)
            except P.ReachedSplit as reached:
                return reached.activation
        raise RuntimeError(f"{type(self.module).__name__}.{step} returned on pipeline stage {index} without "
                           f"calling its end, split point {self.cut.split_paths[index]}: every stage but the "
                           f"last must run the model as far as the next split point")

    def _as_last_stage(self, output: Any) -> contextlib.AbstractContextManager:
        """The user's step on the last stage, fed ``output`` (the activation it received)."""
        if self.by_paths:
            return _last_stage_pass(P.StagePass(self.n_stages - 1, output, self.strategy.root_device),
                                    self.cut.split_paths[-1])
        return self._sequential_as(output)

    def sum_tied_grads(self) -> None:
        """A parameter tied across stages gets the sum of its stages' gradients on every copy, so the
        copies take the same step. Every pp rank joins, with zeros where it holds no copy. Under FSDP
        each rank sums its own shard: the stages' ranks at one data-parallel position hold the same."""
        device = self.strategy.root_device
        grads = [_local(p.grad) if p is not None and p.grad is not None
                 else torch.zeros(self._local_shape(shape), dtype=dtype, device=device)
                 for p, (shape, dtype) in zip(self.ties, self.tie_shapes)]
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [i for i, g in enumerate(grads) if g.dtype == dtype]
            flat = torch._utils._flatten_dense_tensors([grads[i] for i in same])
            flat = C.all_reduce(flat, "sum", self.pp_group)
            for i, summed in zip(same, torch._utils._unflatten_dense_tensors(flat, [grads[i] for i in same])):
                param = self.ties[i]
                if param is None:
                    continue
                if param.grad is None:
                    names, stages = self.cut.ties[i]
                    raise RuntimeError(f"{names} is tied across pipeline stages {stages} but got no "
                                       f"gradient on this rank's stage, which holds it: every stage that "
                                       f"holds a tie must use it in each step")
                _local(param.grad).copy_(summed)

    def _local_shape(self, shape: torch.Size) -> list[int]:
        """This rank's shard of a tensor of ``shape``: FSDP cuts dimension 0 as ``torch.chunk`` does."""
        shards = self.dims.dp_shard
        if shards == 1:
            return list(shape)
        per = -(-shape[0] // shards)
        mine = self.dims.get_mesh("fsdp").get_local_rank() if shards > 1 else 0
        return [max(0, min(per, shape[0] - mine * per)), *shape[1:]]

    @contextlib.contextmanager
    def _sequential_as(self, stand_in: Any) -> Iterator[None]:
        modules = self.module._modules
        seq = modules[self.seq_name]
        modules[self.seq_name] = (stand_in if isinstance(stand_in, nn.Module)
                                  else StandIn(stand_in, self.seq_name))
        try:
            yield
        finally:
            modules[self.seq_name] = seq

    def check_optimizers_line_up(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Clipping by norm reduces optimizer k's norm over the stages, so optimizer k must be one optimizer
        on every stage: same class and hyperparameters, same count. A stage whose ``configure_optimizers``
        dropped an optimizer it holds no parameters of shifts the others' indices (another optimizer's
        norm gets mixed in, silently), or leaves a stage with fewer reductions (a hang). Checked once per
        fit, at the first clip (every rank clips optimizer 0 first: a matched collective)."""
        if self.optimizers_checked:
            return
        mine = [f"{type(o).__name__}({', '.join(f'{k}={v!r}' for k, v in sorted(o.defaults.items()))})"
                for o in optimizers]
        stages = C.all_gather_object(mine, self.pp_group)
        self.optimizers_checked = True
        if any(other != stages[0] for other in stages):
            listed = "; ".join(f"stage rank {r}: [{', '.join(opts)}]" for r, opts in enumerate(stages))
            raise ConfigError(
                f"gradient clipping by norm under pipeline parallelism reduces optimizer k's norm over the "
                f"stages, so configure_optimizers must return the same optimizers in the same order on every "
                f"stage; got {listed}. Keep an optimizer whose parameters a stage does not hold as an empty "
                f"group, e.g. torch.optim.SGD([{{'params': []}}], lr=...), or clip by value")

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients stay local: averaging and tied sums wait for the step's last micro-batch (with FSDP in
        the stages, torch's stage defers its own reduction)."""
        return self._held_back()

    def prepare_evaluation(self) -> None:
        """Nothing before an evaluation pass: no wrapper broadcasts buffers around a stage."""

    @contextlib.contextmanager
    def _held_back(self) -> Iterator[None]:
        self.sync_grads = False
        try:
            yield
        finally:
            self.sync_grads = True

    def average_grads_over_dp(self) -> None:
        """One flat all-reduce per dtype over this stage's replicas (ranks with the same pp rank)."""
        group = self.dims.get_mesh("dp").get_group()
        if not C.active(group):
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = C.all_reduce(torch._utils._flatten_dense_tensors(same), "mean", group)
            for g, synced in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
                g.copy_(synced)

    # ------------------------------------------------------------------ checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        """The whole model on global rank 0, gathered from every stage (a collective)."""
        return gathered_stage_state(self.module, self.strategy.is_global_zero)

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, stage: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        """Every rank of the pipeline runs this with the same batch; the last stage runs the user's step."""
        s, step = self.strategy, f"{stage}_step"
        if self.settings.step == "training_step":
            first = 0 in self.local_stages
            inputs = self._stage_input(step, batch, batch_idx, dataloader_idx) if first else None
        else:
            inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        # an evaluation runs every stage on the whole batch, with its loader's index when there are several
        extra = step_args(batch, batch_idx, dataloader_idx)[2:]
        self._whole, self._batch_idx = (batch, step, extra), batch_idx
        try:
            with s.precision.forward_context():
                output = self._forward_stages(inputs)
        finally:
            self._whole = None
        records: list[tuple[str, torch.Tensor, dict[str, Any]]] = []
        result = None
        padding = self.padding.active
        if self.is_last_stage:
            logs = muted_logs(self.module) if padding else captured_logs(self.module, records)
            with logs, self._as_last_stage(output), s.precision.forward_context():
                result = user_step(self.module, step)(*step_args(batch, batch_idx, dataloader_idx))
        if padding:
            return PADDING_BATCH
        if stage != "predict":
            self.share_logged(records, log_here=False)
        return result

    def _forward_stages(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """The whole batch through this rank's stages in order, activations sent between ranks."""
        group, ranks, device = self.pp_group, self.pp_ranks, self.strategy.root_device
        for s in self.local_stages:
            if s > 0 and self.owner[s - 1] != self.dims.pp_rank:
                x = recv_tensor(ranks[self.owner[s - 1]], group, device)
            x = self.stage_modules[s](x)
            if s < self.n_stages - 1 and self.owner[s + 1] != self.dims.pp_rank:
                send_tensor(x, ranks[self.owner[s + 1]], group, device)
        return x if self.is_last_stage else None

    def share_logged(self, records: list[tuple[str, torch.Tensor, dict[str, Any]]], log_here: bool) -> None:
        """Copy what the last stage logged to every stage (logged there too with ``log_here``)."""
        device = self.strategy.root_device
        if C.active(self.pp_group):
            described = C.broadcast_object([(name, kwargs) for name, _, kwargs in records], self.last_rank,
                                           self.pp_group)
        else:
            described = [(name, kwargs) for name, _, kwargs in records]
        if not described:
            return
        packed = (torch.stack([v.to(device) for _, v, _ in records]) if self.is_last_stage
                  else torch.zeros(len(described), device=device))
        packed = C.broadcast(packed, self.last_rank, self.pp_group)
        if log_here or not self.is_last_stage:
            for (name, kwargs), value in zip(described, packed.unbind(0)):
                self.module.log(name, value, **kwargs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def _last_stage_pass(stage_pass: P.StagePass, split_path: str) -> Iterator[None]:
    with P.running_as(stage_pass):
        yield
    if not stage_pass.injected:
        raise RuntimeError(f"the step returned on the last pipeline stage without calling split point "
                           f"{split_path}, where the activation it received goes in")


def _mean_records(records: SilentRecords) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
    """Each logged name once: the mean of its micro-batch values (one device logs the whole batch's
    value; for a mean over equal micro-batches that is their mean), with its first call's options."""
    merged: dict[str, tuple[list[torch.Tensor], dict[str, Any]]] = {}
    for name, value, kwargs in records:
        merged.setdefault(name, ([], kwargs))[0].append(value)
    return [(name, torch.stack(values).mean(), kwargs) for name, (values, kwargs) in merged.items()]
