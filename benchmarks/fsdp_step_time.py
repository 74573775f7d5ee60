"""polytrain's fsdp step against a hand-written ``fully_shard`` loop doing the same work.

Usage::

    python benchmarks/fsdp_step_time.py                  # 2 gloo ranks, 7 timed pairs
    python benchmarks/fsdp_step_time.py --rounds 11 --steps 60 --width 512

What "the same work" means: both variants build the same MLP stack (``--blocks`` blocks of
``width -> 4*width -> width`` in an ``nn.Sequential``, then a 10-way head) from the same seed,
``fully_shard`` every child of that Sequential (polytrain's default units: the blocks and the
head) and then the root over a 1-D mesh of the 2 ranks, and train with
``AdamW(lr=1e-3)`` on the same ``TensorDataset`` through a ``DataLoader`` whose
``DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=0)`` gets ``set_epoch(0)``.

* polytrain: ``Trainer(strategy="fsdp")`` with logging, progress bar and checkpoints off.
* hand loop: ``init_device_mesh`` + ``fully_shard`` + ``zero_grad`` / forward / ``backward`` / ``step``.

Timing: steady state only -- from the end of the first optimizer step to the end of the last, so
mesh building and sharding (one-off costs) do not dilute the per-step overhead being measured.
Pairs alternate their order (P H, H P, ...); the first pair is a warm-up. Reported: rank 0's
median ms/step of each, the median per-pair ratio polytrain / hand of wall time (goal <= 1.03)
and of the process's CPU time (robust when other jobs share the cores), and whether the final
weights agree (they must: same data order, same arithmetic).
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

GOAL = 1.03


def build_net(args: argparse.Namespace) -> nn.Sequential:
    blocks = [nn.Sequential(nn.Linear(args.width, 4 * args.width), nn.GELU(),
                            nn.Linear(4 * args.width, args.width))
              for _ in range(args.blocks)]
    return nn.Sequential(*blocks, nn.Linear(args.width, 10))


def loader(args: argparse.Namespace, sampler: Any = None) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(1)
    n = args.steps * args.batch_size * 2
    ds = TensorDataset(torch.randn(n, args.width, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    if sampler is None:
        return DataLoader(ds, batch_size=args.batch_size, shuffle=True)
    return DataLoader(ds, batch_size=args.batch_size, sampler=sampler(ds))


def run_polytrain(args: argparse.Namespace,
                  run_dir: str) -> tuple[tuple[float, float], dict[str, torch.Tensor]]:
    from polytrain import Trainer, TrainModule

    class Module(TrainModule):
        def configure_model(self) -> None:
            if hasattr(self, "net"):  # idempotent: called again by validate/test
                return
            self.net = build_net(args)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.start = (time.perf_counter(), time.process_time())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return loader(args)

    trainer = Trainer(strategy="fsdp", accelerator="cpu", devices="auto", max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      run_dir=run_dir)
    module = Module()
    trainer.fit(module)
    elapsed = (time.perf_counter() - module.start[0], time.process_time() - module.start[1])
    return elapsed, trainer.strategy.module_state_dict()


def run_hand(args: argparse.Namespace) -> tuple[tuple[float, float], dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DistributedSampler

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # polytrain seeds the same way before configure_model
    net = build_net(args)
    for block in net:  # polytrain's default units: every child with parameters of the largest Sequential
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batches = loader(args, lambda ds: DistributedSampler(ds, num_replicas=dist.get_world_size(),
                                                         rank=dist.get_rank(), shuffle=True, seed=0))
    batches.sampler.set_epoch(0)
    start = (0.0, 0.0)
    for i, (x, y) in enumerate(batches):
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            start = (time.perf_counter(), time.process_time())
    elapsed = (time.perf_counter() - start[0], time.process_time() - start[1])
    state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return elapsed, {f"net.{k}": v for k, v in state.items()}


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import polytrain.core.process_group as pg
    from polytrain.core.environment import detect_environment

    pg.init_process_group(detect_environment(), "gloo", 600.0)
    times: dict[str, list[float]] = {"polytrain": [], "hand": []}
    ratios, cpu_ratios, match = [], [], True
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.rounds + 1):
            order = ["polytrain", "hand"] if pair % 2 == 0 else ["hand", "polytrain"]
            got = {}
            for variant in order:
                dist.barrier()
                got[variant] = run_polytrain(args, tmp) if variant == "polytrain" else run_hand(args)
            if rank == 0:
                ours, theirs = got["polytrain"][1], got["hand"][1]
                match = match and ours.keys() == theirs.keys() and all(
                    torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-6) for k in ours)
            if pair == 0:
                continue  # warm-up
            for variant in order:
                times[variant].append(got[variant][0][0] / (args.steps - 1))
            ratios.append(got["polytrain"][0][0] / got["hand"][0][0])
            cpu_ratios.append(got["polytrain"][0][1] / got["hand"][0][1])
    return {"times": times, "ratios": ratios, "cpu_ratios": cpu_ratios, "match": match}


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
    ratio = statistics.median(result["ratios"])
    print(f"fsdp (2 gloo ranks), {args.blocks} blocks of width {args.width}, batch {args.batch_size}/rank, "
          f"{args.steps} steps x {args.rounds} pairs (median, rank 0, steady state):")
    print(f"  polytrain   {ms['polytrain']:.2f} ms/step")
    print(f"  hand loop   {ms['hand']:.2f} ms/step")
    print(f"ratio polytrain / hand: {ratio:.3f} (goal <= {GOAL}; per pair: "
          f"{', '.join(f'{r:.3f}' for r in result['ratios'])}); "
          f"weights match: {'yes' if result['match'] else 'NO'}")
    # CPU time of rank 0's process: far less sensitive to other jobs sharing the cores than wall time.
    print(f"ratio of CPU time polytrain / hand: {statistics.median(result['cpu_ratios']):.3f} (per pair: "
          f"{', '.join(f'{r:.3f}' for r in result['cpu_ratios'])})")
    return 0 if result["match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
