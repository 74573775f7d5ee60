"""polytrain's tensor-parallel step against a hand-written ``parallelize_module`` loop doing the same work.

Usage::

    python benchmarks/model_parallel_step_time.py                 # 2 gloo ranks, tp=2, 7 pairs
    python benchmarks/model_parallel_step_time.py --rounds 11 --steps 80 --width 512

What "the same work" means: both variants build the same residual-MLP stack (``--blocks`` blocks of
``width -> 4*width -> width``, then a 10-way head) from the same seed, shard every block's ``fc``
column-wise and ``proj`` row-wise over a fresh 1-D tp mesh of the 2 ranks, and train it with
``SGD(lr=0.01, momentum=0.9)`` on the same ``TensorDataset`` through a ``DataLoader`` whose
``DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)`` (one data-parallel
replica: both tp ranks see every batch) gets ``set_epoch`` every epoch.

* polytrain: ``Trainer(strategy={"name": "model_parallel", "mode": "tensor", "tp": 2})`` with
  logging, progress bar and checkpoints off; ``training_step`` returns the cross-entropy.
* hand loop: ``init_device_mesh`` + ``parallelize_module`` + the plain ``zero_grad`` / forward /
  ``backward`` / ``step`` loop.

Timing: wall time of ``trainer.fit`` (which includes the mesh and the sharding) against the hand
loop including its own mesh and sharding, per optimizer step, each round behind a barrier. Pairs
alternate their order (P H, H P, ...); the first pair is a warm-up. Reported: rank 0's median
ms/step of each, the median per-pair ratio polytrain / hand, and whether the final weights agree
(they must: same data order, same arithmetic). Absolute times are noise; the ratio is the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


def build_net(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(args.width) for _ in range(args.blocks)], nn.Linear(args.width, 10))


def plan(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[str, Any] = {}
    for i in range(args.blocks):
        out[f"{prefix}{i}.fc"] = ColwiseParallel()
        out[f"{prefix}{i}.proj"] = RowwiseParallel()
    return out


def dataset(args: argparse.Namespace) -> Any:
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(1)
    n = args.steps * args.batch_size
    return TensorDataset(torch.randn(n, args.width, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def loader(args: argparse.Namespace, sampler: Any = None) -> Any:
    from torch.utils.data import DataLoader

    ds = dataset(args)
    if sampler is None:
        return DataLoader(ds, batch_size=args.batch_size, shuffle=True)
    return DataLoader(ds, batch_size=args.batch_size, sampler=sampler(ds))


def run_polytrain(args: argparse.Namespace, run_dir: str) -> tuple[float, dict[str, torch.Tensor]]:
    from polytrain import Trainer, TrainModule

    class Module(TrainModule):
        def configure_model(self) -> None:
            if hasattr(self, "net"):  # idempotent: called again by validate/test
                return
            self.net = build_net(args)

        def tensor_parallel_plan(self) -> dict[str, Any]:
            return plan(args, "net.")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self) -> Any:
            return loader(args)

    trainer = Trainer(strategy={"name": "model_parallel", "mode": "tensor", "tp": 2}, accelerator="cpu",
                      devices="auto", max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, run_dir=run_dir)
    module = Module()
    dist.barrier()
    start = time.perf_counter()
    trainer.fit(module)
    elapsed = time.perf_counter() - start
    return elapsed, {k: v for k, v in trainer.strategy.module_state_dict().items()}


def run_hand(args: argparse.Namespace) -> tuple[float, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.data import DistributedSampler

    dist.barrier()
    start = time.perf_counter()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # polytrain seeds the same way before configure_model
    net = parallelize_module(build_net(args), mesh, plan(args, ""))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches = loader(args, lambda ds: DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
    batches.sampler.set_epoch(0)
    for x, y in batches:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    state = {f"net.{k}": (v.full_tensor() if isinstance(v, DTensor) else v)
             for k, v in net.state_dict().items()}
    return elapsed, state


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import polytrain.core.process_group as pg
    from polytrain.core.environment import detect_environment

    pg.init_process_group(detect_environment(), "gloo", 600.0)
    times: dict[str, list[float]] = {"polytrain": [], "hand": []}
    ratios, match = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.rounds + 1):
            order = ["polytrain", "hand"] if pair % 2 == 0 else ["hand", "polytrain"]
            got = {}
            for variant in order:
                got[variant] = run_polytrain(args, tmp) if variant == "polytrain" else run_hand(args)
            if rank == 0:
                ours, theirs = got["polytrain"][1], got["hand"][1]
                match = match and ours.keys() == theirs.keys() and all(
                    torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-6) for k in ours)
            if pair == 0:
                continue  # warm-up
            for variant in order:
                times[variant].append(got[variant][0] / args.steps)
            ratios.append(got["polytrain"][0] / got["hand"][0])
    return {"times": times, "ratios": ratios, "match": match}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="timed pairs (plus one warm-up pair)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per round")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    args = p.parse_args(argv)
    from distributed import run_distributed

    result = run_distributed(_worker, 2, args, timeout=3600.0)[0]
    ms = {k: statistics.median(v) * 1e3 for k, v in result["times"].items()}
    print(f"tensor parallel (tp=2, 2 gloo ranks), {args.blocks} blocks of width {args.width}, batch "
          f"{args.batch_size}, {args.steps} steps x {args.rounds} pairs (median, rank 0):")
    print(f"  polytrain   {ms['polytrain']:.2f} ms/step")
    print(f"  hand loop   {ms['hand']:.2f} ms/step")
    print(f"ratio polytrain / hand: {statistics.median(result['ratios']):.3f} "
          f"(per pair: {', '.join(f'{r:.3f}' for r in result['ratios'])}); "
          f"weights match: {'yes' if result['match'] else 'NO'}")
    return 0 if result["match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
