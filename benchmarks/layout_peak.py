"""The planner's per-rank peak against real gloo ranks, layout by layout: Hugging Face Llama (GQA) and GPT-2,
torchvision's ResNet-50 (one Bottleneck a stage), under fsdp 2, fsdp 2 with per-op activation checkpointing,
fsdp 2 x tp 2 (Llama: its own tensor-parallel plan) and two pipeline stages.

Usage::

    python benchmarks/layout_peak.py                          # hidden 256, 4 layers, vocabulary 2048
    python benchmarks/layout_peak.py --hidden 512 --seq-len 256

What is compared, on every rank:

- measured: the most bytes the CPU allocator holds during the third training step's forward and backward
  (``on_train_batch_start`` to ``on_before_optimizer_step``) above what it held when the step started, from
  ``torch.profiler``'s memory events (``activation_memory.peak_and_held``: each allocation and free, a
  kernel's own scratch space left out). Gradients are zeroed in place (``zero_grad(set_to_none=False)``),
  so they exist before the step and backward adds into them; SGD has no state;
- predicted: the planner's ``activations + fsdp_buffers + transients`` of that rank's pipeline stage
  (``estimate.stage_memories`` of the layout, the profile ``polytrain plan`` takes: ``step_profiler`` on
  the loader's batch).

The goal: every rank within ``GOAL`` of its measured peak. Each layout is one ``Trainer.fit`` of 3 steps on
the ranks of one spawn (2 processes; 4 for fsdp 2 x tp 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

GOAL = 0.25  # |predicted / measured - 1| on every rank
MEASURED_STEP = 2  # the third: the first two allocate what stays (gradients, buffers, caches)


@dataclass(frozen=True)
class Case:
    model: str  # llama, gpt2, resnet50
    layout: str  # fsdp2, fsdp2_op, fsdp2_tp2, pp2

    @property
    def world(self) -> int:
        return 4 if self.layout == "fsdp2_tp2" else 2

    def strategy(self) -> dict[str, Any]:
        return {"fsdp2": {"name": "parallel", "dp_shard": 2}, "fsdp2_op": {"name": "parallel", "dp_shard": 2},
                "fsdp2_tp2": {"name": "parallel", "dp_shard": 2, "tp": 2},
                "pp2": {"name": "parallel", "pp": 2, "n_microbatches": 2}}[self.layout]

    @property
    def checkpointing(self) -> Any:
        return {"mode": "op"} if self.layout == "fsdp2_op" else None


CASES = [Case("llama", "fsdp2"), Case("llama", "fsdp2_op"), Case("llama", "fsdp2_tp2"), Case("llama", "pp2"),
         Case("gpt2", "fsdp2"), Case("gpt2", "fsdp2_op"), Case("gpt2", "pp2"),
         Case("resnet50", "fsdp2"), Case("resnet50", "pp2")]


def build_model(kind: str, args: argparse.Namespace) -> Any:
    if kind == "resnet50":
        from torchvision.models.resnet import Bottleneck, ResNet

        return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10)
    import transformers

    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers,
            n_head=8, loss_type="ForCausalLM"))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.seq_len))


def module_class() -> Any:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain import TrainModule

    class Held(TrainModule):
        """A library model held as one attribute, its gradients zeroed in place."""

        def __init__(self, kind: str, args: argparse.Namespace) -> None:
            super().__init__()
            self.kind, self.args = kind, args
            self.model = build_model(kind, args)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.kind == "resnet50":
                images, labels = batch
                return F.cross_entropy(self.model(images), labels)
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=False)

        def train_dataloader(self) -> DataLoader:
            rows, gen = 8 * self.args.batch_size, torch.Generator().manual_seed(0)
            if self.kind == "resnet50":
                data = TensorDataset(torch.randn(rows, 3, 32, 32, generator=gen),
                                     torch.randint(0, 10, (rows,), generator=gen))
            else:
                tokens = torch.randint(0, self.args.vocab, (rows, self.args.seq_len), generator=gen)
                data = TensorDataset(tokens)
            return DataLoader(data, batch_size=self.args.batch_size)

    return Held


def peak_probe() -> Any:
    import activation_memory
    import torch

    from polytrain import Callback

    class Probe(Callback):
        """The measured step's peak above its start, from the profiler's memory events."""

        def __init__(self) -> None:
            self.peak = 0
            self._profile: Any = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == MEASURED_STEP and self._profile is None:
                self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                       profile_memory=True)
                self._profile.__enter__()

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if trainer.global_step != MEASURED_STEP or self._profile is None or self.peak:
                return
            self._profile.__exit__(None, None, None)
            with tempfile.NamedTemporaryFile(suffix=".json") as fh:
                self._profile.export_chrome_trace(fh.name)
                with open(fh.name, encoding="utf-8") as read:
                    events = json.load(read)["traceEvents"]
            self.peak, _ = activation_memory.peak_and_held(events)

    return Probe()


def run_cases(rank: int, world: int, cases: list[Case], args: argparse.Namespace) -> dict[str, int]:
    """On one rank of a spawn: each case's fit, and this rank's measured peak."""
    from polytrain import Trainer

    Held, peaks = module_class(), {}
    for case in cases:
        probe = peak_probe()
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(strategy=case.strategy(), accelerator="cpu", devices=world,
                              max_steps=MEASURED_STEP + 1, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                              run_dir=run_dir, callbacks=[probe], activation_checkpointing=case.checkpointing,
                              seed=0)
            trainer.fit(Held(case.model, args))
        peaks[f"{case.model} {case.layout}"] = probe.peak
    return peaks


def predicted(case: Case, args: argparse.Namespace) -> list[int]:
    """The planner's activations + fsdp_buffers + transients of each pipeline stage."""
    import torch

    from polytrain.parallel.planner import Layout, Training
    from polytrain.parallel.planner.estimate import stage_memories
    from polytrain.trainer.launch.planned import first_batch, step_profiler

    with torch.device("meta"):
        module = module_class()(case.model, args)
    spec = case.strategy()
    layout = Layout(dp_shard=spec.get("dp_shard", 1), tp=spec.get("tp", 1), pp=spec.get("pp", 1),
                    n_microbatches=spec.get("n_microbatches", 1),
                    activation_checkpointing="op" if case.checkpointing else False)
    train = Training(global_batch=args.batch_size * layout.dp, precision="32", optimizer="sgd", foreach=False)
    profile = step_profiler(module, first_batch(module.train_dataloader()), "cpu", None, "32", "cpu")
    return [m["activations"] + m["fsdp_buffers"] + m["transients"]
            for m in stage_memories(layout, train, profile(layout.tp))]


def measure(cases: list[Case], args: argparse.Namespace, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Every case's per-rank measured peak, predicted peak and their ratio (one spawn per world size)."""
    from distributed import run_distributed

    rows = []
    for world in sorted({c.world for c in cases}):
        here = [c for c in cases if c.world == world]
        ranks = run_distributed(run_cases, world, here, args, timeout=timeout)
        for case in here:
            stages = predicted(case, args)
            pp = case.strategy().get("pp", 1)
            for rank, peaks in enumerate(ranks):
                stage = rank // (world // pp) if pp > 1 else 0  # pp is the outermost mesh dimension
                measured = peaks[f"{case.model} {case.layout}"]
                rows.append({"model": case.model, "layout": case.layout, "rank": rank, "stage": stage,
                             "measured": measured, "predicted": stages[stage],
                             "ratio": stages[stage] / measured})
    return rows


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="per data-parallel rank")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    rows = measure(CASES, args)
    print(f"hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, sequences of "
          f"{args.seq_len}, batch {args.batch_size} a rank; ResNet-50 on 32x32 pictures")
    print(f"{'model':<10}{'layout':<11}{'rank':>5}{'stage':>6}{'measured MB':>13}{'predicted MB':>14}"
          f"{'ratio':>7}")
    for r in rows:
        print(f"{r['model']:<10}{r['layout']:<11}{r['rank']:>5}{r['stage']:>6}{r['measured'] / 1e6:>13.2f}"
              f"{r['predicted'] / 1e6:>14.2f}{r['ratio']:>7.3f}")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    met = abs(worst["ratio"] - 1) <= GOAL
    print(f"furthest: {worst['model']} {worst['layout']} rank {worst['rank']} at {worst['ratio']:.3f} "
          f"(goal: within {GOAL:.0%}): {'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
