"""Train TinyRegressor with ``Trainer(...).fit`` as a user script would.

    python train_script.py OUT_DIR [--devices N|auto] [--num-nodes N] [--launcher auto|spawn|fork|elastic]
                                   [--fail-rank R] [--max-epochs E] [--timeout S] [--step-sleep S]

Runs unchanged under torchrun, under SLURM's variables, or plainly (then ``devices>1`` makes the
Trainer start its own workers). Every process that trains writes ``OUT_DIR/fit-rank<R>.json`` (see
``tiny_module``); a process whose ``fit`` returned without training itself (``launcher: spawn``)
writes ``OUT_DIR/parent.json`` with the weights its module holds afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from tiny_module import TinyRegressor, weights, write_json  # noqa: E402

from polytrain import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--launcher", default="auto")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each training step sleeps")
    args = parser.parse_args()

    torch.manual_seed(0)
    module = TinyRegressor(fail_rank=args.fail_rank, record_dir=args.out_dir, step_sleep=args.step_sleep)
    initial = weights(module)
    trainer = Trainer(accelerator="cpu",
                      devices=args.devices if args.devices == "auto" else int(args.devices),
                      num_nodes=args.num_nodes, launcher=args.launcher, strategy=args.strategy,
                      max_epochs=args.max_epochs,
                      run_dir=os.path.join(args.out_dir, "run"), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, log_every_n_steps=args.log_every, timeout=args.timeout)
    trainer.fit(module)
    if trainer.strategy is None:  # workers trained; this process holds what they handed back
        write_json(os.path.join(args.out_dir, "parent.json"),
                   {"pid": os.getpid(), "initial": initial, "weights": weights(module),
                    "finished": trainer.state.finished,
                    "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}})
    else:
        trainer.strategy.teardown()


if __name__ == "__main__":
    main()
