"""Pipeline bubble: measured idle fraction of each stage, per schedule, against the formula.

Usage::

    python benchmarks/pipeline_bubble.py                  # 2 ranks, m = 2, 4, 8 microbatches
    python benchmarks/pipeline_bubble.py --microbatches 4 8 16 --steps 12 --width 512

What is measured
----------------
Two gloo ranks on CPU (one thread each, so neither steals the other's core) train an
``nn.Sequential`` of ``--layers`` identical ``Linear(width, width) + tanh`` blocks through
``Trainer(strategy={"name": "pipeline", ...})``: pp=2, the layers split evenly (4 per rank, or
2 per stage with 2 stages per rank), each microbatch ``--microbatch-size`` rows. A Linear is real
compute (a matmul), so forward, input-gradient and weight-gradient work have realistic relative
costs (roughly 1 : 1 : 1) and the zero-bubble schedules can move weight-gradient work into bubbles.

* busy time of a rank: ``time.perf_counter`` around every call of the stage's compute methods
  (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk`` of torch's
  ``PipelineStage``); waits for activations or gradients happen outside them.
* wall time of a step: around ``PipelineRunner.forward_backward`` (the whole schedule step,
  including the loss broadcast), i.e. not the optimizer step or data loading.
* idle fraction = 1 - busy / wall, summed over the ``--steps`` steps after ``--warmup`` ones,
  per rank; the table shows the mean over ranks and the worse rank.

Formula: for p ranks, m microbatches and v stages per rank with forward/backward times equal on
every stage, the bubble of GPipe/1F1B is (p-1)/(m+p-1) of the step, and interleaving divides the
bubble by v: (p-1)/(v*m+p-1). Zero-bubble schedules aim at ~0 when forward, input-backward and
weight-backward cost the same. Measured values add what the formula ignores: communication,
Python scheduling overhead and unequal costs (the last stage also computes the loss).
Absolute times are noise on a shared machine; the fractions are what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_ranks import export_rank, free_port, worker_context  # noqa: E402 - beside this script

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]


def _child(fn: Any, rank: int, world: int, port: int, args: Any, results: Any) -> None:
    export_rank(rank, world, port)
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, args)))
    except BaseException:  # noqa: BLE001 - shown by the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Any, world: int, args: Any, timeout: float) -> list[Any]:
    """``fn(rank, args)`` on ``world`` gloo-ready processes; results by rank
    (shared with pipeline_step_time)."""
    ctx = worker_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world:
            rank, status, payload = results.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def make_module(args: Any, batch: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader

    from polytrain import TrainModule

    cost = args.cost_ms / 1000.0

    class InputCost(torch.autograd.Function):
        """Forward and input-gradient cost: on the path to the stage input and to the weights."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            time.sleep(cost)
            return x.clone()  # not a view: zero-bubble detaches stage outputs in place

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(cost)
            return grad

    class WeightCost(torch.autograd.Function):
        """Weight-gradient cost: only on the path to the weight (what zero-bubble defers)."""

        @staticmethod
        def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
            return w.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(cost)
            return grad

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if cost:
                return InputCost.apply(torch.tanh(F.linear(x, WeightCost.apply(self.fc.weight),
                                                           self.fc.bias)))
            return torch.tanh(self.fc(x))

    class Stack(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(Block(args.width) for _ in range(args.layers)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]), batch[1])

        def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(outputs, targets)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(make_data(args, batch), batch_size=batch)

    return Stack()


def make_data(args: Any, batch: int) -> Any:
    """``--warmup + --steps`` batches of random (inputs, targets), the same in every process."""
    import torch
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(0)
    n = batch * (args.warmup + args.steps)
    return TensorDataset(torch.randn(n, args.width, generator=gen), torch.randn(n, args.width, generator=gen))


class Timers:
    """Accumulates busy seconds of the stage compute methods and wall seconds of whole steps."""

    def __init__(self) -> None:
        self.busy, self.steps, self.wall = 0.0, 0, 0.0
        self.counting = False

    def wrap(self, cls: type, name: str, total: str) -> None:
        original = getattr(cls, name)
        timers = self

        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                if timers.counting:
                    setattr(timers, total, getattr(timers, total) + time.perf_counter() - start)

        setattr(cls, name, timed)


def _worker(rank: int, args: Any) -> list[dict[str, Any]]:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from polytrain import Callback, Trainer
    from polytrain.strategies.pipeline_runner import PipelineRunner

    timers = Timers()
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        timers.wrap(_PipelineStageBase, name, "busy")
    timers.wrap(PipelineRunner, "forward_backward", "wall")

    class StartCounting(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            timers.counting = batch_idx + 1 >= args.warmup

    rows = []
    for schedule, v in SCHEDULES:
        for m in args.microbatches:
            timers.busy = timers.wall = 0.0
            timers.counting = False
            trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1, enable_progress_bar=False,
                              logger=False,
                              enable_checkpointing=False, run_dir=args.run_dir, log_every_n_steps=10**6,
                              callbacks=[StartCounting()],
                              strategy={"name": "pipeline", "schedule": schedule, "n_microbatches": m,
                                        "stages_per_rank": v})
            trainer.fit(make_module(args, m * args.microbatch_size))
            rows.append({"schedule": schedule, "m": m, "v": v, "idle": 1.0 - timers.busy / timers.wall,
                         "ms": 1000 * timers.wall / args.steps, "busy_ms": 1000 * timers.busy / args.steps})
    return rows


def formula(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--microbatch-size", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--cost-ms", type=float, default=2.0, help="artificial cost per layer of forward, input-"
                    "gradient and weight-gradient each (sleep); 0: only the real matmul")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--run-dir", default="/tmp/polytrain-pipeline-bubble")
    args = ap.parse_args(argv)
    p = 2
    ranks = spawn(_worker, p, args, args.timeout)
    print(f"pipeline bubble: p={p} ranks, {args.layers} x Linear({args.width}, {args.width}) + "
          f"{args.cost_ms} ms artificial cost per layer for each of F, B-input, B-weight; "
          f"microbatch {args.microbatch_size} rows, "
          f"{args.steps} steps after {args.warmup} warm-up (CPU, gloo, 1 thread/rank)")
    print(f"{'schedule':<18}{'v':>3}{'m':>4}{'idle mean':>11}{'idle max':>10}{'formula':>9}{'ms/step':>9}"
          f"{'busy ms':>9}")
    for i, row in enumerate(ranks[0]):
        idles = [r[i]["idle"] for r in ranks]
        ms = statistics.mean(r[i]["ms"] for r in ranks)
        busy = statistics.mean(r[i]["busy_ms"] for r in ranks)
        zb = row["schedule"] in ("zero_bubble", "zbv")
        print(f"{row['schedule']:<18}{row['v']:>3}{row['m']:>4}{statistics.mean(idles):>11.3f}{max(idles):>10.3f}"
              f"{formula(p, row['m'], row['v']):>9.3f}{ms:>9.1f}{busy:>9.1f}"
              f"{'  (formula without zero-bubble gains)' if zb else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
