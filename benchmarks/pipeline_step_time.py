"""polytrain's pipeline step against a hand-written ``torch.distributed.pipelining`` loop.

Usage::

    python benchmarks/pipeline_step_time.py                     # 1F1B, 2 ranks, 7 pairs of rounds
    python benchmarks/pipeline_step_time.py --schedule gpipe --rounds 9 --steps 60

Identical work: both variants train the same ``nn.Sequential`` of ``--layers`` ``Linear(width,
width) + tanh`` blocks (built from the same seed; the model of ``pipeline_bubble.py`` without its
artificial cost) cut into the same 2 stages, with the same torch schedule class,
``--microbatches`` microbatches of ``--microbatch-size`` rows, ``SGD(lr=1e-3)``, the same batches
in the same order through a ``DataLoader`` over ``DistributedSampler(num_replicas=1, rank=0,
shuffle=False)`` and ``zero_grad(set_to_none=True)`` after every step.

* polytrain: ``Trainer(strategy={"name": "pipeline", "schedule": ..., "n_microbatches": ...})``
  with progress bar, loggers and checkpointing off; everything else the trainer does per step is
  measured (sampler, batch moves, the loss broadcast to every stage, guards, hooks, callbacks).
* hand loop: ``PipelineStage`` + the schedule class built by hand; ``schedule.step(x)`` on the
  first stage, ``schedule.step(target=y, losses=losses, return_outputs=False)`` on the last,
  ``opt.step()``; every 50 steps the last stage takes the mean loss with ``.item()``.

Timing: a timestamp after every optimizer step (a callback for polytrain); the median of the
step-to-step intervals after ``--warmup`` steps is a round's ms/step (set-up is excluded on both
sides). Rounds run in pairs of alternating order (P H, H P, ...) on the same two processes and
process group; the first pair is a warm-up and is discarded. Reported: the median ms/step of each
variant, and the median over pairs of the ratio polytrain / hand, from rank 0 (rank 1 also shown).
After each pair the two variants' final weights of every stage are compared (``weights match``:
equal within 1e-6; the hand loop lets torch divide gradients by m, polytrain scales the loss).
Absolute times are noise on a shared machine; the ratio is what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import OrderedDict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_bubble import make_data, make_module, spawn  # noqa: E402 - the path insertion comes first


def _split(module: Any, rank: int, layers: int) -> Any:
    """The hand-written cut: this rank's half of ``module.net`` (2 equal stages)."""
    from torch import nn

    half = layers // 2
    names = list(module.net._modules)[half * rank: half * (rank + 1)]
    return nn.Sequential(OrderedDict((n, module.net._modules[n]) for n in names))


def run_polytrain(args: Any, rank: int) -> tuple[float, list[Any]]:
    import torch

    from polytrain import Callback, Trainer

    stamps: list[float] = []

    class Stamp(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            stamps.append(time.perf_counter())

    torch.manual_seed(0)
    module = make_module(args, args.microbatches * args.microbatch_size)
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1, enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, run_dir=args.run_dir, log_every_n_steps=50,
                      callbacks=[Stamp()],
                      strategy={"name": "pipeline", "schedule": args.schedule,
                                "n_microbatches": args.microbatches})
    trainer.fit(module)
    return _median_interval(stamps, args.warmup), [p.detach().clone() for p in module.parameters()]


def run_hand(args: Any, rank: int) -> tuple[float, list[Any]]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.utils.data import DataLoader, DistributedSampler

    torch.manual_seed(0)
    stage_module = _split(make_module(args, 1), rank, args.layers)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    cls = {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B}[args.schedule]
    schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    data = make_data(args, args.microbatches * args.microbatch_size)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False, seed=0)
    loader = DataLoader(data, batch_size=args.microbatches * args.microbatch_size, sampler=sampler)
    sampler.set_epoch(0)
    stamps, logged = [], []
    for step, (x, y) in enumerate(loader):
        if rank == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses, return_outputs=False)  # as polytrain: outputs unused
            if (step + 1) % 50 == 0:
                logged.append(torch.stack(losses).mean().item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return _median_interval(stamps, args.warmup), [p.detach().clone() for p in stage_module.parameters()]


def _median_interval(stamps: list[float], warmup: int) -> float:
    return statistics.median(b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:]))


def _worker(rank: int, args: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)  # both variants share this group
    times: dict[str, list[float]] = {"polytrain": [], "hand": []}
    match = []
    for pair in range(args.rounds):
        order = ("polytrain", "hand") if pair % 2 == 0 else ("hand", "polytrain")
        weights = {}
        for which in order:
            dist.barrier()
            seconds, weights[which] = (run_polytrain if which == "polytrain" else run_hand)(args, rank)
            times[which].append(seconds)
        match.append(all(torch.allclose(a, b, rtol=0, atol=1e-6)
                         for a, b in zip(weights["polytrain"], weights["hand"])))
    return {"times": times, "match": match}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7, help="pairs of rounds; the first is a warm-up")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--run-dir", default="/tmp/polytrain-pipeline-step-time")
    args = ap.parse_args(argv)
    args.cost_ms = 0.0  # make_module's artificial cost: off, only the real matmuls
    ranks = spawn(_worker, 2, args, args.timeout)
    print(f"pipeline step time: {args.schedule}, 2 ranks, "
          f"{args.layers} x Linear({args.width}, {args.width}), "
          f"m={args.microbatches} x {args.microbatch_size} rows, {args.steps} steps per round, "
          f"{args.rounds - 1} measured pairs (CPU, gloo, 1 thread/rank)")
    for rank, result in enumerate(ranks):
        poly, hand = result["times"]["polytrain"][1:], result["times"]["hand"][1:]
        ratios = [p / h for p, h in zip(poly, hand)]
        print(f"rank {rank}: polytrain {1000 * statistics.median(poly):.2f} ms/step, hand "
              f"{1000 * statistics.median(hand):.2f} ms/step, median ratio polytrain/hand "
              f"{statistics.median(ratios):.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)}); "
              f"weights match: {all(result['match'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
