"""Activation checkpointing: the memory it saves and the time it costs, through ``Trainer``.

Usage::

    python benchmarks/activation_memory.py                  # GPT, 4 blocks of d 256, seq 256, batch 8 (CPU)
    python benchmarks/activation_memory.py --layers 12 --d-model 768 --seq-len 1024 --device cuda

The model is ``gpt_model.py``'s GPT (the throughput benchmark's). The same run is made three times through
``Trainer`` (AdamW, fp32; bf16-mixed with ``--precision``), with ``activation_checkpointing`` off (false),
full (true) and op (``{mode: op}``), and one training step after the first (optimizer state already
allocated) is measured:

- CPU: the peak of the bytes allocated during that step, from ``torch.profiler``'s memory events
  (``profile_memory=True``: every allocation and free of the CPU allocator, with the running total
  since profiling started, so the figure is what the step adds on top of weights, gradients' first
  allocation and optimizer state);
- CUDA: ``torch.cuda.max_memory_allocated()`` during the step minus what was allocated before it.

The difference from off is the activation memory checkpointing saves: under full the blocks keep only
their inputs and recompute the rest in backward; under op they also keep their odd-numbered matmul
outputs and their attention output (less memory saved, less recompute). Also printed: the step time
ratio to off (the recompute's cost, median of ``--steps`` steps) and the last loss of each run, which
must agree.

Against the planner (``--model example``: the GPT example, examples/gpt, whose ``nn.Sequential`` the
planner profiles; on CPU, or on CUDA as one H100). What each side counts, in that one measured step:

- the example zeroes its gradients in place (``zero_grad(set_to_none=False)``), so they stay allocated
  from step 0 on and backward adds into them: the step's peak holds no gradient (nor optimizer state);
- measured "held": the bytes allocated since the step started, read at ``on_before_backward`` (the end
  of forward): what autograd keeps for backward, plus the loss (the batch was fetched before the step);
  on CUDA ``torch.cuda.memory_allocated()`` there, less what was allocated when the step started;
- measured "peak": the step's peak: what is held at that moment plus backward's transients (the
  incoming gradient of a layer, a new gradient before it is added, the recomputed block under
  checkpointing);
- predicted: the planner's ``activations`` term (``estimate(...).memory`` of ``Layout()`` with
  ``activation_checkpointing`` False, True or "op", the run's precision, the same batch). The goal: within
  20 % of the measured peak, in each of the three modes.

On CUDA the allocator's reserve is printed beside it: ``max_memory_reserved()`` over
``max_memory_allocated()`` in the measured step, both whole (weights and state included): what the caching
allocator holds beyond what tensors use, the part of a published "peak reserved memory" the planner does
not model. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torchtitan's default) changes it.
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

END_OF_FORWARD = "activation_memory.end_of_forward"
GOAL = 0.20  # |predicted / measured peak - 1| for the planner's activation term
# Each mode measured: its ``Trainer(activation_checkpointing=...)`` and its planner
# ``Layout(activation_checkpointing=...)``
MODES: dict[str, tuple[Any, bool | str]] = {"off": (False, False), "full": (True, True),
                                            "op": ({"mode": "op"}, "op")}


def memory_probe(cuda: bool) -> Any:
    """A callback measuring the second training step's peak (and, on CPU, what forward left held) and
    the time of the steps after it."""
    import torch

    from polytrain import Callback

    class Probe(Callback):
        def __init__(self) -> None:
            self.peak = self.held = 0
            self.reserve = 0.0  # CUDA: peak reserved over peak allocated in the measured step
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

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            if cuda and trainer.global_step == 1:
                self.held = torch.cuda.memory_allocated() - self._base
            if self._prof is not None and trainer.global_step == 1:
                with torch.profiler.record_function(END_OF_FORWARD):
                    pass

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            if batch_idx >= 2:
                self.times.append(time.perf_counter() - self._t0)
            if batch_idx != 1:
                return
            if cuda:
                self.peak = torch.cuda.max_memory_allocated() - self._base
                self.reserve = torch.cuda.max_memory_reserved() / torch.cuda.max_memory_allocated()
                return
            self._prof.__exit__(None, None, None)
            with tempfile.NamedTemporaryFile(suffix=".json") as fh:
                self._prof.export_chrome_trace(fh.name)
                events = json.load(open(fh.name, encoding="utf-8"))["traceEvents"]
            self.peak, self.held = peak_and_held(events)

    return Probe()


def measure(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from polytrain import Trainer

    module = build_module(args)
    probe = memory_probe(args.device == "cuda")
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(strategy="single", accelerator=args.device, precision=args.precision,
                          max_steps=args.steps + 2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          log_every_n_steps=args.steps + 2, run_dir=run_dir, callbacks=[probe],
                          activation_checkpointing=MODES[mode][0])
        trainer.fit(module)
    return {"peak": probe.peak, "held": probe.held, "step": statistics.median(probe.times),
            "loss": float(trainer.logged_metrics["train/loss"]), "reserve": probe.reserve}


def peak_and_held(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(peak bytes, bytes at the end-of-forward mark) of the tensors allocated during the profile, from a
    chrome trace.

    Summed from each allocation and free (``Bytes``, ``Addr``): the profiler's own running total
    ("Total Allocated") is process-wide and carries what an earlier profile allocated and kept. A kernel's
    own scratch space (allocated by the kernel itself, not by an operator it calls, and freed before it
    returns) is left out: the planner models tensors, and a kernel's scratch depends on the machine's
    kernels (oneDNN's backward of ConvNeXt-T's 7x7 depthwise convolution takes a 38.5 MB scratchpad at
    batch 8 on an AVX-512 AMD EPYC and none on other CPUs)."""
    mark = min((e["ts"] for e in events if e.get("name") == END_OF_FORWARD), default=None)
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    scratch = kernel_scratch(memory, [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"])
    alive: dict[int, int] = {}
    current = peak = held = 0
    for i, e in enumerate(memory):
        size, addr = e["args"]["Bytes"], e["args"]["Addr"]
        if size > 0:
            alive[addr] = 0 if i in scratch else size
            current += alive[addr]
        else:
            current -= alive.pop(addr, 0)
        peak = max(peak, current)
        held = current if mark is not None and e["ts"] <= mark else held
    return peak, held


def kernel_scratch(memory: list[dict[str, Any]], ops: list[dict[str, Any]]) -> set[int]:
    """Indices (into ``memory``, sorted by time) of the allocations freed before the innermost operator
    that was running on their thread when they were made returns. An operator's outputs outlive it, and a
    tensor an operator makes through another (``aten::empty``) has that one as its innermost: what is left
    is the kernel's own scratch."""
    pending = sorted(ops, key=lambda o: o["ts"])
    open_ends: dict[Any, list[float]] = {}  # per thread: the ends of the operators open there, innermost last
    next_op = 0
    made: dict[int, tuple[int, float]] = {}  # address -> (index, end of its innermost operator)
    scratch = set()
    for i, e in enumerate(memory):
        ts, addr = e["ts"], e["args"]["Addr"]
        while next_op < len(pending) and pending[next_op]["ts"] <= ts:
            op = pending[next_op]
            ends = open_ends.setdefault(op.get("tid"), [])
            while ends and ends[-1] < op["ts"]:  # operators of one thread nest: these ended before it began
                ends.pop()
            ends.append(op["ts"] + op["dur"])
            next_op += 1
        ends = open_ends.get(e.get("tid"), [])
        while ends and ends[-1] < ts:
            ends.pop()
        if e["args"]["Bytes"] > 0:
            made[addr] = (i, ends[-1] if ends else float("-inf"))
        elif addr in made:
            index, end = made.pop(addr)
            if ts <= end:
                scratch.add(index)
    return scratch


def build_module(args: argparse.Namespace) -> Any:
    """The benchmark's GPT on random tokens, or (``--model example``) the GPT example on its corpus."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    if args.model == "example":
        return example_module(args)
    module = M.build(args.shape, fused=args.device == "cuda")
    g = torch.Generator().manual_seed(1234)
    n = (args.steps + 2) * args.batch_size
    tokens = torch.randint(0, args.shape.vocab, (n, args.shape.seq + 1), generator=g)
    module.loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    return module


def example_module(args: argparse.Namespace, meta: bool = False) -> Any:
    """The GPT example at the benchmark's shape; its gradients are zeroed in place, never released."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "gpt"))
    from gpt_module import CharGPT

    class KeptGradients(CharGPT):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=False)

    with torch.device("meta" if meta else "cpu"):
        return KeptGradients(d_model=args.d_model, n_head=args.heads, n_layer=args.layers,
                             block_size=args.seq_len, stride=8, batch_size=args.batch_size)


def predicted(args: argparse.Namespace, mode: str) -> tuple[int, int]:
    """The planner's activation bytes for the example at ``args``' shape on one rank of the run's device
    (AdamW, the run's precision): what forward leaves for backward, and the step's peak above the state
    (activations + transients)."""
    import torch

    from polytrain.parallel.planner import Layout, Training, estimate, hardware, profiler

    module = example_module(args, meta=True)
    x = torch.zeros(1, args.seq_len, dtype=torch.long)
    cuda = args.device == "cuda"
    # torch's Adam steps every parameter at once on CUDA (foreach), one at a time on CPU
    train = Training(global_batch=args.batch_size, precision=args.precision, optimizer="adamw", foreach=cuda)
    # F.scaled_dot_product_attention without dropout runs a fused kernel on both devices (flash on CPU, fp32
    # too; flash or memory-efficient on CUDA): each saves q, k, v, the output and the log-sum-exp, not the
    # attention matrix, as the planner's "flash" trace counts.
    est = estimate(Layout(activation_checkpointing=MODES[mode][1]), train,
                   profiler(module, x, x, attention="flash", precision=args.precision,
                            device="cuda" if cuda else "cpu")(1),
                   hardware("h100" if cuda else "cpu", 1, 1))
    return est.memory["activations"], est.memory["activations"] + est.memory["transients"]


def compare_with_planner(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> bool:
    """Print the planner's activation term against each mode's measured figures; True if all meet GOAL."""
    mb, ok = 2 ** 20, True
    for mode, run in runs.items():
        held, guess = predicted(args, mode)
        ok &= abs(guess / run["peak"] - 1) <= GOAL
        print(f"planner, checkpointing {mode}: predicted activations {held / mb:.2f} MB, with the step's "
              f"transients {guess / mb:.2f} MB; measured held at end of forward {run['held'] / mb:.2f} MB, "
              f"peak {run['peak'] / mb:.2f} MB (ratio {guess / run['peak']:.3f}, goal within {GOAL:.0%})",
              flush=True)
    print(f"planner: activations and transients within {GOAL:.0%} of the measured peak, checkpointing "
          f"{', '.join(runs)}: "
          f"{'yes' if ok else 'NO'}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("32", "bf16-mixed", "bf16-true"), default="32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="steps timed after the measured one")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", choices=("bench", "example"), default="bench",
                   help="bench: gpt_model.py's GPT; example: examples/gpt's, with the planner's "
                        "prediction")
    args = p.parse_args(argv)
    import torch

    import polytrain

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.shape = M.Shape(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    params = sum(p.numel() for p in build_module(args).parameters())
    how = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "torch.profiler memory events"
    print(f"activation_memory: polytrain {polytrain.__version__}, GPT L={args.layers} d={args.d_model} "
          f"T={args.seq_len} batch {args.batch_size} ({params / 1e6:.1f}M params), "
          f"{args.device} {args.precision}, "
          f"torch {torch.__version__}; peak allocated during one training step ({how})", flush=True)
    runs = {mode: measure(args, mode) for mode in MODES}
    mb = 2 ** 20
    for mode, run in runs.items():
        reserve = f", reserved {run['reserve']:.3f}x allocated at peak" if run["reserve"] else ""
        print(f"checkpointing {mode}: {run['peak'] / mb:.1f} MB, {run['step'] * 1e3:.1f} ms/step{reserve}",
              flush=True)
    ok = compare_with_planner(args, runs) if args.model == "example" else True
    off, full, op = runs["off"], runs["full"], runs["op"]
    print(f"memory: {full['peak'] / off['peak']:.3f} of off "
          f"({(off['peak'] - full['peak']) / mb:.1f} MB saved); "
          f"step time: {full['step'] / off['step']:.3f} of off; "
          f"last loss off {off['loss']:.6f} on {full['loss']:.6f}",
          flush=True)
    print(f"memory, mode op: {op['peak'] / off['peak']:.3f} of off "
          f"({(off['peak'] - op['peak']) / mb:.1f} MB saved); "
          f"step time: {op['step'] / off['step']:.3f} of off; "
          f"last loss off {off['loss']:.6f} op {op['loss']:.6f}",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
