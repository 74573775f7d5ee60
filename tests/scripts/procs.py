"""Running launch commands as a user would, in subprocesses that can never outlive their deadline.

Each command starts in its own session; at its deadline (or once it has exited) the whole process
group it leads is killed, so a hung worker of a torchrun/elastic job cannot survive the test.

Known upstream flake, retried once (with a warning) and nothing else: torch's DDP keeps the gloo
process group's C++ worker threads alive after ``destroy_process_group()``; when one of them drops
its last reference to a finished collective while the interpreter is already finalizing, it needs
the GIL, is terminated by Python, and the process aborts with "terminate called without an active
exception" (SIGABRT) after the job has done all its work. It shows up under heavy CPU load, about
once in 40 processes here. See pytorch/pytorch#179291 for the same abort without DDP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ports import free_port  # noqa: F401 (the launch tests take their ports from here)

SCRIPTS = Path(__file__).resolve().parent
TRAIN_SCRIPT = SCRIPTS / "train_script.py"
TINY_CONFIG = SCRIPTS / "tiny.yaml"
POLYTRAIN = [sys.executable, "-m", "polytrain"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Inherited launcher variables would make a child believe it already is a worker of some job.
_STRIP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
          "MASTER_ADDR", "MASTER_PORT", "POLYTRAIN_TEST_RECORD_DIR")
_STRIP_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PET_")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith(_STRIP_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@dataclass
class Finished:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    started: float
    ended: float

    @property
    def elapsed(self) -> float:
        return self.ended - self.started

    def describe(self) -> str:
        return (f"$ {' '.join(self.cmd)}\nexit code {self.returncode} after {self.elapsed:.1f}s\n"
                f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}")


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def start(cmd: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
          interruptible: bool = False) -> tuple:
    """``interruptible``: SIGINT does what it does in a terminal (KeyboardInterrupt), also where this test
    run ignores it, as a shell's background jobs do and their children inherit."""
    restore = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if interruptible else None
    proc = subprocess.Popen([str(c) for c in cmd], env=env if env is not None else child_env(), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=restore)
    return proc, time.time()


def finish(started: tuple, deadline: float) -> Finished:
    """Wait for a started command until ``deadline`` (a ``time.time()`` value); kill it if it is late."""
    proc, t0 = started
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        done = Finished(list(map(str, proc.args)), proc.returncode, out, err, t0, time.time())
        raise AssertionError(f"did not finish within {deadline - t0:.0f}s, killed:\n"
                             f"{done.describe()}") from None
    ended = time.time()
    _kill_group(proc)  # a worker orphaned by its launcher must not outlive the test
    return Finished(list(map(str, proc.args)), proc.returncode, out, err, t0, ended)


EXIT_ABORT = "terminate called without an active exception"


def _exit_abort(results: list[Finished]) -> bool:
    return any(r.returncode != 0 for r in results) and any(EXIT_ABORT in r.stderr for r in results)


def _attempts(launch: Callable[[], list[Finished]], retry: bool, before_retry: Callable[[], None] | None
              ) -> list[Finished]:
    results = launch()
    if retry and _exit_abort(results):
        warnings.warn(f"a worker aborted at interpreter exit ({EXIT_ABORT!r}, the known torch/gloo "
                      f"shutdown race); running the launch once more:\n"
                      + "\n".join(r.describe() for r in results),
                      stacklevel=3)
        if before_retry is not None:
            before_retry()
        results = launch()
    return results


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        retry_exit_abort: bool = True, before_retry: Callable[[], None] | None = None) -> Finished:
    """Run one command to completion within ``timeout`` seconds (per attempt)."""
    return _attempts(lambda: [finish(start(cmd, env, cwd), time.time() + timeout)], retry_exit_abort,
                     before_retry)[0]


def run_together(make_cmds: Callable[[], list[tuple[list[str], dict[str, str]]]], timeout: float,
                 retry_exit_abort: bool = True,
                 before_retry: Callable[[], None] | None = None) -> list[Finished]:
    """Start every command ``make_cmds()`` returns at once (the ranks or nodes of one job), then wait for
    all of them. ``make_cmds`` is called again for a retry, so it can pick a fresh port."""

    def launch() -> list[Finished]:
        started = [start(cmd, env) for cmd, env in make_cmds()]
        deadline = time.time() + timeout
        results = []
        try:
            for item in started:
                results.append(finish(item, deadline))
        finally:
            for proc, _ in started:
                _kill_group(proc)
        return results

    return _attempts(launch, retry_exit_abort, before_retry)


def read_records(out_dir: str | os.PathLike, tag: str = "fit") -> dict[int, dict]:
    """``{rank: record}`` for every ``<tag>-rank<R>.json`` the TinyRegressor ranks wrote."""
    records = {}
    for path in Path(out_dir).glob(f"{tag}-rank*.json"):
        data = json.loads(path.read_text())
        records[data["rank"]] = data
    return records


def reference_weights(epochs: int = 2, global_batch: int = 16, lr: float = 0.05) -> list[float]:
    """A plain single-process PyTorch loop over the same global batches: what every parallel run of
    TinyRegressor (n=64, shuffle off, batch 8 per rank on 2 ranks) must end with."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import torch
    import torch.nn.functional as F
    from tiny_module import TinyRegressor, make_dataset, weights

    torch.manual_seed(0)
    module = TinyRegressor()
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    x, y = make_dataset(64).tensors
    for _ in range(epochs):
        for i in range(0, len(x), global_batch):
            loss = F.mse_loss(module(x[i:i + global_batch]), y[i:i + global_batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return weights(module)
