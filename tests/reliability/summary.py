"""Run the whole reliability battery and print one line per scenario with its figure.

    python -m tests.reliability.summary [--trials N] [--parallel P] [pytest args...]

Defaults to 5 trials of every repeated scenario (elastic restarts killing rank 0 and rank 1 under
torchrun and ``polytrain fit``, writers killed mid-checkpoint). ``make reliability`` runs this.
Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--parallel", type=int,
                        default=int(os.environ.get("POLYTRAIN_RELIABILITY_PARALLEL", 4)))
    args, pytest_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        env = dict(os.environ, POLYTRAIN_RELIABILITY_TRIALS=str(args.trials),
                   POLYTRAIN_RELIABILITY_PARALLEL=str(args.parallel),
                   POLYTRAIN_RELIABILITY_REPORT=str(report))
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE),
                               *pytest_args], cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.time() - start
        lines = [json.loads(x) for x in report.read_text().splitlines()] if report.exists() else []
    tail = [x for x in proc.stdout.splitlines() if x.strip()]
    result = tail[-1] if tail else f"pytest exited {proc.returncode}"
    width = max((len(x["scenario"]) for x in lines), default=0)
    print(f"reliability battery: {args.trials} trial(s) per repeated scenario, "
          f"{args.parallel} jobs at a time")
    for x in lines:
        print(f"  {x['scenario']:<{width}}  {x['figure']}")
    print(f"pytest: {result} ({seconds:.0f}s)")
    if proc.returncode != 0:
        failed = [x for x in proc.stdout.splitlines() if x.startswith(("FAILED", "ERROR"))]
        print("\n".join(failed) or proc.stdout[-4000:] + proc.stderr[-2000:])
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
