"""``pipeline``: the module's ``nn.Sequential`` cut into stages run by ``torch.distributed.pipelining``.

The world is a ``pp x dp`` mesh (``ParallelDims(pp=...)``): ``pp`` ranks form one pipeline, ``dp``
pipelines train replicas on different data (the sampler splits over dp only; gradients are averaged
over dp by one flat all-reduce per optimizer step). Each rank keeps only its stages' children of the
user's Sequential, under their original names, so checkpoints match every other strategy's.

The strategy owns the step (the user's ``training_step`` is not called): batches are ``(inputs,
targets)``, the last stage computes ``module.pipeline_loss`` per microbatch, and ``train/loss`` is
logged on every rank. Evaluation runs the user's step on the last stage with the Sequential standing
in as the pipeline's output; what it logs is copied to the other stages. See docs/strategies/pipeline.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from polytrain.checkpoint.sharded import load_sharded, save_sharded
from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import ConfigError
from polytrain.core.precision import Precision
from polytrain.core.process_group import default_backend, init_process_group, resolve_device
from polytrain.core.protocol import captured_logs
from polytrain.parallel import pipeline_split as S
from polytrain.parallel.activation_checkpointing import apply_activation_checkpointing
from polytrain.parallel.compile import checkpoint_and_compile
from polytrain.parallel.dims import ParallelDims
from polytrain.strategies.base import StepResult, StepRouter, Strategy

log = logging.getLogger("polytrain")

# name -> (class in torch.distributed.pipelining.schedules, several stages per rank, stage placement)
SCHEDULES: dict[str, tuple[str, bool, str]] = {
    "gpipe": ("ScheduleGPipe", False, "loop"),
    "1f1b": ("Schedule1F1B", False, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True, "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", True, "v"),
}


def schedule_class(name: str) -> type | None:
    """The torch class for ``name``, or None where this torch build lacks it."""
    return getattr(lazy.pipelining().schedules, SCHEDULES[name][0], None)


@dataclass
class PipelineOptions:
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv
    n_microbatches: int | None = None  # None: the number of stages (pp x stages_per_rank)
    pp: int = -1  # pipeline degree; -1: the whole world (dp = world / pp)
    stages_per_rank: int = 1  # > 1 for the interleaved / zero-bubble schedules (zbv: exactly 2)
    split_points: list[int] | None = None  # first child index of stages 1..n-1; None: balance by params
    sequential: str | None = None  # attribute holding the nn.Sequential; None: the only one
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline schedule={self.schedule!r} is not known; valid: {', '.join(SCHEDULES)}")
        for key in ("n_microbatches", "stages_per_rank"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"pipeline {key}={value} must be at least 1")
        if self.pp == 0 or self.pp < -1:
            raise ConfigError(f"pipeline pp={self.pp} must be a positive degree or -1 (the whole world)")
        multi = SCHEDULES[self.schedule][1]
        if not multi and self.stages_per_rank != 1:
            raise ConfigError(f"pipeline schedule={self.schedule!r} runs one stage per rank but stages_per_rank="
                              f"{self.stages_per_rank}; use interleaved_1f1b, zero_bubble or zbv")
        if self.schedule == "zbv" and self.stages_per_rank != 2:
            raise ConfigError(f"pipeline schedule='zbv' needs stages_per_rank=2, got {self.stages_per_rank}")


class _PipelineOutput(nn.Module):
    """Stands in for the pipelined Sequential while a user's eval step runs on the last stage."""

    def __init__(self, output: Any, seq_name: str) -> None:
        super().__init__()
        self.output, self.seq_name, self.calls = output, seq_name, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(f"the evaluation step called self.{self.seq_name} {self.calls} times; under the "
                               f"pipeline strategy the Sequential runs once per batch, on the batch's inputs")
        return self.output


class PipelineStrategy(Strategy):
    name = "pipeline"
    Options = PipelineOptions

    # ------------------------------------------------------------------ topology
    def setup_environment(self) -> None:
        # Checked here, not in the options: importing torch's pipelining costs seconds (dynamo, DTensor).
        if schedule_class(self.options.schedule) is None:
            raise ConfigError(f"pipeline schedule={self.options.schedule!r} needs torch.distributed.pipelining."
                              f"{SCHEDULES[self.options.schedule][0]}, which torch {torch.__version__} lacks")
        self._device = resolve_device(self.accelerator, self.local_rank)
        if self.precision_name == "16-mixed":
            raise ConfigError("precision '16-mixed' is not supported by the pipeline strategy (each stage's "
                              "GradScaler would skip steps on its own); use bf16-mixed or 32")
        self.precision = Precision(self.precision_name, self._device.type)
        init_process_group(self.env, self.options.backend or default_backend(self._device), self.timeout)
        pp = self.options.pp if self.options.pp > 0 else self.world_size
        self.dims = ParallelDims(self.world_size, pp=pp)
        mesh = self.dims.build_mesh(self._device.type)
        self.pp_size, self.pp_group = pp, mesh["pp"].get_group()
        self.pp_rank = mesh["pp"].get_local_rank()
        self._dp_group = self.dims.dp_mesh.get_group()
        self._dp_rank = self.dims.dp_mesh.get_local_rank()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)  # global rank of each stage rank
        self.n_stages = pp * self.options.stages_per_rank
        self.n_microbatches = self.options.n_microbatches or self.n_stages
        self.owner = lazy.pipelining()._utils.generate_stage_to_rank_mapping(pp, self.n_stages, SCHEDULES[self.options.schedule][2])
        self.local_stages = [s for s in range(self.n_stages) if self.owner[s] == self.pp_rank]
        self.is_last_stage = self.owner[self.n_stages - 1] == self.pp_rank
        self.last_rank = self.pp_ranks[self.owner[self.n_stages - 1]]

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_group(self) -> Any:
        return self._dp_group

    @property
    def is_logging_rank(self) -> bool:
        """The last stage's first data-parallel replica: it holds the loss and eval outputs."""
        return self.is_last_stage and self.dp_rank == 0

    @property
    def replicated(self) -> bool:
        return False

    # ------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module) -> nn.Module:
        if not callable(getattr(module, "pipeline_loss", None)):
            raise ConfigError(f"{type(module).__name__} needs pipeline_loss(self, outputs, targets) -> Tensor for "
                              f"the pipeline strategy: the loss of the Sequential's outputs, run on the last stage")
        self.seq_name, seq = S.find_sequential(module, self.options.sequential)
        S.check_params_inside(module, self.seq_name)
        costs = S.child_costs(seq)
        points = (S.check_split_points(self.options.split_points, len(seq), self.n_stages)
                  if self.options.split_points is not None else S.balance(costs, self.n_stages))
        children = S.stage_children(seq, points)
        S.check_no_shared_across_ranks(self.seq_name, seq, children, self.owner)
        if self.is_global_zero:
            log.info("pipeline %s over pp=%d x dp=%d: %s", self.options.schedule, self.pp_size, self.dp_size,
                     S.describe(self.seq_name, children, costs))
        apply_activation_checkpointing(module, self.checkpointing_options)  # before the cut: every rank alike
        S.prune(seq, {n for s in self.local_stages for n in children[s]})
        self.module = self.precision.convert_module(module.to(self.root_device))
        self.model = StepRouter(self.module)
        self.stage_modules = {s: S.stage_module(seq, children[s]) for s in self.local_stages}
        checkpoint_and_compile(self.module, None, self.compile_options, stages=list(self.stage_modules.values()))
        self._broadcast_replicas()
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._spare = self._new_schedule()  # built now so a bad n_microbatches fails before any data
        self._sync_grads = True
        return self.model

    def _broadcast_replicas(self) -> None:
        """dp replicas of a stage start from dp rank 0's weights (as DDP guarantees)."""
        if not C.active(self._dp_group):
            return
        src = dist.get_process_group_ranks(self._dp_group)[0]
        for tensor in self.module.state_dict().values():
            C.broadcast(tensor, src, self._dp_group)

    def _schedule(self, inputs: torch.Tensor) -> Any:
        """One schedule per batch shape: stages fix their buffers' shapes on their first step."""
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._schedules:
            self._schedules[key] = self._spare or self._new_schedule()
            self._spare = None
        return self._schedules[key]

    def _new_schedule(self) -> Any:
        PipelineStage = lazy.pipelining().PipelineStage
        stages = [PipelineStage(self.stage_modules[s], s, self.n_stages, self.root_device, group=self.pp_group)
                  for s in self.local_stages]
        cls = schedule_class(self.options.schedule)
        try:
            # scale_grads=False: the loss is scaled instead, so gradients accumulated over several
            # trainer micro-batches are not divided again.
            return cls(stages if SCHEDULES[self.options.schedule][1] else stages[0],
                       n_microbatches=self.n_microbatches, loss_fn=self._loss_fn, scale_grads=False)
        except ValueError as err:
            raise ConfigError(f"pipeline schedule={self.options.schedule!r} with n_microbatches="
                              f"{self.n_microbatches}, pp={self.pp_size}, stages_per_rank="
                              f"{self.options.stages_per_rank}: {err}") from None

    def _loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.module.pipeline_loss(outputs, targets) * self._loss_factor

    # ------------------------------------------------------------------ data
    def check_batch_size(self, batch_size: int, where: str) -> None:
        m = self.n_microbatches
        if batch_size % m:
            fits = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
            raise ValueError(
                f"n_microbatches={m} does not divide the per-rank batch size {batch_size} ({where}; global "
                f"batch = {batch_size} x dp={self.dp_size}). Choose n_microbatches in {fits} or a batch size "
                f"divisible by {m}"
            )

    def process_dataloader(self, loader: DataLoader, stage: str, seed: int, use_sampler: bool) -> DataLoader:
        loader = super().process_dataloader(loader, stage, seed, use_sampler)
        if stage == "train" and isinstance(loader, DataLoader) and loader.batch_size:
            self.check_batch_size(loader.batch_size, "train DataLoader batch_size")
            with contextlib.suppress(TypeError):
                tail = len(loader.sampler) % loader.batch_size
                if tail and not loader.drop_last:
                    self.check_batch_size(tail, f"the last batch of each epoch holds {tail} of "
                                                f"{len(loader.sampler)} samples; or set drop_last=True")
        return loader

    # ------------------------------------------------------------------ step
    def forward_backward(self, batch: Any, batch_idx: int, accumulate: int = 1,
                         zero_grad: Callable[[], None] | None = None) -> StepResult:
        inputs, targets = _split_batch(batch)
        self.check_batch_size(inputs.shape[0], f"batch {batch_idx}")
        schedule = self._schedule(inputs)
        if zero_grad is not None:
            zero_grad()
        self._loss_factor = 1.0 / (accumulate * self.n_microbatches)
        args = (inputs,) if 0 in self.local_stages else ()
        losses: list[torch.Tensor] = []  # one per microbatch, as scaled by _loss_fn
        with self.precision.forward_context():
            schedule.step(*args, target=targets if self.is_last_stage else None, losses=losses,
                          return_outputs=False)
        if self.is_last_stage:
            local = torch.stack([x.detach() for x in losses]).sum() * accumulate  # = mean of the raw losses
        else:
            local = torch.zeros((), device=self.root_device)
        loss = C.broadcast(local.float(), self.last_rank, self.pp_group)
        if self._sync_grads:
            self._average_grads_over_dp()
        self.call_hook("on_after_backward")
        if hasattr(self.module, "log"):
            self.module.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return StepResult(loss / accumulate if accumulate != 1 else loss, loss)

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return self._no_sync() if enabled else contextlib.nullcontext()

    def _average_grads_over_dp(self) -> None:
        """One flat all-reduce per dtype over this stage's replicas (ranks with the same pp rank)."""
        if not C.active(self._dp_group):
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            group = [g for g in grads if g.dtype == dtype]
            flat = C.all_reduce(torch._utils._flatten_dense_tensors(group), "mean", self._dp_group)
            for g, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                g.copy_(synced)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> torch.Tensor | None:
        """Norm clipping by the norm over all stages (all-reduce of squared norms over the pipeline)."""
        if algorithm == "value":
            return super().clip_gradients(optimizer, value, algorithm)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        squares = torch.zeros((), device=self.root_device)
        for p in params:
            squares = squares + p.grad.detach().float().pow(2).sum()
        total = C.all_reduce(squares, "sum", self.pp_group).sqrt()
        coef = (value / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
        return total

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, stage: str, batch: Any, batch_idx: int) -> Any:
        """Every rank of the pipeline runs this with the same batch; the last stage runs the user's step."""
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        with self.precision.forward_context():
            output = self._forward_stages(inputs)
        records: list[tuple[str, torch.Tensor, dict[str, Any]]] = []
        result = None
        if self.is_last_stage:
            with captured_logs(self.module, records), self._sequential_as(output):
                with self.precision.forward_context():
                    result = getattr(self.module, f"{stage}_step")(batch, batch_idx)
        if stage != "predict":
            self._share_logged(records)
        return result

    def _forward_stages(self, x: torch.Tensor) -> torch.Tensor | None:
        """The whole batch through this rank's stages in order, activations sent between ranks."""
        for s in self.local_stages:
            if s > 0 and self.owner[s - 1] != self.pp_rank:
                x = _recv_tensor(self.pp_ranks[self.owner[s - 1]], self.pp_group, self.root_device)
            x = self.stage_modules[s](x)
            if s < self.n_stages - 1 and self.owner[s + 1] != self.pp_rank:
                _send_tensor(x, self.pp_ranks[self.owner[s + 1]], self.pp_group, self.root_device)
        return x if self.is_last_stage else None

    @contextlib.contextmanager
    def _sequential_as(self, output: Any) -> Iterator[None]:
        modules = self.module._modules
        seq = modules[self.seq_name]
        modules[self.seq_name] = _PipelineOutput(output, self.seq_name)
        try:
            yield
        finally:
            modules[self.seq_name] = seq

    def _share_logged(self, records: list[tuple[str, torch.Tensor, dict[str, Any]]]) -> None:
        """Copy what the last stage logged to the other stages, so every rank holds the same metrics."""
        if not C.active(self.pp_group):
            return
        described = C.broadcast_object([(name, kwargs) for name, _, kwargs in records], self.last_rank, self.pp_group)
        if not described:
            return
        packed = (torch.stack([v.to(self.root_device) for _, v, _ in records]) if self.is_last_stage
                  else torch.zeros(len(described), device=self.root_device))
        packed = C.broadcast(packed, self.last_rank, self.pp_group)
        if not self.is_last_stage:
            for (name, kwargs), value in zip(described, packed.unbind(0)):
                self.module.log(name, value, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, payload: dict[str, Any], path: str) -> None:
        save_sharded(self, payload, path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return load_sharded(self, path)


def _split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        kind = f"{type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else type(batch).__name__
        raise TypeError(f"the pipeline strategy needs batches of (inputs, targets); got a {kind}. Return pairs "
                        f"from the dataset/collate_fn")
    return batch[0], batch[1]


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_HEADER = 10  # dtype, ndim, up to 8 sizes


def _send_tensor(x: torch.Tensor, dst: int, group: Any, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim > _HEADER - 2:
        raise TypeError(f"pipeline stages must pass one tensor of at most {_HEADER - 2} dims to the next stage; "
                        f"got {type(x).__name__}{'' if not isinstance(x, torch.Tensor) else f' of {x.ndim} dims'}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(x.dtype), x.ndim
    header[2:2 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    dist.send(header.to(device), dst=dst, group=group)
    dist.send(x.contiguous(), dst=dst, group=group)


def _recv_tensor(src: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    x = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, src=src, group=group)
    return x
