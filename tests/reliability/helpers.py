"""Shared pieces of the reliability battery: launching real jobs (torchrun, ``polytrain fit``,
plain per-rank processes), running many of them concurrently with hard deadlines, reading what
the ranks recorded, and reporting each scenario's figure.

Every process a test starts runs in its own session and is killed (its whole process group) at
its deadline, so no scenario can hang the battery.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ports import free_port  # noqa: F401 (the reliability jobs take their ports from here)

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
REPO = HERE.parent.parent
RUN_SCRIPT = SCRIPTS / "run.py"

# Variables a launcher sets; inherited ones would make a child think it already is a worker.
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                  "SLURM_NTASKS", "SLURM_PROCID", "POLYTRAIN_REL_FAULT", "POLYTRAIN_REL_OUT")


def trials(default: int = 1) -> int:
    """Trials per repeated scenario: 1 in the default ``make test`` run, ``POLYTRAIN_RELIABILITY_TRIALS``
    (the summary command sets 5) for the full battery."""
    return max(1, int(os.environ.get("POLYTRAIN_RELIABILITY_TRIALS", default)))


def parallelism() -> int:
    return max(1, int(os.environ.get("POLYTRAIN_RELIABILITY_PARALLEL", "4")))


def rel_module() -> Any:
    """The scripts' ``rel_module`` imported in this process (and, via sys.path, in spawned children)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import rel_module as module

    return module


def quiet(run_dir: str, **kwargs: Any) -> dict[str, Any]:
    """Trainer keywords for a quiet 2-rank DDP run on CPU (what in-process tests start from)."""
    base = dict(strategy="ddp", accelerator="cpu", devices=2, run_dir=run_dir, logger=False,
                enable_progress_bar=False, enable_model_summary=False, timeout=60.0, seed=0)
    return {**base, **kwargs}


def figure(scenario: str, text: str, **data: Any) -> None:
    """Print a scenario's figure and, for the summary command, append it to the report file."""
    print(f"\n[reliability] {scenario}: {text}", flush=True)
    report = os.environ.get("POLYTRAIN_RELIABILITY_REPORT")
    if report:
        with open(report, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"scenario": scenario, "figure": text, **data}) + "\n")


def job_env(fault: str | None = None, out_dir: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("PYTEST_")}
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(SCRIPTS), str(REPO),
                                           env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if fault:
        env["POLYTRAIN_REL_FAULT"] = fault
    if out_dir:
        env["POLYTRAIN_REL_OUT"] = out_dir
    env.update(extra)
    return env


def torchrun(args: Iterable[str], nproc: int = 2, max_restarts: int = 0) -> list[str]:
    # Port 0: the agent binds its rendezvous store to a port the kernel picks, as torchrun --standalone
    # does. A port picked here first can be taken by a job running beside this one before the agent binds
    # it; the agent then connects to that job's socket as a client and times out after 60 s.
    return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", "--nnodes=1", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *map(str, args)]


def run_script_args(out_dir: str | Path, trainer: dict[str, Any], module: dict[str, Any] | None = None,
                    every_n_steps: int = 0, top_k: int = 1) -> list[str]:
    return [str(RUN_SCRIPT), str(out_dir), "--trainer", json.dumps(trainer),
            "--module", json.dumps(module or {}),
            "--every-n-steps", str(every_n_steps), "--top-k", str(top_k)]


def with_small_tmpfs(mount_point: str | Path, cmd: list[str], size: str = "32m") -> list[str] | None:
    """``cmd`` run in a mount namespace of its own where ``mount_point`` is a tmpfs of ``size`` (a file system
    the job can fill without touching the machine's), or None where no mount namespace can be made (as
    root: ``unshare -m``; otherwise a user namespace, ``unshare -rm``)."""
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    try:
        probe = subprocess.run(["unshare", *flags, "sh", "-c",
                                "mount -t tmpfs -o size=1m tmpfs /mnt 2>/dev/null "
                                "|| mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if probe.returncode != 0:
        return None
    os.makedirs(mount_point, exist_ok=True)
    return ["unshare", *flags, "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"',
            str(mount_point), *cmd, "--full-fs", str(mount_point)]


def polytrain_cli(config: str | Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "polytrain", "fit", "--config", str(config), *overrides]


@dataclass
class Job:
    name: str
    cmd: list[str] | None = None  # one process (torchrun, the CLI, a script)
    env: dict[str, str] = field(default_factory=job_env)
    timeout: float = 240.0
    out_dir: str = ""
    ranks: int = 0  # > 0: start `cmd` once per rank with RANK/WORLD_SIZE/MASTER_* set (no agent)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Done:
    job: Job
    returncode: int | list[int]
    stdout: str | list[str]
    stderr: str | list[str]
    seconds: float
    ended_at: float | list[float]  # time.time() when the process (each rank's) exited
    timed_out: bool

    @property
    def output(self) -> str:
        if isinstance(self.stdout, list):
            return "\n".join(o + e for o, e in zip(self.stdout, self.stderr))
        return self.stdout + self.stderr


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (elastic workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """A job past its deadline: SIGTERM first (an agent then stops its workers), then SIGKILL what
    is left of the processes this job started, by id."""
    below = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *below]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _run_one(job: Job) -> Done:
    import tempfile

    if job.out_dir:
        os.makedirs(job.out_dir, exist_ok=True)
    envs = [job.env]
    if job.ranks:
        port = free_port()
        envs = [dict(job.env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(job.ranks),
                     LOCAL_WORLD_SIZE=str(job.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     GROUP_RANK="0")
                for r in range(job.ranks)]
    start = time.time()
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in envs]
    procs = [subprocess.Popen(job.cmd, env=env, cwd=job.out_dir or None, stdout=out, stderr=err, text=True,
                              start_new_session=True) for env, (out, err) in zip(envs, files)]
    ended: list[float | None] = [None] * len(procs)
    timed_out = False
    while any(e is None for e in ended):
        for i, proc in enumerate(procs):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = time.time()
        if time.time() - start > job.timeout:
            timed_out = True
            for i, proc in enumerate(procs):
                if ended[i] is None:
                    _kill_tree(proc)
                    ended[i] = time.time()
        time.sleep(0.05)
    outs, errs = [], []
    for out, err in files:
        out.seek(0)
        err.seek(0)
        outs.append(out.read())
        errs.append(err.read())
        out.close()
        err.close()
    codes = [p.returncode for p in procs]
    seconds = max(ended) - start
    if job.ranks:
        return Done(job, codes, outs, errs, seconds, ended, timed_out)
    return Done(job, codes[0], outs[0], errs[0], seconds, ended[0], timed_out)


def pick(results: dict[str, Done], prefix: str) -> list[Done]:
    """The results whose names start with ``prefix`` (skips the test if that scenario was filtered out)."""
    import pytest

    found = [d for name, d in sorted(results.items()) if name.startswith(prefix)]
    if not found:
        pytest.skip(f"no job named {prefix}* in this run (the default run keeps one CLI elastic trial: "
                    f"POLYTRAIN_RELIABILITY_TRIALS>1 adds it; or POLYTRAIN_RELIABILITY_ONLY filtered it out)")
    return found


def run_jobs(jobs: list[Job], parallel: int | None = None) -> dict[str, Done]:
    """Run jobs concurrently (bounded), each with its own deadline; results by job name."""
    with ThreadPoolExecutor(max_workers=parallel or parallelism()) as pool:
        return {d.job.name: d for d in pool.map(_run_one, jobs)}


# --------------------------------------------------------------------------- what ranks recorded


def events(out_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    path = Path(out_dir) / f"events_rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def samples(out_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    path = Path(out_dir) / f"samples_rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_state(out_dir: str | Path, rank: int = 0) -> dict[str, torch.Tensor] | None:
    path = Path(out_dir) / f"final_rank{rank}.pt"
    if not path.exists():
        return None
    return torch.load(path, weights_only=True)["state"]


def bitwise_equal(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    if a is None or b is None or a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) for k in a)


def snapshot(directory: str | Path) -> dict[str, tuple[int, float]]:
    """Names, sizes and mtimes of everything in a directory (hidden temporaries included)."""
    d = Path(directory)
    if not d.exists():
        return {}
    return {p.name: (p.stat().st_size, p.stat().st_mtime) for p in sorted(d.iterdir())}


def write_config(path: str | Path, run_dir: str | Path, out_dir: str | Path, *, devices: int = 2,
                 max_epochs: int = 2, every_n_steps: int = 2, extra_trainer: dict[str, Any] | None = None,
                 module: dict[str, Any] | None = None) -> Path:
    """A ``polytrain fit`` config for RelModule (imported through PYTHONPATH=scripts/)."""
    import yaml

    trainer = {"accelerator": "cpu", "devices": devices, "strategy": "ddp", "max_epochs": max_epochs,
               "log_every_n_steps": 1, "enable_progress_bar": False, "enable_model_summary": False,
               "logger": False, "timeout": 60, "run_dir": str(run_dir), "resume": "auto", "seed": 0,
               "callbacks": [{"_target_": "polytrain.callbacks.model_checkpoint.ModelCheckpoint",
                              "every_n_train_steps": every_n_steps}],
               **(extra_trainer or {})}
    config = {"module": {"_target_": "rel_module.RelModule", "out_dir": str(out_dir), **(module or {})},
              "trainer": trainer}
    path = Path(path)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
