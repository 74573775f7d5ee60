"""Per-rank memory of parameters + gradients + Adam state under polytrain's fsdp against ddp.

Usage::

    python benchmarks/fsdp_memory.py                     # 2 and 4 gloo ranks
    python benchmarks/fsdp_memory.py --worlds 2 --width 512

What is counted: the bytes of the tensors each rank holds locally -- ``DTensor.to_local()`` for
fsdp's sharded parameters, gradients and optimizer state; the plain tensors for ddp -- measured
in ``on_before_optimizer_step`` of the first step (parameters and gradients) and after it (Adam's
``exp_avg``/``exp_avg_sq``/``step``). Not counted: activations, ddp's gradient buckets, fsdp's
transient all-gather buffers, allocator slack. Goal: the largest fsdp rank holds at most 1/N of a
ddp rank + 5% (uneven shards and Adam's per-parameter ``step`` scalars are the slack).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

GOAL_SLACK = 1.05


def local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def _measure(args: argparse.Namespace, strategy: str, run_dir: str) -> dict[str, int]:
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain import Trainer, TrainModule

    class Module(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[str, int] = {}

        def configure_model(self) -> None:
            if hasattr(self, "net"):  # idempotent: called again by validate/test
                return
            blocks = [nn.Sequential(nn.Linear(args.width, 4 * args.width), nn.GELU(),
                                    nn.Linear(4 * args.width, args.width)) for _ in range(args.blocks)]
            self.net = nn.Sequential(*blocks, nn.Linear(args.width, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.sizes["params"] = local_bytes(self.parameters())
            self.sizes["grads"] = local_bytes(p.grad for p in self.parameters())

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            gen = torch.Generator().manual_seed(0)
            n = 4 * args.world
            ds = TensorDataset(torch.randn(n, args.width, generator=gen),
                               torch.randint(0, 10, (n,), generator=gen))
            return DataLoader(ds, batch_size=4)

    module = Module()
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices="auto", max_steps=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      run_dir=run_dir)
    trainer.fit(module)
    optimizer = trainer.strategy.optimizers[0]
    module.sizes["adam"] = local_bytes(v for state in optimizer.state.values() for v in state.values())
    return module.sizes


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, dict[str, int]]:
    args.world = world_size
    with tempfile.TemporaryDirectory() as tmp:
        return {s: _measure(args, s, tmp) for s in ("ddp", "fsdp")}


def _mib(n: int) -> str:
    return f"{n / 2**20:8.3f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    args = p.parse_args(argv)
    from distributed import run_distributed

    ok = True
    for world in args.worlds:
        ranks = run_distributed(_worker, world, args, timeout=600.0)
        ddp = max(sum(r["ddp"].values()) for r in ranks)
        fsdp = max(sum(r["fsdp"].values()) for r in ranks)
        ratio, goal = fsdp / ddp, GOAL_SLACK / world
        ok = ok and ratio <= goal
        print(f"{world} ranks, {args.blocks} blocks of width {args.width} (largest rank):")
        for part in ("params", "grads", "adam"):
            print(f"  {part:7s} ddp {_mib(max(r['ddp'][part] for r in ranks))}   "
                  f"fsdp {_mib(max(r['fsdp'][part] for r in ranks))}")
        print(f"  total   ddp {_mib(ddp)}   fsdp {_mib(fsdp)}   fsdp/ddp = {ratio:.4f} "
              f"(1/N = {1 / world:.4f}, goal <= {goal:.4f}: {'met' if ratio <= goal else 'MISSED'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
