"""Train ``RelModule`` with ``Trainer(...).fit``, as a user's script would.

    python run.py OUT_DIR [--trainer JSON] [--module JSON] [--every-n-steps N] [--top-k K]

Runs unchanged under ``torchrun`` (then each worker trains), plainly with ``devices > 1`` (the
Trainer starts its own workers: elastic, or ``launcher: spawn``), or as one process. ``@record``
puts a failing worker's traceback in the elastic agent's failure summary. Faults: see
``rel_module`` (``POLYTRAIN_REL_FAULT``). ``RelModule`` writes what each rank did under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rel_module import RelModule  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from polytrain import Trainer  # noqa: E402
from polytrain.callbacks.model_checkpoint import ModelCheckpoint  # noqa: E402


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--trainer", default="{}", help="Trainer keywords as JSON")
    parser.add_argument("--module", default="{}", help="RelModule keywords as JSON")
    parser.add_argument("--every-n-steps", type=int, default=0, help="ModelCheckpoint every_n_train_steps")
    parser.add_argument("--top-k", type=int, default=1)
    args = parser.parse_args()

    kwargs = dict(accelerator="cpu", run_dir=os.path.join(args.out_dir, "run"), logger=False,
                  enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, timeout=60.0,
                  seed=0)
    kwargs.update(json.loads(args.trainer))
    callbacks = []
    if args.every_n_steps:
        callbacks.append(ModelCheckpoint(every_n_train_steps=args.every_n_steps, save_top_k=args.top_k))
    module = RelModule(**{"out_dir": args.out_dir, **json.loads(args.module)})
    Trainer(callbacks=callbacks, **kwargs).fit(module)


if __name__ == "__main__":
    main()
