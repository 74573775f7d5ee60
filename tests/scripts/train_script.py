"""Train TinyRegressor with ``Trainer(...).fit`` and write this process's result as JSON.

    python train_script.py OUT_DIR [--devices N] [--launcher auto|spawn|elastic] [--fail-rank R]
                                   [--num-nodes N] [--max-epochs E] [--batch-size B]

Run unchanged under torchrun, under SLURM-style variables, or plainly (then ``devices>1`` makes the
Trainer start its own workers). Every process that trains writes ``OUT_DIR/rank{R}.json``; with
``--launcher spawn`` the launching process also writes ``OUT_DIR/parent.json`` with the weights
its module holds after ``fit`` returned.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from tiny_module import TinyRegressor, weights  # noqa: E402

from polytrain import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--launcher", default="auto")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    devices = args.devices if args.devices == "auto" else int(args.devices)

    torch.manual_seed(0)
    module = TinyRegressor(batch_size=args.batch_size, fail_rank=args.fail_rank)
    initial = weights(module)
    trainer = Trainer(accelerator="cpu", devices=devices, num_nodes=args.num_nodes, launcher=args.launcher,
                      max_epochs=args.max_epochs, run_dir=os.path.join(args.out_dir, "run"), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                      timeout=60.0)
    trainer.fit(module)

    if trainer.strategy is None:  # launched workers trained; this process only holds their result
        result = {"role": "parent", "pid": os.getpid(), "initial": initial, "weights": weights(module),
                  "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
        name = "parent.json"
    else:
        strategy = trainer.strategy
        result = {"role": "worker", "pid": os.getpid(), "rank": trainer.global_rank,
                  "world_size": trainer.world_size, "local_rank": strategy.local_rank,
                  "strategy": strategy.name, "env_source": strategy.env.source,
                  "global_step": trainer.global_step, "initial": initial, "weights": weights(module),
                  "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
        name = f"rank{trainer.global_rank}.json"
        strategy.teardown()
    tmp = os.path.join(args.out_dir, f".{name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, os.path.join(args.out_dir, name))


if __name__ == "__main__":
    main()
