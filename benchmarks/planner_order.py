"""Does the planner's predicted order of step times hold on real CPU ranks? The GPT example (examples/gpt)
is planned for ``--ranks`` gloo processes; its top layouts (and a few more) then run through ``Trainer``
(strategy ``parallel`` with the planned degrees, micro-batches and checkpointing), interleaved over rounds.

Usage::

    python benchmarks/planner_order.py --calibrate                  # 8 ranks x 2 threads (a 16-core machine)
    python benchmarks/planner_order.py --tiny --ranks 4             # a seconds-long smoke run

Hardware: the planner's ``cpu`` preset, or with ``--calibrate`` this machine's figures, measured on the
same number of processes at once (what the layouts will share): the matmul FLOP/s one process reaches
at ``--threads`` threads on the model's MLP GEMM shape (the best of ``--calibration-reps``, taken as the
peak; ``--efficiency``, an input, is the fraction of it the whole model reaches), and a gloo all-reduce
over every rank at two sizes, read as the planner's ring model
``t = 2(n-1) latency + bytes 2(n-1)/n / bandwidth``.

Measured: per step, the slowest rank's wall time (``on_train_batch_start`` to ``on_train_batch_end``),
the median over ``--steps`` steps after ``--warmup``, then the median over ``--rounds`` rounds (each
round runs every layout once, the order rotated). Printed: predicted and measured step time of each
layout, both orders, and whether the measured order of the planner's top three is its predicted order.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "gpt"))

SMALL, LARGE = 1024, 16 * 2**20  # all-reduce payloads (bytes) for latency and bandwidth


def make_module(args: argparse.Namespace, batch_size: int, meta: bool = False) -> Any:
    import torch
    from gpt_module import CharGPT

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return CharGPT(d_model=args.d_model, n_head=args.n_head, n_layer=args.n_layer,
                       block_size=args.seq_len, stride=8, batch_size=batch_size)


# --------------------------------------------------------------------------- calibration


def _timed(fn: Any, reps: int, best: bool = False) -> float:
    """Median (or best) seconds of ``fn()`` over ``reps`` calls after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def _calibrate_worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    tokens = max(args.global_batch // world, 1) * args.seq_len
    a, b = torch.randn(tokens, args.d_model), torch.randn(args.d_model, 4 * args.d_model)
    dist.barrier()  # every rank multiplies at once, as every rank computes at once in a step
    matmul = _timed(lambda: torch.mm(a, b), args.calibration_reps, best=True)
    small, large = torch.zeros(SMALL // 4), torch.zeros(LARGE // 4)
    dist.barrier()
    t_small = _timed(lambda: dist.all_reduce(small), args.calibration_reps)
    t_large = _timed(lambda: dist.all_reduce(large), max(args.calibration_reps // 4, 2))
    return {"flops": 2 * tokens * args.d_model * 4 * args.d_model / matmul, "t_small": t_small,
            "t_large": t_large}


def calibrate(args: argparse.Namespace) -> dict[str, float]:
    """This machine's peak FLOP/s per process, all-reduce bandwidth (bytes/s) and latency (s per step)."""
    from distributed import run_distributed

    ranks = run_distributed(_calibrate_worker, args.ranks, args, timeout=args.timeout)
    n = args.ranks
    flops = statistics.median(r["flops"] for r in ranks)
    t_small = max(r["t_small"] for r in ranks)
    t_large = max(r["t_large"] for r in ranks)
    latency = t_small / (2 * (n - 1))
    bandwidth = (LARGE - SMALL) * 2 * (n - 1) / n / max(t_large - t_small, 1e-9)
    return {"peak_flops": flops, "intra_bw": bandwidth, "inter_bw": bandwidth, "intra_latency": latency,
            "inter_latency": latency}


# --------------------------------------------------------------------------- planning


def plan(args: argparse.Namespace, figures: dict[str, float]) -> tuple[Any, list[Any]]:
    """(the Hardware, the planner's best variant of each degree set, fastest first)."""
    import torch

    from polytrain.parallel.planner import Training, hardware, plan_module
    from polytrain.parallel.planner.search import best_per_degrees

    hw = hardware("cpu", 1, args.ranks, efficiency=args.efficiency, **figures)
    module = make_module(args, args.global_batch, meta=True)
    x = torch.zeros(1, args.seq_len, dtype=torch.long)
    train = Training(global_batch=args.global_batch, precision="32", optimizer="adamw")
    # The planner rejects what torch's 1F1B refuses (fewer micro-batches than stages) and keeps cp at 1,
    # so every ranked layout runs here; its default attention (flash) is what CPU runs.
    found = plan_module(module, x, hw, train, target=x, device="cpu")
    return hw, best_per_degrees(found)


# --------------------------------------------------------------------------- measuring


def _strategy(lay: Any) -> dict[str, Any]:
    options = {"name": "parallel", "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp,
               "pp": lay.pp}
    if lay.pp > 1:
        options["n_microbatches"] = lay.n_microbatches
    return options


def _step_timer() -> Any:
    from polytrain import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t0 = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def _run_worker(rank: int, world: int, args: argparse.Namespace, lay: Any, run_dir: str) -> list[float]:
    import torch

    from polytrain import Trainer

    torch.set_num_threads(args.threads)
    timer = _step_timer()
    trainer = Trainer(accelerator="cpu", devices=world, strategy=_strategy(lay), precision="32",
                      activation_checkpointing=lay.checkpointing_config(), max_steps=args.warmup + args.steps,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                      log_every_n_steps=10**6, run_dir=run_dir, callbacks=[timer])
    trainer.fit(make_module(args, args.global_batch // lay.dp))
    return timer.times[args.warmup:]


def measure_once(args: argparse.Namespace, lay: Any) -> float:
    """Median over the timed steps of the slowest rank's step time, one launch of ``lay``."""
    from distributed import run_distributed

    with tempfile.TemporaryDirectory() as run_dir:
        ranks = run_distributed(_run_worker, args.ranks, args, lay, run_dir, timeout=args.timeout)
    return statistics.median(max(step) for step in zip(*ranks))


def measure(args: argparse.Namespace, layouts: list[Any]) -> list[float]:
    """Each layout's median over rounds; every round runs all of them, the order rotated by one."""
    samples: list[list[float]] = [[] for _ in layouts]
    for r in range(args.rounds):
        order = [(i + r) % len(layouts) for i in range(len(layouts))]
        for i in order:
            try:
                samples[i].append(measure_once(args, layouts[i]))
            except RuntimeError as err:  # a layout the strategy cannot run here: reported, the others go on
                print(f"{layouts[i].label()} failed: {str(err).strip().splitlines()[-1][:200]}", flush=True)
                samples[i].append(math.inf)
        print(f"round {r + 1}/{args.rounds}: "
              + ", ".join(f"{layouts[i].label()} {samples[i][-1] * 1e3:.1f} ms"
                          for i in range(len(layouts))), flush=True)
    return [statistics.median(s) for s in samples]


# --------------------------------------------------------------------------- report


def report(estimates: list[Any], measured: list[float], top: int) -> bool:
    """Print both orders; whether the planner's top ``top`` run in its predicted order. Layouts the planner
    ranks as tied (throughputs within ``search.TIE``, then less memory first) may run in either order."""
    from polytrain.parallel.planner.search import TIE

    print(f"{'#':>3}  {'layout':<36}{'predicted ms':>14}{'measured ms':>13}{'measured rank':>15}")
    by_time = sorted(range(len(measured)), key=lambda i: measured[i])
    for i, est in enumerate(estimates):
        shown = f"{measured[i] * 1e3:>13.2f}" if math.isfinite(measured[i]) else f"{'failed':>13}"
        print(f"{i + 1:>3}  {est.layout.label():<36}{est.step_time * 1e3:>14.2f}{shown}"
              f"{by_time.index(i) + 1:>15}")
    print("predicted order: " + " < ".join(e.layout.label() for e in estimates))
    print("measured order:  " + " < ".join(estimates[i].layout.label() for i in by_time))
    head = range(min(top, len(estimates)))
    swapped = [(i, j) for i in head for j in head if i < j and measured[i] > measured[j]
               and estimates[j].step_time > estimates[i].step_time * (1 + TIE)]
    ties = [(i, j) for i in head for j in head if i < j and measured[i] > measured[j]
            and (i, j) not in swapped]
    beaten = [estimates[i].layout.label() for i in by_time[:len(head)] if i not in head]
    print(f"planner order: measured order of the predicted top {len(head)} agrees: "
          f"{'NO' if swapped else 'yes'}"
          + (f" (swapped within the planner's {TIE:.0%} tie: "
             + ", ".join(f"#{i + 1}/#{j + 1}" for i, j in ties) + ")" if ties else "")
          + (f"; faster than one of them: {', '.join(beaten)}" if beaten else ""))
    return not swapped


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch threads per rank")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--top", type=int, default=3, help="the planner's top layouts whose order is checked")
    p.add_argument("--extra", type=int, default=2, help="the next layouts run too")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibrate", action="store_true", help="measure FLOP/s and gloo all-reduce here")
    p.add_argument("--calibration-reps", type=int, default=20)
    p.add_argument("--efficiency", type=float, default=None,
                   help="fraction of peak the model reaches (default: the preset's 0.3; 0.8 with "
                        "--calibrate)")
    p.add_argument("--timeout", type=float, default=300.0, help="per launch, seconds")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.d_model, args.n_head, args.n_layer, args.seq_len, args.global_batch = 32, 4, 2, 32, 8
        args.rounds, args.steps, args.warmup, args.extra, args.calibration_reps = 1, 2, 1, 0, 4
    if args.efficiency is None:
        args.efficiency = 0.8 if args.calibrate else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    import polytrain

    print(f"planner_order: polytrain {polytrain.__version__}, torch {torch.__version__}, GPT example d_model "
          f"{args.d_model} n_layer {args.n_layer} n_head {args.n_head} seq {args.seq_len}, global batch "
          f"{args.global_batch}, fp32 AdamW, {args.ranks} gloo ranks x {args.threads} threads", flush=True)
    figures = calibrate(args) if args.calibrate else {}
    hw, ranked = plan(args, figures)
    print(f"hardware ({'calibrated here' if figures else 'cpu preset'}): "
          f"peak {hw.peak_flops / 1e9:.1f} GFLOP/s "
          f"per rank, efficiency {hw.efficiency}, all-reduce bandwidth {hw.intra_bw / 1e9:.2f} GB/s, latency "
          f"{hw.intra_latency * 1e6:.1f} us per step", flush=True)
    chosen = ranked[:args.top + args.extra]
    for i, est in enumerate(chosen, 1):
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in est.time.items() if v > 0)
        print(f"plan #{i}: {est.layout.label()}: predicted {est.step_time * 1e3:.2f} ms ({parts} ms)",
              flush=True)
    measured = measure(args, [e.layout for e in chosen])
    report(chosen, measured, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
