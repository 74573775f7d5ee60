"""The battery's subprocess scenarios, started together once per session.

Starting a process that imports torch costs seconds on a loaded 2-core machine, and most
scenarios spend their time waiting (for a restart, a timeout, a peer). So every scenario that
needs its own launcher (torchrun, ``polytrain fit``, ``launcher: spawn``, plain per-rank
processes, a writer killed mid-checkpoint) is defined here and the first test that asks for
``jobs`` runs them all concurrently (``POLYTRAIN_RELIABILITY_PARALLEL``, default 4), each with its
own deadline. Tests then only inspect results. ``POLYTRAIN_RELIABILITY_TRIALS`` sets how many
trials the repeated scenarios get (default 1; the summary command uses 5).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from .helpers import (
    SCRIPTS,
    Done,
    Job,
    job_env,
    polytrain_cli,
    run_jobs,
    run_script_args,
    torchrun,
    trials,
    with_small_tmpfs,
    write_config,
)

# Every elastic scenario: 2 ranks of DDP, 32 samples, batch 4 -> 4 steps per epoch, 2 epochs.
ELASTIC_TRAINER = dict(devices=2, strategy="ddp", max_epochs=2, resume="auto")
KILL_STEP = 5  # killed in training_step once 5 optimizer steps are done; the newest checkpoint is step 4
FAIL_STEP = 3  # the deliberate exception / the stuck rank
STUCK_TIMEOUT = 10.0  # trainer.timeout for the stuck-rank scenario
CKPT_KILL_MODES = ("mid_write", "before_rename", "after_rename")
DISK_FAULT_STRATEGIES = (("single", 1), ("ddp", 2), ("fsdp", 2))


def build_jobs(root: Path) -> list[Job]:
    n = trials()
    jobs: list[Job] = []

    def add(name: str, cmd: list[str], env: dict[str, str], out: Path, timeout: float = 300.0,
            **kw: Any) -> None:
        jobs.append(Job(name, cmd, env, timeout, str(out), **kw))

    # 1. elastic restarts: the uninterrupted reference, then kills of rank 0 and rank 1
    ref = root / "elastic-reference"
    add("elastic/reference", torchrun(run_script_args(ref, ELASTIC_TRAINER, every_n_steps=2)), job_env(), ref)
    for rank in (0, 1):
        for t in range(n):
            out = root / f"elastic-torchrun-rank{rank}-{t}"
            add(f"elastic/torchrun/rank{rank}/{t}",
                torchrun(run_script_args(out, ELASTIC_TRAINER, every_n_steps=2), max_restarts=2),
                job_env(fault=f"kill:{rank}:{KILL_STEP}"), out, meta={"rank": rank})
            if rank == 0 and n == 1:
                continue  # the default run keeps one CLI trial (rank 1); the full battery kills both
            out = root / f"elastic-cli-rank{rank}-{t}"
            config = out / "config.yaml"
            out.mkdir(parents=True, exist_ok=True)
            write_config(config, out / "run", out, extra_trainer={"max_restarts": 2})
            add(f"elastic/cli/rank{rank}/{t}", polytrain_cli(config),
                job_env(fault=f"kill:{rank}:{KILL_STEP}"), out, meta={"rank": rank})

    # 2. one rank fails -> all stop (torchrun, polytrain fit, launcher: spawn, plain processes)
    slow_timeout = dict(ELASTIC_TRAINER, timeout=300.0)  # prompt exit must not come from a collective timeout
    fault = f"raise:1:{FAIL_STEP}"
    out = root / "fail-torchrun"
    add("fail/torchrun", torchrun(run_script_args(out, slow_timeout, every_n_steps=2)), job_env(fault=fault),
        out)
    out = root / "fail-cli"
    out.mkdir(parents=True, exist_ok=True)
    write_config(out / "config.yaml", out / "run", out, extra_trainer={"timeout": 300})
    add("fail/cli", polytrain_cli(out / "config.yaml"), job_env(fault=fault), out)
    out = root / "fail-spawn"
    add("fail/spawn",
        [sys.executable, *run_script_args(out, dict(slow_timeout, launcher="spawn"), every_n_steps=2)],
        job_env(fault=fault), out)
    out = root / "fail-plain"
    add("fail/plain", [sys.executable, *run_script_args(out, slow_timeout, every_n_steps=2)],
        job_env(fault=fault), out, ranks=2)
    # a rank stuck outside any collective
    out = root / "stuck-torchrun"
    add("stuck/torchrun", torchrun(run_script_args(out, dict(ELASTIC_TRAINER, timeout=STUCK_TIMEOUT),
                                                   every_n_steps=2)),
        job_env(fault=f"sleep:1:{FAIL_STEP}"), out, timeout=150.0)

    # 4. checkpoint integrity: unwritable destinations (2 plain ranks), a writer killed mid-save
    out = root / "unwritable-run-dir"
    out.mkdir(parents=True, exist_ok=True)
    (out / "regular-file").write_text("not a directory\n")
    add("unwritable/run_dir", [sys.executable, *run_script_args(out, dict(ELASTIC_TRAINER, run_dir=str(
        out / "regular-file" / "run")), every_n_steps=2)], job_env(), out, ranks=2, timeout=150.0)
    out = root / "unwritable-ckpt-dir"
    (out / "run" / "version_0").mkdir(parents=True, exist_ok=True)
    (out / "run" / "version_0" / "checkpoints").write_text(
        "a regular file where the checkpoint directory should be\n")
    add("unwritable/checkpoints",
        [sys.executable, *run_script_args(out, dict(ELASTIC_TRAINER, version=0), every_n_steps=2)],
        job_env(),
        out, ranks=2, timeout=150.0)
    for t in range(n):
        for i, mode in enumerate(CKPT_KILL_MODES):
            save_number = 2 + (t + i) % 5  # steps 2..6, varied across trials
            out = root / f"ckpt-{mode}-{t}"
            add(f"ckpt/{mode}/{t}", [sys.executable, str(SCRIPTS / "ckpt_fault.py"), str(out / "run"), mode,
                                     str(save_number)], job_env(), out, timeout=150.0,
                meta={"save_number": save_number, "mode": mode})
    out = root / "ckpt-enospc"
    add("ckpt/enospc", [sys.executable, str(SCRIPTS / "ckpt_fault.py"), str(out / "run"), "enospc", "4"],
        job_env(), out, timeout=150.0, meta={"save_number": 4})

    # 4b. a full file system and a file-size limit under sync and async saves (single, ddp x2, fsdp x2)
    for strategy, world in DISK_FAULT_STRATEGIES:
        out = root / f"disk-{strategy}"
        out.mkdir(parents=True, exist_ok=True)
        script = [sys.executable, str(SCRIPTS / "disk_fault.py"), str(out), strategy, str(world)]
        wrapped = with_small_tmpfs(out / "full-fs", script)
        add(f"disk/{strategy}", wrapped or script, job_env(), out, timeout=400.0,
            meta={"strategy": strategy, "world": world, "full_fs": wrapped is not None})

    # 7. the CLI refuses a bad config before any worker starts (devices=2 would start two)
    for i, (override, key) in enumerate([("trainer.max_epoch=3", "max_epoch"),
                                          ("trainer.strategy.bucket_cap_mb=lots", "bucket_cap_mb")]):
        out = root / f"config-cli-{i}"
        out.mkdir(parents=True, exist_ok=True)
        write_config(out / "config.yaml", out / "run", out)
        add(f"config/cli/{key}", polytrain_cli(out / "config.yaml", override), job_env(), out, timeout=120.0,
            meta={"key": key})
    return jobs


# Which scenarios each test module inspects: a partial run (one file, -k) starts only those.
JOB_PREFIXES = {"test_elastic": ("elastic/",), "test_failures": ("fail/", "stuck/"),
                "test_checkpoints": ("unwritable/", "ckpt/"), "test_config_safety": ("config/",),
                "test_disk_faults": ("disk/",)}
_background: dict[str, Any] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that only inspect job results run last, so the in-process scenarios (run_distributed)
    overlap with the subprocess jobs, which start in the background as the session begins."""
    needing = [item for item in items if "jobs" in getattr(item, "fixturenames", ())]
    prefixes = {p for item in needing for p in JOB_PREFIXES.get(item.module.__name__.rsplit(".", 1)[-1], ())}
    config._reliability_job_prefixes = prefixes  # type: ignore[attr-defined]
    items[:] = [i for i in items if i not in needing] + needing


@pytest.fixture(scope="session", autouse=True)
def _start_jobs_early(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    prefixes = getattr(request.config, "_reliability_job_prefixes", set())
    if not prefixes:
        yield
        return
    import threading

    root = tmp_path_factory.mktemp("reliability-jobs")
    only = os.environ.get("POLYTRAIN_RELIABILITY_ONLY")  # development: a comma-separated name filter
    selected = [j for j in build_jobs(root) if j.name.startswith(tuple(prefixes))
                and (not only or any(o in j.name for o in only.split(",")))]

    def run() -> None:
        try:
            _background["results"] = run_jobs(selected)
        except BaseException as err:  # noqa: BLE001 - re-raised by the jobs fixture
            _background["error"] = err

    thread = threading.Thread(target=run, name="reliability-jobs", daemon=True)
    _background["thread"] = thread
    thread.start()
    yield
    thread.join(timeout=1)


@pytest.fixture(scope="session")
def jobs() -> dict[str, Done]:
    thread = _background.get("thread")
    if thread is None:
        pytest.skip("no subprocess scenarios were scheduled for this run")
    thread.join()  # every job has its own deadline, so this ends
    if "error" in _background:
        raise _background["error"]
    results = _background["results"]
    for name, done in sorted(results.items()):
        print(f"[reliability] job {name}: rc={done.returncode} in {done.seconds:.1f}s"
              f"{' (TIMED OUT)' if done.timed_out else ''}")
    return results
