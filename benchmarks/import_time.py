"""How long ``import polytrain`` takes on top of ``import torch`` (target: <= 0.3 s extra).

Usage::

    python benchmarks/import_time.py            # 7 fresh interpreters
    python benchmarks/import_time.py --runs 15

Each run is a fresh ``python`` subprocess (nothing cached in ``sys.modules``; the OS file cache
is warm after the first) that times, with ``time.perf_counter`` inside the process:

1. ``import torch``
2. then ``import polytrain``                      (the package: lazy, should cost ~nothing)
3. then ``polytrain.Trainer``                      (first attribute access: the trainer, loops, config)
4. then ``Trainer(logger=False, ...)``            (first construction: config validation with OmegaConf,
                                                    the default callbacks)

Reported: the median of each step over the runs; the extra of 2+3 over ``import torch``
against the target (the verdict line); the same comparison as whole ``python -c`` processes
(interpreter start-up included, so noisier); and which heavy optional modules (tensorboard,
tqdm, omegaconf, yaml, numpy) step 3 loads -- tensorboard and tqdm must only load when a
logger writes or a bar is drawn (torch itself already imports tqdm and numpy, so only modules
that were not loaded after ``import torch`` count).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TARGET_S = 0.3
HEAVY = ("tensorboard", "torch.utils.tensorboard", "tqdm", "omegaconf", "yaml", "numpy")

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
before = set(sys.modules)
import polytrain
t2 = time.perf_counter()
polytrain.Trainer
t3 = time.perf_counter()
heavy = [m for m in HEAVY if m in sys.modules and m not in before]
polytrain.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, accelerator="cpu")
t4 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "package": t2 - t1, "trainer": t3 - t2, "construct": t4 - t3,
                  "heavy": heavy}))
"""


def one_run() -> dict:
    code = f"HEAVY = {HEAVY!r}\n" + _CHILD
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def process_seconds(code: str) -> float:
    """Wall time of a whole ``python -c code`` process, interpreter start-up included."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=7, help="fresh interpreters (the first one is a warm-up)")
    args = p.parse_args(argv)
    one_run()  # warm the OS file cache
    runs, whole = [], {"torch": [], "polytrain": []}
    for _ in range(max(1, args.runs)):
        runs.append(one_run())
        whole["torch"].append(process_seconds("import torch"))
        whole["polytrain"].append(process_seconds("import torch, polytrain; polytrain.Trainer"))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    extra = statistics.median(r["package"] + r["trainer"] for r in runs)
    verdict = "ok" if extra <= TARGET_S else "ABOVE TARGET"
    print(f"import time over {len(runs)} fresh interpreters (median):")
    print(f"  import torch                 {med('torch'):.3f} s")
    print(f"  + import polytrain           {med('package') * 1e3:.1f} ms")
    print(f"  + polytrain.Trainer          {med('trainer') * 1e3:.1f} ms")
    print(f"  + first Trainer(...)         {med('construct') * 1e3:.1f} ms  "
          "(config validation, default callbacks)")
    t_whole, p_whole = statistics.median(whole["torch"]), statistics.median(whole["polytrain"])
    print(f"  whole processes: python -c 'import torch' {t_whole:.3f} s, "
          f"python -c 'import torch, polytrain; polytrain.Trainer' {p_whole:.3f} s "
          f"({p_whole - t_whole:+.3f} s)")
    print(f"import: polytrain over torch {extra:.3f} s, ratio {(med('torch') + extra) / med('torch'):.3f} "
          f"(target <= {TARGET_S} s extra) {verdict}")
    newly = ", ".join(runs[-1]["heavy"]) or "none"
    print(f"  heavy modules loaded by polytrain.Trainer beyond torch's own: {newly} "
          f"(watched: {', '.join(HEAVY)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
