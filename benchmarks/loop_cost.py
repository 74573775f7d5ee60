"""CPU time per optimizer step that polytrain adds over a hand-written loop, on a model so small that
the step is almost all loop overhead.

Usage::

    python benchmarks/loop_cost.py                      # 2000 steps, 7 rounds (the first is a warm-up)
    PYTHONPATH=/other/checkout python benchmarks/loop_cost.py   # another copy of polytrain

Both variants train an MLP 8-8-8-10 (batch 4, SGD with momentum) for one epoch of ``--steps`` steps,
draw a tqdm bar, and write the loss and the epoch to TensorBoard every 50 steps; polytrain runs with its
default callbacks (model summary off). The figure is the CPU time of the epoch (``time.process_time``
from epoch start to epoch end), so set-up and the epoch-end checkpoint are left out. Rounds alternate
their order; the median of the rounds after the first is printed. Use it to compare trees, not to
quote absolute times.

``--calls`` counts instead of timing: the Python function calls of one epoch of each variant (cProfile,
from epoch start to epoch end), per step, and how many of polytrain's are in its own files. The count
does not move with the machine's load, so two trees compare on a noisy machine where the times cannot.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer, TrainModule


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(steps * 4, 8, generator=g),
                         torch.randint(0, 4, (steps * 4,), generator=g))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


class Probe(TrainModule):
    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.net, self.data = make_net(), data

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4, shuffle=True)


class EpochCPUTime(Callback):
    def __init__(self, profile: cProfile.Profile | None) -> None:
        self.profile = profile

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.start = time.process_time()
        if self.profile is not None:
            self.profile.enable()

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.profile is not None:
            self.profile.disable()
        self.seconds = time.process_time() - self.start


def polytrain_epoch(data: TensorDataset, run_dir: str, profile: cProfile.Profile | None = None) -> float:
    timer = EpochCPUTime(profile)
    Trainer(strategy="single", accelerator="cpu", max_epochs=1, callbacks=[timer], log_every_n_steps=50,
            run_dir=run_dir, enable_model_summary=False).fit(Probe(data))
    return timer.seconds


def hand_epoch(data: TensorDataset, run_dir: str, profile: cProfile.Profile | None = None) -> float:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm.auto import tqdm

    model = make_net()
    loader = DataLoader(data, batch_size=4, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    writer, step = SummaryWriter(run_dir), 0
    start = time.process_time()
    if profile is not None:
        profile.enable()
    bar = tqdm(file=sys.stdout, dynamic_ncols=True, smoothing=0, total=len(loader))
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0:
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("epoch", 0.0, step)
        bar.update(1)
    bar.close()
    if profile is not None:
        profile.disable()
    seconds = time.process_time() - start
    writer.close()
    return seconds


def calls_per_step(run: object, data: TensorDataset, steps: int) -> tuple[float, float]:
    """Python calls a step of one epoch: all of them, and those in polytrain's own files."""
    import polytrain

    profile = cProfile.Profile()
    with tempfile.TemporaryDirectory() as run_dir:
        run(data, run_dir, profile)  # type: ignore[operator]
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    package = os.path.dirname(polytrain.__file__)
    every = sum(calls for _, calls, *_ in stats.values())
    own = sum(entry[1] for (filename, *_), entry in stats.items() if filename.startswith(package))
    return every / steps, own / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", action="store_true", help="count Python calls per step instead of timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = make_data(args.steps)
    if args.calls:
        stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
        try:
            with tempfile.TemporaryDirectory() as run_dir:
                polytrain_epoch(data, run_dir)  # warm-up: first imports and caches
            ours, own = calls_per_step(polytrain_epoch, data, args.steps)
            hand, _ = calls_per_step(hand_epoch, data, args.steps)
        finally:
            sys.stdout.close()
            sys.stdout = stdout
        import polytrain

        print(f"loop_cost: polytrain {os.path.dirname(polytrain.__file__)}, torch {torch.__version__}")
        print(f"Python calls/step: polytrain {ours:.1f} ({own:.1f} in polytrain's files), hand {hand:.1f}, "
              f"added {ours - hand:.1f}")
        return
    times: dict[str, list[float]] = {"polytrain": [], "hand": []}
    variants = (("polytrain", polytrain_epoch), ("hand", hand_epoch))
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # both bars draw to /dev/null
    try:
        for r in range(args.rounds):
            for name, run in variants if r % 2 == 0 else variants[::-1]:
                with tempfile.TemporaryDirectory() as run_dir:
                    times[name].append(run(data, run_dir) / args.steps * 1e6)
    finally:
        sys.stdout.close()
        sys.stdout = stdout
    ours, hand = statistics.median(times["polytrain"][1:]), statistics.median(times["hand"][1:])
    import polytrain

    print(f"loop_cost: polytrain {os.path.dirname(polytrain.__file__)}, torch {torch.__version__}")
    print(f"CPU us/step: polytrain {ours:.1f}, hand {hand:.1f}, added {ours - hand:.1f} "
          f"(rounds after the warm-up: polytrain {[round(t) for t in times['polytrain'][1:]]}, "
          f"hand {[round(t) for t in times['hand'][1:]]})")


if __name__ == "__main__":
    main()
