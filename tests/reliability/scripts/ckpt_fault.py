"""Interrupt a checkpoint write on purpose (single process, ``every_n_train_steps=1``).

    python ckpt_fault.py RUN_DIR MODE SAVE_NUMBER [--top-k K] [--max-steps N]

Patches, in this throwaway process only, what ``polytrain.checkpoint.replicated.atomic_save``
calls, and on the SAVE_NUMBER-th checkpoint write (1-based):

- ``mid_write``      writes half of the serialized bytes to the temporary file, fsyncs, SIGKILLs itself
- ``before_rename``  SIGKILLs itself after the temporary file is complete, before ``os.replace``
- ``after_rename``   SIGKILLs itself right after ``os.replace``, before the ``latest`` pointer moves
- ``enospc``         the write raises ``OSError(ENOSPC)``: the job must stop with a CheckpointError
                     and retention must not have deleted the last complete checkpoint
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from rel_module import RelModule  # noqa: E402

from polytrain import Trainer  # noqa: E402
from polytrain.callbacks.model_checkpoint import ModelCheckpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("mode", choices=["mid_write", "before_rename", "after_rename", "enospc"])
    parser.add_argument("save_number", type=int)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=8)
    args = parser.parse_args()

    saves = {"n": 0}
    real_save, real_replace = torch.save, os.replace

    def save(obj, f, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not hasattr(f, "write"):
            return real_save(obj, f, *a, **kw)
        saves["n"] += 1
        if saves["n"] != args.save_number:
            return real_save(obj, f, *a, **kw)
        if args.mode == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if args.mode == "mid_write":
            buffer = io.BytesIO()
            real_save(obj, buffer, *a, **kw)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *a, **kw)

    def replace(src, dst, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        is_ckpt = os.path.basename(str(src)).startswith(".tmp-")
        if is_ckpt and saves["n"] == args.save_number and args.mode == "before_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        result = real_replace(src, dst, *a, **kw)
        if is_ckpt and saves["n"] == args.save_number and args.mode == "after_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    torch.save = save
    os.replace = replace
    trainer = Trainer(strategy="single", accelerator="cpu", devices=1, max_steps=args.max_steps, seed=0,
                      run_dir=args.run_dir, logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=args.top_k,
                                                 save_on_fit_end=False)])
    trainer.fit(RelModule(n=32, batch_size=4))


if __name__ == "__main__":
    main()
