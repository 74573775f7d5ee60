"""``polytrain fit`` stopped by Ctrl-C or a scheduler's SIGTERM: the shell's exit code for the signal (130,
143), no traceback, every process of the job ended, a line naming the newest complete checkpoint and, for a
fit, the command that continues it, which does continue it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import POLYTRAIN, TINY_CONFIG, finish, run, start  # noqa: E402

from polytrain.checkpoint.layout import newest_resumable  # noqa: E402

# The elastic agent turns the launcher's SIGINT/SIGTERM into its own exception and stops its workers: torch's.
pytestmark = [pytest.mark.torch_api, pytest.mark.distributed]

RUN_TIMEOUT = 120
STOPPED = "polytrain: fit stopped by {}; its processes have ended and "


def _group(pgid: int) -> list[int]:
    """The processes left in process group ``pgid`` (the launcher leads its own: start_new_session)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _signalled_after_a_checkpoint(cmd: list[str], run_dir: Path, signum: int, whole_group: bool) -> tuple:
    """Start ``cmd``, wait for its first complete checkpoint, send ``signum`` to the launcher (or, as a
    terminal's Ctrl-C does, to every process of the job), and wait for it to end."""
    started = start(cmd, interruptible=True)
    proc = started[0]
    deadline = time.time() + RUN_TIMEOUT
    while newest_resumable(str(run_dir), None) is None:
        assert proc.poll() is None and time.time() < deadline, finish(started, time.time()).describe()
        time.sleep(0.2)
    if whole_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    try:
        proc.wait(timeout=60)  # the job writes a few lines: its pipes cannot fill meanwhile
    except subprocess.TimeoutExpired:
        finish(started, time.time())  # ends the job and fails the test with its output
    left = time.time() + 10  # the forkserver sees its launcher gone, the workers have been stopped
    while _group(proc.pid) and time.time() < left:
        time.sleep(0.1)
    remaining = _group(proc.pid)
    return finish(started, time.time() + 5), remaining


def _long_fit(run_dir: Path, devices: int) -> list[str]:
    """A fit far from its end when signalled (200 epochs of steps of at least 50 ms)."""
    return [*POLYTRAIN, "fit", "-c", str(TINY_CONFIG), f"trainer.devices={devices}",
            f"trainer.run_dir={run_dir}", "trainer.max_epochs=200", "module.step_sleep=0.05"]


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_ctrl_c_on_two_processes_exits_130_and_prints_the_command_that_continues_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = _long_fit(run_dir, devices=2)
    done, remaining = _signalled_after_a_checkpoint(cmd, run_dir, signal.SIGINT, whole_group=True)
    assert done.returncode == 130, done.describe()
    assert remaining == [], f"processes of the job still running: {remaining}\n{done.describe()}"
    assert "Traceback" not in done.stderr, done.describe()
    stopped, follow = done.stderr.strip().splitlines()[-2:]
    said = STOPPED.format("SIGINT") + "the newest complete checkpoint is "
    assert stopped.startswith(said), done.describe()
    newest = stopped.rsplit(" ", 1)[1]
    assert newest == newest_resumable(str(run_dir), None)[1]
    prefix = "polytrain: to continue it: "
    assert follow.startswith(prefix), done.describe()
    command = shlex.split(follow[len(prefix):])
    assert command == [*cmd, "trainer.resume=last"]

    epoch = torch.load(newest, map_location="cpu", weights_only=True)["loop"]["epoch"]
    continued = run([*command, f"trainer.max_epochs={epoch + 1}", "module.step_sleep=0"], RUN_TIMEOUT)
    assert continued.returncode == 0, continued.describe()
    assert f"restoring from {newest}" in continued.stderr, continued.describe()
    final = newest_resumable(str(run_dir), None)[1]
    assert torch.load(final, map_location="cpu", weights_only=True)["loop"]["epoch"] == epoch + 1


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_sigterm_to_the_launcher_ends_its_workers_and_exits_143(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done, remaining = _signalled_after_a_checkpoint(_long_fit(run_dir, devices=2), run_dir, signal.SIGTERM,
                                                    whole_group=False)
    assert done.returncode == 143, done.describe()
    assert remaining == [], f"processes of the job still running: {remaining}\n{done.describe()}"
    assert done.stderr.strip().splitlines()[-2].startswith(STOPPED.format("SIGTERM")), done.describe()


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_one_process_fit_stopped_by_a_signal_says_so_and_exits_with_its_code(tmp_path: Path,
                                                                              signum: int) -> None:
    run_dir = tmp_path / "run"
    done, remaining = _signalled_after_a_checkpoint(_long_fit(run_dir, devices=1), run_dir, signum,
                                                    whole_group=False)
    assert done.returncode == 128 + signum, done.describe()
    assert remaining == [] and "Traceback" not in done.stderr, done.describe()
    name = signal.Signals(signum).name
    assert done.stderr.strip().splitlines()[-2].startswith(STOPPED.format(name)), done.describe()


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_ctrl_c_on_a_script_that_starts_two_processes_says_so_and_exits_130(tmp_path: Path) -> None:
    """A script calling Trainer.fit with devices=2 (run again under the elastic agent): Ctrl-C reaches every
    process; no worker prints a traceback, the launching process says what was stopped, names the newest
    complete checkpoint and how a script continues from it (it was 59 lines of tracebacks, exit code 1)."""
    from procs import TRAIN_SCRIPT

    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(TRAIN_SCRIPT), str(tmp_path), "--devices", "2", "--max-epochs", "200",
           "--step-sleep", "0.05"]
    done, remaining = _signalled_after_a_checkpoint(cmd, run_dir, signal.SIGINT, whole_group=True)
    assert done.returncode == 130, done.describe()
    assert remaining == [], f"processes of the job still running: {remaining}\n{done.describe()}"
    assert "Traceback" not in done.stderr and "[rank" not in done.stderr, done.describe()
    stopped, newest, follow = done.stderr.strip().splitlines()[-3:]
    assert stopped == "polytrain: fit stopped by SIGINT; its processes have ended", done.describe()
    assert newest == f"polytrain: the newest complete checkpoint is {newest_resumable(str(run_dir), None)[1]}"
    assert follow == ("polytrain: to continue it: run the script again with Trainer(..., resume=\"last\") or "
                      "trainer.fit(..., ckpt_path=\"last\")"), done.describe()
