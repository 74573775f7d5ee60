"""Bytes of parameters + optimizer state each rank holds, per composed layout, against the ideal split.

Usage::

    python benchmarks/composition_memory.py                      # every layout below (1 to 8 gloo ranks)
    python benchmarks/composition_memory.py --layouts pp2_tp2 dp4 --n-layer 4 --d-model 128

The model is the GPT example (examples/gpt) at ``--d-model``/``--n-layer``, AdamW, trained two steps
under strategy ``parallel`` with each layout's degrees. Then every rank counts the storage behind what
it holds: each parameter's local tensor (``DTensor.to_local()``; FSDP's padding included) and every
optimizer state tensor, each storage once.

The ideal for a rank is computed from the one-device model alone, not from what the run built: the
parameters of the stage(s) this rank runs (``pipeline_split.balance``, as the strategy cuts), each
divided by the ranks that split it (``tp`` for the layers the module's plan names, ``dp_shard x cp``
under FSDP), times three (the parameter, AdamW's ``exp_avg`` and ``exp_avg_sq``); a parameter nobody
splits (outside the plan without FSDP, or under ddp) counts whole: those are the "replicated parts".
Reported per layout: the largest and smallest rank, the ideal of the largest, their ratio (goal:
<= 1.05: FSDP's padding of uneven dimensions and Adam's per-parameter ``step`` scalars are the
slack), and ``1/N`` of the one-device total for comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "gpt"))

GOAL = 1.05
LAYOUTS: dict[str, dict[str, int]] = {
    "single": {},
    "ddp2": {"dp_replicate": 2, "dp_shard": 1},
    "dp4": {"dp_shard": 4},
    "tp2": {"tp": 2, "dp_shard": 1},
    "pp2": {"pp": 2, "dp_shard": 1},
    "pp2_dp2": {"pp": 2, "dp_shard": 2},
    "pp2_tp2": {"pp": 2, "tp": 2, "dp_shard": 1},
    "dpr2_dp2_tp2": {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
    "pp2_tp2_dp2": {"pp": 2, "tp": 2, "dp_shard": 2},
}


def world_of(degrees: dict[str, int]) -> int:
    world = 1
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        world *= max(degrees.get(name, 1), 1)
    return world


def make_module(args: argparse.Namespace, batch_size: int) -> Any:
    from gpt_module import CharGPT

    torch.manual_seed(0)
    return CharGPT(d_model=args.d_model, n_head=args.n_head, n_layer=args.n_layer, block_size=args.block_size,
                   stride=args.block_size, batch_size=batch_size)


def held_bytes(strategy: Any) -> int:
    """Storage behind this rank's parameters and optimizer state, each storage counted once."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for p in strategy.module.parameters():
        add(p)
    for opt in strategy.optimizers:
        for state in opt.state.values():
            for value in state.values():
                add(value)
    return total


def ideal_bytes(args: argparse.Namespace, degrees: dict[str, int], pp_rank: int) -> tuple[float, float]:
    """(this pp rank's ideal, 1/N of the one-device total), from the one-device model."""
    from polytrain.parallel import pipeline_split as S
    from polytrain.parallel.tensor_parallel import resolve_key

    module = make_module(args, 8)
    pp, tp = degrees.get("pp", 1), degrees.get("tp", 1)
    fsdp = degrees.get("dp_shard", 1) * degrees.get("cp", 1)
    sharded_by_fsdp = fsdp > 1 or (tp > 1 and degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1) > 1)
    planned = set()
    if tp > 1:
        for key in module.tensor_parallel_plan():
            for name in resolve_key(module, key):
                planned |= {f"{name}.{n}" for n, _ in module.get_submodule(name).named_parameters()}
    seq = module.net
    children = S.stage_children(seq, S.balance(S.child_costs(seq), pp)) if pp > 1 else [list(seq._modules)]
    mine = {f"net.{c}." for c in children[pp_rank]}
    ideal = 0.0
    whole = 0
    for name, p in module.named_parameters():
        nbytes = 3 * p.numel() * p.element_size()  # parameter + exp_avg + exp_avg_sq
        whole += nbytes
        if any(name.startswith(prefix) for prefix in mine):
            split = (tp if name in planned else 1) * (fsdp if sharded_by_fsdp else 1)
            ideal += nbytes / split
    return ideal, whole / world_of(degrees)


def _worker(rank: int, world_size: int, args: argparse.Namespace, layout: str, run_dir: str) -> dict[str, Any]:
    from polytrain import Trainer

    degrees = LAYOUTS[layout]
    dp = degrees.get("dp_replicate", 1) * max(degrees.get("dp_shard", 1), 1)
    strategy = {"name": "parallel", **degrees} if world_size > 1 else "single"
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      limit_val_batches=0, run_dir=run_dir)
    trainer.fit(make_module(args, args.batch_size // dp))
    s = trainer.strategy
    pp_rank = s.dims.pp_rank if s.dims is not None else 0
    return {"held": held_bytes(s), "pp_rank": pp_rank}


def measure(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    degrees = LAYOUTS[layout]
    world = world_of(degrees)
    with tempfile.TemporaryDirectory() as run_dir:
        if world == 1:
            os.environ.setdefault("WORLD_SIZE", "1")
            ranks = [_worker(0, 1, args, layout, run_dir)]
        else:
            from distributed import run_distributed

            ranks = run_distributed(_worker, world, args, layout, run_dir, timeout=600.0)
    rows = []
    for r in ranks:
        ideal, per_n = ideal_bytes(args, degrees, r["pp_rank"])
        rows.append((r["held"], ideal, per_n))
    worst = max(rows, key=lambda row: row[0] / row[1])
    return {"layout": layout, "world": world, "max": max(r[0] for r in rows), "min": min(r[0] for r in rows),
            "ideal": worst[1], "ratio": worst[0] / worst[1], "per_n": rows[0][2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"GPT d_model={args.d_model} n_layer={args.n_layer}, AdamW: bytes of parameters + optimizer state per rank")
    print(f"{'layout':<14}{'ranks':>6}{'largest KiB':>13}{'smallest KiB':>14}{'ideal KiB':>11}{'ratio':>8}"
          f"{'1/N KiB':>10}")
    ok = True
    for layout in args.layouts:
        row = measure(args, layout)
        ok &= row["ratio"] <= GOAL
        print(f"{row['layout']:<14}{row['world']:>6}{row['max'] / 1024:>13.1f}{row['min'] / 1024:>14.1f}"
              f"{row['ideal'] / 1024:>11.1f}{row['ratio']:>8.3f}{row['per_n'] / 1024:>10.1f}", flush=True)
    print(f"composition memory: every layout within {GOAL:.2f} x its ideal split: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
