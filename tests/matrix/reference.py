"""The plain-PyTorch reference: one small rule per feature, composed in one process (never polytrain).

- data: per data-parallel rank ``r`` of ``dp``, ``DataLoader(sampler=DistributedSampler(dp, r, shuffle,
  seed=SEED))`` with ``set_epoch`` each epoch and the case's ``num_workers``; the global batch is split
  evenly over the ranks.
- RNG streams (DESIGN.md, seeding; ``trainer.seed=SEED``): every process of data-parallel rank ``r`` draws
  from ``torch.manual_seed(SEED + r)`` from the first training batch on; a process's loader (the
  workers' base seed at each epoch's iterator, the noise of ``num_workers=0``) and its layers' dropout
  draw from that one stream, in program order. Tensor-parallel peers draw identically (one of them is
  simulated); pipeline stages are separate processes, each with its own copy of the stream and its own
  loader (stage 0 reads the inputs, the last stage the targets).
- data parallel: each rank accumulates its own gradients (its own backward of its own scaled loss: an
  fp16 overflow is a rank's own), and at a window's end they are averaged over the ranks.
- pipeline: each batch runs as ``n_microbatches = 2`` micro-batches, each loss times
  ``1 / (accumulation x n_microbatches)``.
- accumulation: every loss divided by the window length; optimizers zeroed at a window's first batch,
  stepped at its last.
- precision (PyTorch's AMP recipe, https://pytorch.org/docs/stable/notes/amp_examples.html): forward and
  loss under ``torch.autocast``; ``16-mixed``: ``scaler.scale(loss).backward()``, per optimizer
  ``scaler.unscale_`` (before clipping) and ``scaler.step``, one ``scaler.update()`` per iteration.
- clipping: ``clip_grad_norm_`` over each optimizer's own parameters, before its step.
- validation (``mid-epoch``: after every third batch, the epoch's last included): each process iterates
  its validation loader (data-parallel rank ``r`` of ``dp``: samples ``r, r+dp, ...``; every pipeline stage
  and tensor-parallel peer: all of them) in its own stream, so the iterator's base seed and each sample's
  noise are drawn where polytrain draws them. Evaluation changes no weight: only the streams move.
- resume: the reference is the uninterrupted run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from .cases import Case
from .model import (
    BATCHES_PER_EPOCH,
    CLIP,
    EPOCHS,
    GLOBAL_BATCH,
    SEED,
    SPLIT,
    Noisy,
    build,
    loss_of,
    make_optimizers,
    optimizer_groups,
    validation_set,
)

MICROBATCHES = 2  # the pipeline's default: one per stage


class Streams:
    """One torch RNG state per simulated process, swapped in around what that process draws."""

    def __init__(self, seeds: dict[Any, int]) -> None:
        self.states = {key: torch.Generator().manual_seed(seed).get_state() for key, seed in seeds.items()}

    @contextlib.contextmanager
    def on(self, key: Any) -> Iterator[None]:
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states[key])
        try:
            yield
        finally:
            self.states[key] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _stages(net: nn.Sequential, case: Case) -> list[nn.Sequential]:
    if case.strategy != "pipeline":
        return [net]
    return [net[:SPLIT], net[SPLIT:]]


def _loader(dp: int, rank: int, workers: int) -> DataLoader:
    ds = Noisy()
    sampler = DistributedSampler(ds, num_replicas=dp, rank=rank, shuffle=True, seed=SEED)
    return DataLoader(ds, batch_size=GLOBAL_BATCH // dp, sampler=sampler, num_workers=workers)


def _validate(case: Case, streams: Streams, procs: list[tuple[int, int]]) -> None:
    """What a validation draws, per process: its loader's iterator and its samples' noise."""
    val = validation_set()
    for r, s in procs:
        share = Subset(val, range(r, len(val), case.dp))
        with streams.on((r, s)):
            for _ in DataLoader(share, batch_size=GLOBAL_BATCH // case.dp):
                pass


def _autocast(case: Case) -> contextlib.AbstractContextManager:
    dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(case.precision)
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _backward(case: Case, net: nn.Sequential, streams: Streams, rank: int, batches: list[Any],
              scaler: torch.amp.GradScaler | None) -> None:
    """Data rank ``rank``'s forward and backward of one batch: ``batches[s]`` is stage ``s``'s copy."""
    stages = _stages(net, case)
    micro = MICROBATCHES if case.strategy == "pipeline" else 1
    x, y = batches[0][0], batches[-1][1]
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
        with _autocast(case):
            h = xm
            for s, stage in enumerate(stages):
                with streams.on((rank, s)):
                    h = stage(h)
            loss = loss_of(h, ym)
            # The pipeline multiplies by one factor per micro-batch; elsewhere the loss is divided by the
            # window, as a hand loop writes it. Halving over two data ranks is exact either way.
            loss = loss * (1.0 / (case.accumulate * micro)) if micro > 1 else loss / case.accumulate
        (scaler.scale(loss) if scaler is not None else loss).backward()


def _step(case: Case, optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler | None) -> None:
    for opt in optimizers:
        if scaler is not None:
            scaler.unscale_(opt)
        if case.clip:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], CLIP)
        if scaler is not None:
            scaler.step(opt)
        else:
            opt.step()
    if scaler is not None:
        scaler.update()


def _take_grads(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def _put_grads(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def _average(per_rank: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """The all-reduce mean of each rank's accumulated gradients (each divided by the count, then summed,
    as DDP's hook does; halving is exact, so the order does not matter)."""
    n = len(per_rank)
    return [None if gs[0] is None else sum(g / n for g in gs) if n > 1 else gs[0] for gs in zip(*per_rank)]


def reference(case: Case) -> dict[str, torch.Tensor]:
    """The case's final weights (``net.<name>``) by the rules above."""
    torch.manual_seed(SEED)
    net = build(case.dropout)
    params = list(net.parameters())
    optimizers = make_optimizers(optimizer_groups(list(net.named_parameters()), case.optimizers), case.impl)
    scaler = torch.amp.GradScaler("cpu") if case.precision == "16-mixed" else None
    n_stages = len(_stages(net, case))
    procs = [(r, s) for r in range(case.dp) for s in range(n_stages)]
    streams = Streams({(r, s): SEED + r for r, s in procs})
    loaders = {p: _loader(case.dp, p[0], case.workers) for p in procs}
    local: list[list[torch.Tensor | None]] = []  # each data rank's gradients, accumulated over a window
    net.train()
    for epoch in range(EPOCHS):
        iterators = {}
        for p in procs:
            loaders[p].sampler.set_epoch(epoch)
            with streams.on(p):
                iterators[p] = iter(loaders[p])
        for i in range(BATCHES_PER_EPOCH):
            batches = {}
            for p in procs:
                with streams.on(p):
                    batches[p] = next(iterators[p])
            if i % case.accumulate == 0:
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                local = [[None] * len(params) for _ in range(case.dp)]
            for r in range(case.dp):
                _put_grads(params, local[r])
                _backward(case, net, streams, r, [batches[(r, s)] for s in range(n_stages)], scaler)
                local[r] = _take_grads(params)
            if (i + 1) % case.accumulate == 0:
                _put_grads(params, _average(local))
                _step(case, optimizers, scaler)
            if case.validation == "mid-epoch" and (i + 1) % (BATCHES_PER_EPOCH // 2) == 0:
                _validate(case, streams, procs)
        del iterators  # workers end with their iterator
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}
