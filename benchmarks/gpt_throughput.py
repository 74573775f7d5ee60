"""GPT-2-small training throughput: polytrain against a hand-written loop doing the same work.

Usage::

    python benchmarks/gpt_throughput.py                      # GPT-2 small (124M), seq 1024, on the GPU
    python benchmarks/gpt_throughput.py --tiny               # a tiny GPT for CPU (CI's smoke test runs this)
    python benchmarks/gpt_throughput.py --strategies single,ddp,fsdp --compile both --rounds 5
    python benchmarks/gpt_throughput.py --compile on --float8 both   # bf16 against float8, and the planner

The model: 12 layers, d 768, 12 heads, seq 1024, vocab 50304 (GPT-2's 50257 padded to a multiple of
64), learned positions, pre-norm blocks, ``F.scaled_dot_product_attention`` (causal), GELU MLP, the LM
head tied to the token embedding: 124M parameters. ``--tiny``: 2 layers, d 64, 4 heads, seq 64,
vocab 512. Synthetic tokens (seeded), AdamW (fused on CUDA), bf16 autocast where the device
supports it (``--precision``), a DataLoader (pinned memory and 2 workers on CUDA).

What "the same work" means: both variants build the same module from the same seed, read the same
batches in the same order (``DistributedSampler(shuffle=False)`` over the data-parallel ranks: what
polytrain injects), run the same ``training_step`` code (forward, cross-entropy, ``self.log`` of the
loss / nothing), ``backward``, ``step``, ``zero_grad(set_to_none=True)``; and compile the same
regions: the module's ``forward`` for single and ddp (compiled before DDP wraps it, so DDPOptimizer
splits it at bucket boundaries in both), each transformer block before ``fully_shard`` for fsdp.
The hand loop reads the loss on the host (``.item()``) only on logging steps (every
``--log-every``), as polytrain does; polytrain runs with logger, progress bar, checkpoints and
model summary off (GPU-NOTES.md's set-up). Both end with the same last loss (printed).

``--float8 on|both``: polytrain with ``trainer.float8: true`` and the hand loop converting the same
Linear layers (``polytrain.parallel.float8.linears_to_convert``: every block Linear, not the tied head)
with torchao before compiling and sharding. With ``both``, each variant also runs without float8, and a
last line gives polytrain's float8 / bf16 step-time ratio beside the planner's prediction for the same
layout on the device's preset (h100 for an H100 or H200; none on CPU, where float8 is emulated).

Timing: from the start of step ``--warmup`` (compilation, allocator warm-up and the first logging
step are before it) to the end of the last step, with ``torch.cuda.synchronize()`` at both ends on
CUDA. Rounds run in pairs whose order alternates (P H, H P, ...), each a fresh model; reported are
the medians over rounds and the median per-pair ratio polytrain / hand.

MFU: model FLOPs per token = 6 N + 12 L d T (N: parameters without the position embedding; the
second term is attention's score and value matmuls, forward and backward, without the causal
saving), times tokens per second per device, over the device's dense peak for the precision: H100
SXM 989.4 TFLOP/s bf16 (494.7 tf32, 66.9 fp32), H100 PCIe 756 bf16, H200 989.4 bf16, A100 312 bf16
(156 tf32, 19.5 fp32). A CPU has no peak figure we can justify (it depends on the vector units,
cores in use and clocks), so MFU prints "n/a" there, as it does for an unknown GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_model as M  # noqa: E402 - the model, shared with activation_memory.py
from local_ranks import export_rank, first_result  # noqa: E402 - beside this script

# dense peak FLOP/s per device: (name fragment, {precision: peak})
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H200", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
)


# --------------------------------------------------------------------------- runs


def dataset(args: argparse.Namespace, world: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1234)
    n = (args.warmup + args.steps) * args.batch_size * world
    tokens = torch.randint(0, args.shape.vocab, (n, args.shape.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def loader(args: argparse.Namespace, ds: Any, sampler: Any = None) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(ds, batch_size=args.batch_size, shuffle=False, sampler=sampler,
                      num_workers=args.workers, pin_memory=args.device == "cuda", persistent_workers=False)


def build(args: argparse.Namespace) -> Any:
    return M.build(args.shape, fused=args.device == "cuda")


def _sync(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()


def run_polytrain(args: argparse.Namespace, ds: Any, strategy: str, compiled: bool, run_dir: str,
                  float8: bool = False) -> dict[str, Any]:
    from polytrain import Callback, Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = self.c0 = self.c1 = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == args.warmup:
                _sync(args)
                self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if batch_idx == args.warmup + args.steps - 1:
                _sync(args)
                self.t1, self.c1 = time.perf_counter(), time.process_time()

    module = build(args)
    module.loader = loader(args, ds)
    clock = Clock()
    spec: Any = strategy if strategy != "fsdp" else {"name": "fsdp", "wrap_modules": ["Block"]}
    trainer = Trainer(strategy=spec, accelerator=args.device, devices=args.world, precision=args.precision,
                      max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      log_every_n_steps=args.log_every, run_dir=run_dir, callbacks=[clock],
                      compile={"backend": args.compile_backend} if compiled else False, float8=float8)
    trainer.fit(module)
    return {"seconds": clock.t1 - clock.t0, "cpu": clock.c1 - clock.c0,
            # the last step's value (Lightning's logged_metrics)
            "loss": float(trainer.logged_metrics["train/loss"])}


def run_hand(args: argparse.Namespace, ds: Any, strategy: str, compiled: bool,
             float8: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    model = build(args)
    if float8:  # the layers polytrain converts, before compile and sharding (as polytrain orders them)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from polytrain.parallel.float8 import linears_to_convert, resolve_float8

        chosen = set(linears_to_convert(model, resolve_float8(True))[0])
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda _m, name: name in chosen)
    device = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
              else torch.device("cpu"))
    model.to(device)
    world, rank = (dist.get_world_size(), dist.get_rank()) if args.world > 1 else (1, 0)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(args.device, (world,))
        if args.precision == "bf16-mixed":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                             cast_forward_inputs=False)
        else:
            mp_policy = MixedPrecisionPolicy()
        for block in model.blocks:
            if compiled:  # the block's forward, so FSDP's hooks stay outside the graph
                block.forward = torch.compile(block.forward, backend=args.compile_backend)
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=None)
        step_model = model
    else:
        if compiled:
            model.compile(backend=args.compile_backend)
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        ) if strategy == "ddp" else model
    optimizer = M.make_optimizer(model.parameters(), model.lr, args.device == "cuda")
    data = loader(args, ds, DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False))
    if args.precision == "bf16-mixed":
        autocast = torch.autocast(args.device, dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext()
    t0 = t1 = c0 = c1 = 0.0
    last_loss = None
    for i, (x, y) in enumerate(data):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if i == args.warmup:
            _sync(args)
            t0, c0 = time.perf_counter(), time.process_time()
        with autocast:
            loss = (step_model.loss((x, y)) if strategy != "ddp"
                    else _ddp_loss(step_model, x, y, model.shape.vocab))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last_loss = loss.detach()
        if (i + 1) % args.log_every == 0:
            loss.item()  # the only host read, on logging steps (as polytrain)
        if i == args.warmup + args.steps - 1:
            _sync(args)
            t1, c1 = time.perf_counter(), time.process_time()
    return {"seconds": t1 - t0, "cpu": c1 - c0,
            "loss": float(last_loss) if last_loss is not None else float("nan")}


def _ddp_loss(ddp: Any, x: Any, y: Any, vocab: int) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(ddp(x).view(-1, vocab).float(), y.view(-1))


def run_pairs(args: argparse.Namespace, strategy: str, compiled: bool,
              float8: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    ds = dataset(args, args.world)
    base = tempfile.mkdtemp(prefix="polytrain-gpt-")
    out: dict[str, list[float]] = {"poly": [], "hand": [], "poly_cpu": [], "hand_cpu": [], "poly_loss": [],
                                   "hand_loss": []}
    for pair in range(args.rounds):
        order = ("poly", "hand") if pair % 2 == 0 else ("hand", "poly")
        for which in order:
            if args.world > 1:
                dist.barrier()
            if which == "poly":
                result = run_polytrain(args, ds, strategy, compiled, os.path.join(base, f"{pair}"), float8)
            else:
                result = run_hand(args, ds, strategy, compiled, float8)
            out[which].append(result["seconds"])
            out[which + "_cpu"].append(result["cpu"])
            out[which + "_loss"].append(result["loss"])
    return out


def report(args: argparse.Namespace, label: str, out: dict[str, Any], flops_per_token: float) -> str:
    ms = {k: statistics.median(out[k]) * 1e3 / args.steps for k in ("poly", "hand")}
    ratios = [p / h for p, h in zip(out["poly"], out["hand"])]
    cpu_ratio = statistics.median(p / h for p, h in zip(out["poly_cpu"], out["hand_cpu"]))
    tokens = args.batch_size * args.shape.seq * args.world  # per optimizer step, all ranks

    def rate(k: str) -> str:
        return f"{tokens / (ms[k] / 1e3) / 1e3:.1f}k tok/s"

    def mfu(k: str) -> str:
        if args.peak is None:
            return "n/a"
        return f"{flops_per_token * tokens / (ms[k] / 1e3) / (args.peak * args.world) * 100:.1f}%"

    lines = [
        f"{label}: polytrain {ms['poly']:.2f} ms/step {rate('poly')} MFU {mfu('poly')}, "
        f"hand {ms['hand']:.2f} ms/step "
        f"{rate('hand')} MFU {mfu('hand')}, ratio {statistics.median(ratios):.3f}",
        f"{label}:   per-pair ratios {' '.join(f'{r:.3f}' for r in ratios)}; CPU-time ratio {cpu_ratio:.3f}; "
        f"last loss polytrain {out['poly_loss'][-1]:.6f} hand {out['hand_loss'][-1]:.6f}",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- processes


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, plan: list[tuple[str, bool, bool]],
            results: Any) -> None:
    export_rank(rank, world, port)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(args.threads)
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        # polytrain's strategies join this group instead of creating their own.
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
        outs = [(strategy, compiled, float8, run_pairs(args, strategy, compiled, float8))
                for strategy, compiled, float8 in plan]
        if rank == 0:
            results.put(("ok", outs))
    except BaseException:  # noqa: BLE001 - shown by the parent
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_multi(args: argparse.Namespace, plan: list[tuple[str, bool, bool]]
              ) -> list[tuple[str, bool, bool, dict[str, Any]]]:
    return first_result(_worker, args.world, (args, plan), args.timeout)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny GPT (CPU, CI) instead of GPT-2 small")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--strategies", default="single", help="comma-separated: single, ddp, fsdp (2 processes)")
    p.add_argument("--compile", choices=("off", "on", "both"), default="both")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (aot_eager: no codegen)")
    p.add_argument("--precision", choices=("auto", "32", "bf16-mixed"), default="auto",
                   help="auto: bf16-mixed on GPUs that support it, 32 on CPU")
    p.add_argument("--batch-size", type=int, default=None, help="per process; default 16 (GPT-2), 8 (tiny)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per round; default 40 (GPT-2), 20 (tiny)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first; default 10 (GPT-2), 4 (tiny)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per variant (pairs P H, H P, ...)")
    p.add_argument("--log-every", type=int, default=10,
                   help="log_every_n_steps / hand loop's .item() cadence")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers; default 2 on CUDA, 0 on CPU")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds before a multi-process run is abandoned")
    p.add_argument("--float8", choices=("off", "on", "both"), default="off",
                   help="trainer.float8 (and torchao in the hand loop); both: with and without, and the "
                        "ratio")
    args = p.parse_args(argv)
    return args


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = M.TINY if args.tiny else M.FULL
    if args.seq_len:
        shape = M.Shape(shape.vocab, shape.d, shape.layers, shape.heads, args.seq_len)
    args.shape = shape
    args.batch_size = args.batch_size or (8 if args.tiny else 16)
    args.steps = args.steps or (20 if args.tiny else 40)
    args.warmup = args.warmup if args.warmup is not None else (4 if args.tiny else 10)
    args.warmup = max(args.warmup, 2)  # compilation (forward, then backward) stays out of the timed steps
    args.workers = args.workers if args.workers is not None else (2 if args.device == "cuda" else 0)
    if args.precision == "auto":
        args.precision = "bf16-mixed" if args.device == "cuda" and torch.cuda.is_bf16_supported() else "32"
    args.peak, args.peak_note = device_peak(args)
    return args


def device_peak(args: argparse.Namespace) -> tuple[float | None, str]:
    import torch

    if args.device != "cuda":
        return None, "CPU: no justified peak, MFU n/a"
    name = torch.cuda.get_device_name()
    kind = "bf16" if args.precision == "bf16-mixed" else (
        "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32")
    for fragment, peaks in PEAKS:
        if fragment in name:
            return peaks[kind], f"{name}: peak {peaks[kind] / 1e12:.1f} TFLOP/s dense {kind}"
    return None, f"{name}: peak unknown, MFU n/a"


def main(argv: list[str] | None = None) -> int:
    args = resolve(parse_args(argv))
    import torch

    import polytrain

    torch.set_num_threads(args.threads)
    flops = M.model_flops_per_token(build(args), args.shape)
    n_params = sum(p.numel() for p in build(args).parameters())
    s = args.shape
    print(f"gpt_throughput: polytrain {polytrain.__version__} ({os.path.dirname(polytrain.__file__)}), "
          f"{'tiny' if args.tiny else 'GPT-2 small'} L={s.layers} d={s.d} heads={s.heads} "
          f"T={s.seq} V={s.vocab} "
          f"({n_params / 1e6:.1f}M params, {flops / 1e6:.2f} MFLOP/token), batch {args.batch_size}/process, "
          f"{args.steps} timed steps after {args.warmup}, {args.rounds} rounds, "
          f"{args.device} {args.precision}, "
          f"torch {torch.__version__}; {args.peak_note}", flush=True)
    variants = [c for c in ((False, True) if args.compile == "both" else ((args.compile == "on"),))]
    strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
    unknown = sorted(set(strategies) - {"single", "ddp", "fsdp"})
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; valid: single, ddp, fsdp")
    tag = {False: "eager", True: f"compiled ({args.compile_backend})" if args.compile_backend != "inductor"
           else "compiled"}
    float8s = {"off": (False,), "on": (True,), "both": (False, True)}[args.float8]
    label = {False: "", True: " float8"}
    measured: dict[tuple[str, bool, bool], float] = {}
    if "single" in strategies:
        args.world = 1
        for compiled in variants:
            for float8 in float8s:
                out = run_pairs(args, "single", compiled, float8)
                measured["single", compiled, float8] = statistics.median(out["poly"])
                print(report(args, f"single {tag[compiled]}{label[float8]}", out, flops), flush=True)
    multi = [(st, c, f8) for st in strategies if st != "single" for c in variants for f8 in float8s]
    if multi:
        args.world = 2
        if args.device == "cuda" and torch.cuda.device_count() < 2:
            print(f"ddp/fsdp x2: skipped ({torch.cuda.device_count()} GPU visible, 2 needed)", flush=True)
        else:
            for strategy, compiled, float8, out in run_multi(args, multi):
                measured[strategy, compiled, float8] = statistics.median(out["poly"])
                print(report(args, f"{strategy} x2 {tag[compiled]}{label[float8]}", out, flops), flush=True)
    if args.float8 == "both":
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        for (strategy, compiled, float8), seconds in measured.items():
            if float8 and (strategy, compiled, False) in measured:
                ratio = seconds / measured[strategy, compiled, False]
                print(f"float8 / {args.precision} step time, {strategy} {tag[compiled]}: measured "
                      f"{ratio:.3f} (polytrain); "
                      f"{predicted_float8_ratio(args, strategy, device_name)}", flush=True)
    return 0


def predicted_float8_ratio(args: argparse.Namespace, strategy: str, device_name: str) -> str:
    """The planner's float8 / bf16 step-time ratio for the layout the strategy runs, on the preset of the
    device named (the H200 computes as the H100; its faster memory is not in the step-time model)."""
    import torch

    from polytrain.parallel.planner import Layout, Training, estimate, hardware, profiler

    world = 1 if strategy == "single" else 2
    preset = "h100" if "H100" in device_name or "H200" in device_name else None
    if preset is None:
        return f"planner: none ({device_name} has no fp8 preset; float8 is emulated on CPU)"
    with torch.device("meta"):
        model = build(args)
    x = torch.zeros(1, args.shape.seq, dtype=torch.long)
    layout = Layout(dp_shard=world) if strategy == "fsdp" else Layout(dp_replicate=world)
    profile = profiler(model, x, x, precision=args.precision, device="cuda")(1)
    hw = hardware(preset, 1, world)
    steps = [estimate(layout, Training(global_batch=args.batch_size * world, precision=args.precision,
                                       float8=float8), profile, hw).step_time for float8 in (False, True)]
    return f"planner ({preset}, {layout.label()}, no compile): {steps[1] / steps[0]:.3f}"


if __name__ == "__main__":
    sys.exit(main())
