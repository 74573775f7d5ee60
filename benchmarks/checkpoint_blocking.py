"""How long a checkpoint blocks training: synchronous against asynchronous saves (``ModelCheckpoint
(async_save=True)``), and what saving every N steps costs in steps/s.

Usage::

    python benchmarks/checkpoint_blocking.py                      # ~100M parameters, single, ddp x2, fsdp x2
    python benchmarks/checkpoint_blocking.py --width 1024 --layers 12 --modes single,ddp --rounds 3
    python benchmarks/checkpoint_blocking.py --tiny               # smoke test: seconds

The model is ``--layers`` square ``Linear(--width, --width)`` layers with ReLU (width 2048 x 24 layers:
~100M parameters), AdamW, random data on CPU; a checkpoint holds the weights and both AdamW moments
(3x the parameters). Per mode, each round trains three variants in a rotating order (interleaved, so
a busy machine slows all of them alike): no checkpoints, a synchronous save every ``--every`` steps
and an asynchronous one. Reported (median over rounds):

* blocked per save: wall time inside ``ModelCheckpoint``'s save (building the payload, staging or
  writing, and waiting for a previous async save still writing), plus, for async saves, the time the
  next optimizer update waited for the background staging copy (on CPU the copy of the parameters and
  optimizer state runs in the writer thread during the next forward and backward); the ratio
  async/sync (goal <= 0.10);
* steps/s over the steps after ``--warmup``, each variant against the run without saves (goal >= 0.95
  for async saves). The run's last async write may still be going on when the window ends.

ddp writes one file from rank 0; fsdp writes DCP directories from both ranks (``async_save`` over a
gloo group of its own). Figures are from global rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_ranks import export_rank, first_result  # noqa: E402 - beside this script


def build_module(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain import TrainModule

    class Stack(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for _ in range(args.layers):
                layers += [nn.Linear(args.width, args.width), nn.ReLU()]
            self.net = nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (x,) = batch
            return F.mse_loss(self.net(x), x)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(args.batch_size * 4, args.width, generator=g)),
                              batch_size=args.batch_size)

    return Stack()


def run_variant(args: argparse.Namespace, strategy: str, world: int, variant: str,
                root: str) -> dict[str, Any]:
    from polytrain import Trainer
    from polytrain.callbacks.base import Callback
    from polytrain.callbacks.model_checkpoint import ModelCheckpoint

    class Timed(ModelCheckpoint):
        blocked: list[float] = []

        def _save(self, trainer: Any) -> None:
            start = time.perf_counter()
            super()._save(trainer)
            self.blocked.append(time.perf_counter() - start)

    class Clock(Callback):
        start = end = 0.0

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == args.warmup:
                self.start = time.perf_counter()
            self.end = time.perf_counter()

    clock, callbacks = Clock(), []
    saver = None
    if variant != "none":
        saver = Timed(every_n_train_steps=args.every, every_n_epochs=None, save_top_k=1, save_last=False,
                      save_on_fit_end=False, async_save=variant == "async")
        saver.blocked = []
        callbacks.append(saver)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps,
                      max_epochs=10**6,
                      run_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=saver is not None, callbacks=[clock, *callbacks], seed=0)
    trainer.fit(build_module(args))
    blocked = None
    if saver is not None and saver.blocked:
        waits = trainer.strategy.checkpoint_io.writer.staging_waits if variant == "async" else []
        blocked = statistics.median(b + (waits[i] if i < len(waits) else 0.0)
                                    for i, b in enumerate(saver.blocked))
    return {"steps_per_s": (args.steps - args.warmup) / (clock.end - clock.start), "blocked": blocked}


def run_mode(args: argparse.Namespace, strategy: str, world: int) -> dict[str, list[Any]]:
    variants = ["none", "sync", "async"]
    out: dict[str, list[Any]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for r in range(args.rounds):
            for v in variants[r % 3:] + variants[:r % 3]:  # rotating order: no variant always runs first
                out[v].append(run_variant(args, strategy, world, v, os.path.join(root, f"{v}-{r}")))
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, strategy: str, results: Any) -> None:
    export_rank(rank, world, port)
    try:
        import torch

        torch.set_num_threads(args.threads)
        out = run_mode(args, strategy, world)
        if rank == 0:
            results.put(("ok", out))
    except BaseException:  # noqa: BLE001 - shown by the parent
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def run_multi(args: argparse.Namespace, strategy: str) -> dict[str, list[Any]]:
    return first_result(_worker, 2, (args, strategy), args.timeout, join_timeout=60)


def report(label: str, out: dict[str, list[Any]]) -> list[str]:
    med = {v: statistics.median(r["steps_per_s"] for r in runs) for v, runs in out.items()}
    blocked = {v: statistics.median(r["blocked"] for r in out[v]) for v in ("sync", "async")}
    return [f"{label}: blocked per save: sync {blocked['sync'] * 1e3:.1f} ms, "
            f"async {blocked['async'] * 1e3:.1f} ms, "
            f"ratio {blocked['async'] / blocked['sync']:.3f} (target <= 0.10)",
            f"{label}: steps/s: no saves {med['none']:.3f}, sync {med['sync']:.3f} "
            f"(ratio {med['sync'] / med['none']:.3f}), "
            f"async {med['async']:.3f} (ratio {med['async'] / med['none']:.3f}, target >= 0.95)"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps before the timed window")
    p.add_argument("--every", type=int, default=20, help="save every N steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="single,ddp,fsdp")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: the system's temp dir)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--tiny", action="store_true", help="smoke test: a tiny model, few steps, one round")
    args = p.parse_args(argv)
    if args.tiny:
        (args.width, args.layers, args.batch_size, args.steps, args.warmup, args.every,
         args.rounds) = 32, 2, 4, 6, 1, 2, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    params = args.layers * (args.width * args.width + args.width)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f}M parameters, "
          f"AdamW; {args.steps} steps, a save every {args.every}, {args.rounds} round(s)", flush=True)
    for mode in args.modes.split(","):
        if mode == "single":
            import torch

            torch.set_num_threads(args.threads)
            out = run_mode(args, "single", 1)
        else:
            out = run_multi(args, mode)
        for line in report("single" if mode == "single" else f"{mode} x2", out):
            print(line, flush=True)


if __name__ == "__main__":
    main()
