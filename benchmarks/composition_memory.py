"""Bytes of parameters + optimizer state each rank holds, per composed layout, against the ideal split.

Usage::

    python benchmarks/composition_memory.py                      # every layout below (1 to 8 gloo ranks)
    python benchmarks/composition_memory.py --layouts pp2_tp2 dp4 --n-layer 4 --d-model 128

The model is the GPT example (examples/gpt) at ``--d-model``/``--n-layer``, AdamW, trained two steps
under strategy ``parallel`` with each layout's degrees. Then every rank counts the storage behind what
it holds: each parameter's local tensor (``DTensor.to_local()``; FSDP's padding included) and every
optimizer state tensor, each storage once.

The ideal for a rank is computed from the one-device model alone, not from what the run built: the
parameters of the stage(s) this rank runs (``pipeline_sequential_cut.balance``, as the strategy cuts), each
divided by the ranks that split it (``tp`` for the layers the module's plan names, ``dp_shard x cp``
under FSDP), times three (the parameter, AdamW's ``exp_avg`` and ``exp_avg_sq``); a parameter nobody
splits (outside the plan without FSDP, or under ddp) counts whole: those are the "replicated parts".
Reported per layout: the largest and smallest rank, the ideal of the largest, their ratio (goal:
<= 1.05: FSDP's padding of uneven dimensions and Adam's per-parameter ``step`` scalars are the
slack), and ``1/N`` of the one-device total for comparison.

Against the planner (docs/strategies/planner.md, "Measured against predicted"): every rank also counts
its gradients after the last backward, before the optimizer step (``on_before_optimizer_step``: each
parameter's ``.grad``, local shard under FSDP, plus DDP's gradient buckets, which hold a second copy
when ``gradient_as_bucket_view`` is off, the default), and compares parameters + gradients + optimizer
state with the planner's ``params + grads + optimizer`` for its pipeline stage (``stage_memories`` of
the same degrees, fp32, AdamW). Reported: the rank furthest from its prediction and the ratio
measured / predicted (goal: within 5 %).
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
    "dp8": {"dp_shard": 8},
    "ddp8": {"dp_replicate": 8, "dp_shard": 1},
    "tp2_dp4": {"tp": 2, "dp_shard": 4},
    "pp2_dp4": {"pp": 2, "dp_shard": 4},
    "pp4_dp2": {"pp": 4, "dp_shard": 2},
}
PLANNER_GOAL = 0.05  # |measured / predicted - 1| for parameters + gradients + optimizer state


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


def _ddp_bucket_bytes(strategy: Any) -> int:
    """Bytes of DDP's gradient buckets (a copy of the gradients unless they are bucket views),
    0 without DDP."""
    from torch.nn.parallel import DistributedDataParallel

    owners = [strategy, *(v for v in vars(strategy).values() if hasattr(v, "__dict__"))]
    for value in (v for owner in owners for v in vars(owner).values()):
        if isinstance(value, DistributedDataParallel):
            data = value._get_ddp_logging_data()
            if data.get("gradient_as_bucket_view"):
                return 0
            return sum(int(b) for b in str(data.get("bucket_sizes", "")).split(",") if b.strip())
    return 0


def grad_bytes(strategy: Any) -> int:
    """Storage behind this rank's gradients (local shards), each storage once, plus DDP's buckets."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for p in strategy.module.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values()) + _ddp_bucket_bytes(strategy)


def _grad_probe() -> Any:
    from polytrain import Callback

    class GradProbe(Callback):
        grads = 0

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.grads = grad_bytes(trainer.strategy)

    return GradProbe()


def planner_layout(degrees: dict[str, int]) -> Any:
    """The planner's ``Layout`` of a benchmark layout (``dp_shard`` defaults to what the others leave)."""
    from polytrain.parallel.planner import Layout

    d = {k: max(degrees.get(k, 1), 1) for k in ("dp_replicate", "tp", "pp", "cp")}
    rest = world_of(degrees) // (d["dp_replicate"] * d["tp"] * d["pp"] * d["cp"])
    return Layout(dp_shard=degrees.get("dp_shard", rest), **d)


def predicted_bytes(args: argparse.Namespace, degrees: dict[str, int]) -> list[dict[str, int]]:
    """The planner's memory terms of each pipeline stage for these degrees (fp32, AdamW)."""
    from polytrain.parallel.planner import Training, profiler
    from polytrain.parallel.planner.estimate import stage_memories

    with torch.device("meta"):
        module = make_module(args, args.batch_size)
    x = torch.zeros(1, args.block_size, dtype=torch.long)
    lay = planner_layout(degrees)
    train = Training(global_batch=args.batch_size, precision="32", optimizer="adamw")
    return stage_memories(lay, train, profiler(module, x, x)(lay.tp))


def ideal_bytes(args: argparse.Namespace, degrees: dict[str, int], pp_rank: int) -> tuple[float, float]:
    """(this pp rank's ideal, 1/N of the one-device total), from the one-device model."""
    from polytrain.parallel import pipeline_sequential_cut as S
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


def _worker(rank: int, world_size: int, args: argparse.Namespace, layout: str,
            run_dir: str) -> dict[str, Any]:
    from polytrain import Trainer

    degrees = LAYOUTS[layout]
    dp = degrees.get("dp_replicate", 1) * max(degrees.get("dp_shard", 1), 1)
    strategy = {"name": "parallel", **degrees} if world_size > 1 else "single"
    probe = _grad_probe()
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      limit_val_batches=0, run_dir=run_dir, callbacks=[probe])
    trainer.fit(make_module(args, args.batch_size // dp))
    s = trainer.strategy
    pp_rank = s.dims.pp_rank if s.dims is not None else 0
    return {"held": held_bytes(s), "grads": probe.grads, "pp_rank": pp_rank}


def measure(args: argparse.Namespace, layout: str, timeout: float = 600.0) -> dict[str, Any]:
    degrees = LAYOUTS[layout]
    world = world_of(degrees)
    with tempfile.TemporaryDirectory() as run_dir:
        if world == 1:
            os.environ.setdefault("WORLD_SIZE", "1")
            ranks = [_worker(0, 1, args, layout, run_dir)]
        else:
            from distributed import run_distributed

            ranks = run_distributed(_worker, world, args, layout, run_dir, timeout=timeout)
    rows = []
    for r in ranks:
        ideal, per_n = ideal_bytes(args, degrees, r["pp_rank"])
        rows.append((r["held"], ideal, per_n))
    worst = max(rows, key=lambda row: row[0] / row[1])
    stage = predicted_bytes(args, degrees)
    vs = [(r["held"] + r["grads"], sum(stage[r["pp_rank"]][k] for k in ("params", "grads", "optimizer")))
          for r in ranks]
    far = max(vs, key=lambda v: abs(v[0] / v[1] - 1))
    return {"layout": layout, "world": world, "max": max(r[0] for r in rows), "min": min(r[0] for r in rows),
            "ideal": worst[1], "ratio": worst[0] / worst[1], "per_n": rows[0][2],
            "measured": far[0], "predicted": far[1], "vs_planner": far[0] / far[1]}


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
    print(f"GPT d_model={args.d_model} n_layer={args.n_layer}, AdamW: bytes of parameters + optimizer state "
          "per rank")
    print("  (planner: parameters + gradients + optimizer state of the rank furthest from its prediction)")
    print(f"{'layout':<14}{'ranks':>6}{'largest KiB':>13}{'smallest KiB':>14}{'ideal KiB':>11}{'ratio':>8}"
          f"{'1/N KiB':>10}{'measured KiB':>14}{'planner KiB':>13}{'ratio':>8}")
    ok = planned = True
    for layout in args.layouts:
        row = measure(args, layout)
        ok &= row["ratio"] <= GOAL
        planned &= abs(row["vs_planner"] - 1) <= PLANNER_GOAL
        print(f"{row['layout']:<14}{row['world']:>6}{row['max'] / 1024:>13.1f}{row['min'] / 1024:>14.1f}"
              f"{row['ideal'] / 1024:>11.1f}{row['ratio']:>8.3f}{row['per_n'] / 1024:>10.1f}"
              f"{row['measured'] / 1024:>14.1f}{row['predicted'] / 1024:>13.1f}{row['vs_planner']:>8.3f}",
              flush=True)
    print(f"composition memory: every layout within {GOAL:.2f} x its ideal split: {'yes' if ok else 'NO'}")
    print(f"planner: every layout's parameters + gradients + optimizer state within {PLANNER_GOAL:.0%} of "
          f"measured: {'yes' if planned else 'NO'}")
    return 0 if ok and planned else 1


if __name__ == "__main__":
    raise SystemExit(main())
