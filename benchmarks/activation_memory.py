"""Activation checkpointing: the memory it saves and the time it costs, through ``Trainer``.

Usage::

    python benchmarks/activation_memory.py                  # GPT, 4 blocks of d 256, seq 256, batch 8 (CPU)
    python benchmarks/activation_memory.py --layers 12 --d-model 768 --seq-len 1024 --device cuda

The model is ``gpt_model.py``'s GPT (the throughput benchmark's). The same run is made twice through ``Trainer`` (AdamW,
fp32; bf16-mixed with ``--precision``), with ``activation_checkpointing`` off and on, and one
training step after the first (optimizer state already allocated) is measured:

- CPU: the peak of the bytes allocated during that step, from ``torch.profiler``'s memory events
  (``profile_memory=True``: every allocation and free of the CPU allocator, with the running total
  since profiling started, so the figure is what the step adds on top of weights, gradients' first
  allocation and optimizer state);
- CUDA: ``torch.cuda.max_memory_allocated()`` during the step minus what was allocated before it.

The difference is the activation memory checkpointing saves: the blocks keep only their inputs
and recompute the rest in backward. Also printed: the step time ratio (the recompute's cost,
median of ``--steps`` steps) and the last loss of each run, which must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt_model as M  # noqa: E402 - the same GPT as the throughput benchmark


def measure(args: argparse.Namespace, checkpointing: bool) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain import Callback, Trainer

    cuda = args.device == "cuda"

    class Probe(Callback):
        def __init__(self) -> None:
            self.peak = 0
            self.times: list[float] = []
            self._prof: Any = None
            self._base = 0
            self._t0 = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            if batch_idx == 1:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    self._base = torch.cuda.memory_allocated()
                else:
                    self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                        profile_memory=True)
                    self._prof.__enter__()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            if batch_idx >= 2:
                self.times.append(time.perf_counter() - self._t0)
            if batch_idx != 1:
                return
            if cuda:
                self.peak = torch.cuda.max_memory_allocated() - self._base
                return
            self._prof.__exit__(None, None, None)
            with tempfile.NamedTemporaryFile(suffix=".json") as fh:
                self._prof.export_chrome_trace(fh.name)
                events = json.load(open(fh.name, encoding="utf-8"))["traceEvents"]
            self.peak = max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"),
                            default=0)

    torch.manual_seed(0)
    module = M.build(args.shape, fused=args.device == "cuda")
    g = torch.Generator().manual_seed(1234)
    n = (args.steps + 2) * args.batch_size
    tokens = torch.randint(0, args.shape.vocab, (n, args.shape.seq + 1), generator=g)
    module.loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    probe = Probe()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(strategy="single", accelerator=args.device, precision=args.precision,
                          max_steps=args.steps + 2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          log_every_n_steps=args.steps + 2, run_dir=run_dir, callbacks=[probe],
                          activation_checkpointing=checkpointing)
        trainer.fit(module)
    return {"peak": probe.peak, "step": statistics.median(probe.times),
            "loss": trainer.logged_metrics["train/loss"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="steps timed after the measured one")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import torch

    import polytrain

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.shape = M.Shape(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    params = sum(p.numel() for p in M.build(args.shape, fused=args.device == "cuda").parameters())
    how = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "torch.profiler memory events"
    print(f"activation_memory: polytrain {polytrain.__version__}, GPT L={args.layers} d={args.d_model} "
          f"T={args.seq_len} batch {args.batch_size} ({params / 1e6:.1f}M params), {args.device} {args.precision}, "
          f"torch {torch.__version__}; peak allocated during one training step ({how})", flush=True)
    off, on = measure(args, False), measure(args, True)
    mb = 2 ** 20
    print(f"checkpointing off: {off['peak'] / mb:.1f} MB, {off['step'] * 1e3:.1f} ms/step", flush=True)
    print(f"checkpointing on: {on['peak'] / mb:.1f} MB, {on['step'] * 1e3:.1f} ms/step", flush=True)
    print(f"memory: {on['peak'] / off['peak']:.3f} of off ({(off['peak'] - on['peak']) / mb:.1f} MB saved); "
          f"step time: {on['step'] / off['step']:.3f} of off; last loss off {off['loss']:.6f} on {on['loss']:.6f}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
