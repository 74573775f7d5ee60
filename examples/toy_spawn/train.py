"""Train the toy model on 2 CPU processes started with torch.multiprocessing.spawn.

    python examples/toy_spawn/train.py [--epochs 5] [--devices 2]

``launcher="spawn"`` is the notebook-friendly way in: the Trainer spawns the worker processes
itself, trains with DDP in them, and copies rank 0's trained weights back into ``model`` in this
(parent) process when ``fit`` returns. Run the script itself with plain ``python``, not torchrun.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # find toy_module from any directory

from toy_module import ToyModel  # noqa: E402

from polytrain import Trainer, seed_everything  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/toy_spawn")
    args = parser.parse_args()

    seed_everything(0)  # the same initial weights on every run
    model = ToyModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    print(f"parent: loss before training = {model.full_loss():.4f}", flush=True)

    trainer = Trainer(strategy="ddp", devices=args.devices, accelerator="cpu", launcher="spawn",
                      max_epochs=args.epochs, log_every_n_steps=1, run_dir=args.run_dir,
                      enable_progress_bar=False, enable_checkpointing=False, logger=False)
    trainer.fit(model)  # returns in the parent once every spawned worker has finished

    changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    print(f"workers: last logged train/loss = {float(trainer.callback_metrics['train/loss']):.4f}",
          flush=True)
    print(f"parent: loss after training = {model.full_loss():.4f}", flush=True)
    print(f"parent: received trained weights = {changed}", flush=True)


if __name__ == "__main__":  # required: spawned workers import this file again
    main()
