"""Fill the file system, or lower the file-size limit, under a checkpoint save; record what every rank saw.

    python disk_fault.py OUT_DIR STRATEGY WORLD_SIZE [--full-fs DIR]

Real faults, nothing mocked: ``enospc`` fills DIR (a small tmpfs the test mounted for this job: only
when --full-fs is given) until the OS says No space left on device, then frees ``HEADROOM`` bytes;
``efbig`` lowers this process's ``RLIMIT_FSIZE`` (Python ignores SIGXFSZ, so writes fail with File too
large). For each fault and each save mode (sync, async) a fit saving every 2 steps meets the fault at
the save of step 4; every rank records the error it raised. The fault is then undone, the checkpoint
directory listed, and the run resumed (``resume: last``) to the end; its weights are compared with a
fit that met no fault. Every rank's record goes to ``OUT_DIR/results.json``. The ranks are forked by
this process (``tests/distributed.py``), so they share the tmpfs mounted in its namespace.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
from rel_module import RelModule  # noqa: E402

from polytrain import Trainer  # noqa: E402
from polytrain.callbacks.base import Callback  # noqa: E402
from polytrain.callbacks.model_checkpoint import ModelCheckpoint  # noqa: E402
from polytrain.checkpoint.layout import damage  # noqa: E402
from polytrain.core.errors import CheckpointError  # noqa: E402

MAX_STEPS = 8
FAULT_STEP = 4
HEADROOM = 16 * 1024  # bytes left free on the full file system: small files still fit, a checkpoint does not
FILE_LIMIT = 32 * 1024  # RLIMIT_FSIZE during the efbig fault; every checkpoint file is larger
FILLER = "filler.bin"


def fill(directory: str) -> None:
    """Write until the file system is full, then give back HEADROOM bytes."""
    path = os.path.join(directory, FILLER)
    with open(path, "wb", buffering=0) as fh:
        for chunk in (1 << 20, 1 << 12, 1):
            block = b"\0" * chunk
            while True:
                try:
                    fh.write(block)
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    break
        fh.truncate(max(0, fh.tell() - HEADROOM))


class Fault(Callback):
    """Listed before ModelCheckpoint: strikes in the batch whose end saves the step-4 checkpoint."""

    def __init__(self, kind: str, failing_rank: int, full_fs: str | None) -> None:
        self.kind, self.failing_rank, self.full_fs = kind, failing_rank, full_fs
        self.struck = False
        self.filled = False  # this rank filled the file system (rank 0): it frees it too

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != FAULT_STEP or self.struck:
            return
        self.struck = True
        # The step-2 save may still be writing in the background (async): the fault is for the next save, so
        # it waits for that one first (every rank calls finish: it agrees on the outcome).
        trainer.strategy.checkpoint_io.finish()
        if self.kind == "enospc" and trainer.global_rank == 0:
            fill(self.full_fs)
            self.filled = True
        if self.kind == "efbig" and trainer.global_rank == self.failing_rank:
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (FILE_LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        trainer.strategy.barrier("fault-in-place")

    def undo(self) -> None:
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        if self.filled:
            os.unlink(os.path.join(self.full_fs, FILLER))


def trainer_for(strategy: str, world: int, run_dir: str, callbacks: list[Any], async_save: bool) -> Trainer:
    return Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=MAX_STEPS, seed=0,
                   run_dir=run_dir, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   timeout=60.0,
                   callbacks=[*callbacks, ModelCheckpoint(every_n_train_steps=2, save_top_k=1,
                                                          async_save=async_save, save_on_fit_end=False)])


def module() -> RelModule:
    return RelModule(n=64, batch_size=4, hidden=4096, dropout=0.0)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.strategy.module_state_dict()  # a collective under sharded strategies
    return {k: v.detach().clone() for k, v in state.items()}


def listing(ckpt_dir: str) -> dict[str, Any]:
    names = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    complete = [n for n in names if not n.startswith(".") and n not in ("latest", "last.ckpt")
                and damage(os.path.join(ckpt_dir, n)) is None]
    return {"names": names, "complete": complete}


def rank_main(rank: int, world: int, out_dir: str, strategy: str, full_fs: str | None) -> dict[str, Any]:
    failing_rank = 1 if world > 1 and strategy == "fsdp" else 0  # ddp: rank 0 writes the only file
    reference = trainer_for(strategy, world, os.path.join(out_dir, "reference"), [], False)
    reference.fit(module())
    expected = weights(reference)

    results: dict[str, Any] = {}
    for kind in ["efbig"] + (["enospc"] if full_fs else []):
        for mode in ("sync", "async"):
            case = f"{kind}-{mode}"
            run_dir = os.path.join(full_fs if kind == "enospc" else out_dir, case)
            fault = Fault(kind, failing_rank, full_fs)
            record: dict[str, Any] = {"error": None}
            try:
                trainer_for(strategy, world, run_dir, [fault], mode == "async").fit(module())
            except CheckpointError as err:
                record["error"] = str(err)
            except BaseException as err:  # noqa: BLE001 - recorded: the test says it is the wrong kind
                record["error"] = f"NOT A CheckpointError: {type(err).__name__}: {err}"
            finally:
                fault.undo()  # before this rank's next fit, whose set-up meets every other rank's
            if rank == 0:
                record["after_fault"] = listing(os.path.join(run_dir, "version_0", "checkpoints"))
            resumed = trainer_for(strategy, world, run_dir, [], False)
            resumed.fit(module(), ckpt_path="last")
            got = weights(resumed)
            record["resumed_to"] = resumed.global_step
            record["bitwise"] = bool(got.keys() == expected.keys()
                                     and all(torch.equal(got[k], expected[k]) for k in got))
            results[case] = record
    return {"rank": rank, "failing_rank": failing_rank, "cases": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("strategy")
    parser.add_argument("world", type=int)
    parser.add_argument("--full-fs", default=None)
    args = parser.parse_args()
    task = (args.out_dir, args.strategy, args.full_fs)
    if args.world == 1:
        results = [rank_main(0, 1, *task)]
    else:
        from tests.distributed import run_distributed

        results = run_distributed(rank_main, args.world, *task, timeout=400.0)
    with open(os.path.join(args.out_dir, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
