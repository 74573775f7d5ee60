"""The heartbeat's diagnosis on a real c10d ``TCPStore`` (no process group needed): which peer a
failed collective waited for, whether it is stuck (fresh record, behind) or dead (stale record),
and what happens when the store itself is gone. End to end it runs in ``test_failures``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch.distributed as dist

from polytrain.core import heartbeat

from .helpers import figure, free_port

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]


@pytest.fixture
def store() -> Any:
    s = dist.TCPStore("127.0.0.1", free_port(), 2, True, wait_for_workers=False)
    yield s
    heartbeat.stop()


def _peer(store: Any, rank: int, step: int, where: str, seq: int, idle: float, silent: float) -> None:
    now = time.time()
    store.set(f"polytrain/heartbeat/{rank}", json.dumps({
        "rank": rank, "step": step, "where": where, "seq": seq, "changed_at": now - idle,
        "pushed_at": now - silent}))


@pytest.mark.timeout(60)
def test_a_stuck_peer_is_named_with_its_position(store: Any) -> None:
    heartbeat.start(0, 2, timeout_s=10.0, store=store, interval_s=0.2)
    for step in range(4):
        heartbeat.beat(step, "training_step")
        heartbeat.at("backward")
    _peer(store, 1, 3, "training_step", seq=7, idle=10.2, silent=0.1)  # alive, one position behind
    err = heartbeat.explain(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete"))
    assert isinstance(err, heartbeat.RankUnresponsiveError)
    text = str(err)
    figure("heartbeat diagnosis, stuck peer", text.split(";")[0])
    assert "rank 1 stopped responding at step 3 (last seen in training_step, 1" in text
    assert "rank 0 waited in backward at step 3" in text and "Timed out waiting" in text


@pytest.mark.timeout(60)
def test_a_dead_peer_is_named_as_dead(store: Any) -> None:
    heartbeat.start(0, 2, timeout_s=10.0, store=store, interval_s=0.2)
    heartbeat.beat(5, "training_step")
    _peer(store, 1, 5, "training_step", seq=1, idle=30.0, silent=30.0)
    text = str(heartbeat.explain(RuntimeError("Connection closed by peer [127.0.0.1]:1234")))
    figure("heartbeat diagnosis, dead peer", text.split("; rank 0")[0])
    assert "rank 1 stopped responding at step 5" in text and "heartbeat stopped" in text and "died" in text


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_peer_killed_before_its_record_aged_is_named_as_dead(store: Any, reaped: bool) -> None:
    """Rank 1 trained 7 steps in 0.25 s and was SIGKILLed before its thread published again (as the
    elastic grow test's lost node): its fresh record still says "step 0, setup", which read as a rank
    lagging there. On the same host its process is looked up: gone (or a zombie its launcher has not
    reaped yet) means dead."""
    heartbeat.start(0, 2, timeout_s=10.0, store=store, interval_s=1.0)
    heartbeat.beat(7, "backward")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    if reaped:
        dead.wait()
    else:
        while _state(dead.pid) != "Z":  # exited, not yet waited for
            time.sleep(0.05)
    now = time.time()
    store.set("polytrain/heartbeat/1", json.dumps({
        "rank": 1, "step": 0, "where": "setup", "seq": 1, "changed_at": now - 1.8, "pushed_at": now - 0.5,
        "pid": dead.pid, "host": socket.gethostname()}))
    text = str(heartbeat.explain(RuntimeError("Connection closed by peer [127.0.0.1]:1234")))
    dead.wait()
    figure(f"heartbeat diagnosis, peer killed within an interval ({'reaped' if reaped else 'zombie'})",
           text.split("; rank 0")[0])
    assert f"rank 1 died: its process (pid {dead.pid}, this host) has exited; it last reported step 0" in text
    assert "stopped responding" not in text and "rank 0 waited in backward at step 7" in text, text


@pytest.mark.timeout(60)
def test_a_live_peer_on_this_host_is_not_called_dead(store: Any) -> None:
    heartbeat.start(0, 2, timeout_s=10.0, store=store, interval_s=0.2)
    heartbeat.beat(3, "backward")
    now = time.time()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as alive:
        store.set("polytrain/heartbeat/1", json.dumps({
            "rank": 1, "step": 2, "where": "training_step", "seq": 0, "changed_at": now - 5.0,
            "pushed_at": now, "pid": alive.pid, "host": socket.gethostname()}))
        text = str(heartbeat.explain(RuntimeError("[gloo] Timed out waiting 10000ms for recv")))
        alive.kill()
    assert "rank 1 stopped responding at step 2 (last seen in training_step" in text, text
    assert "died" not in text, text


@pytest.mark.timeout(60)
def test_a_peer_that_raised_is_named_with_its_error_and_step(store: Any) -> None:
    """Rank 1 ran 4 steps and raised within its heartbeat's first interval: its periodic record still
    said "step 0, setup", so rank 0 used to report it as stopped responding there. ``failed``
    publishes the error and the step at once."""
    heartbeat.start(1, 2, timeout_s=30.0, store=store, interval_s=30.0)  # the thread never publishes again
    for step in range(4):
        heartbeat.beat(step, "training_step")
        heartbeat.at("optimizer_step")
    heartbeat.failed(StopIteration(), step=4)
    heartbeat.failed(RuntimeError("later"), step=9)  # the first error is the one peers hear of
    heartbeat.start(0, 2, timeout_s=30.0, store=store, interval_s=0.2)
    heartbeat.beat(4, "training_step")
    heartbeat.at("backward")
    heartbeat.failed(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), step=4)  # not rank 0's own
    text = str(heartbeat.explain(RuntimeError("Connection closed by peer [127.0.0.1]:1234")))
    figure("heartbeat diagnosis, peer that raised", text.split("; rank 0")[0])
    assert "rank 1 raised at step 4 (its last position: optimizer_step): StopIteration;" in text, text
    assert "stopped responding" not in text and "rank 0 waited in backward at step 4" in text, text


@pytest.mark.timeout(60)
def test_other_errors_are_left_alone(store: Any) -> None:
    from polytrain.core.errors import DivergenceError

    heartbeat.start(0, 2, timeout_s=10.0, store=store, interval_s=0.2)
    assert heartbeat.explain(ValueError("bad batch")) is None
    assert heartbeat.explain(DivergenceError("ranks disagree at collective #3")) is None
    assert heartbeat.explain(RuntimeError("CUDA out of memory")) is None
    heartbeat.stop()
    assert heartbeat.explain(RuntimeError("Timed out")) is None  # no heartbeat: nothing to add
    figure("heartbeat diagnosis, unrelated errors", "left unchanged: 4/4 (ValueError, DivergenceError, "
                                                    "CUDA OOM, no heartbeat running)")


@pytest.mark.timeout(60)
def test_publishing_happens_off_the_training_thread(store: Any) -> None:
    heartbeat.start(1, 2, timeout_s=10.0, store=store, interval_s=0.2)
    heartbeat.beat(9, "validation")
    deadline = time.time() + 10
    record = {}
    while time.time() < deadline:
        record = json.loads(store.get("polytrain/heartbeat/1").decode())
        if record["step"] == 9:
            break
        time.sleep(0.1)
    assert record["step"] == 9 and record["where"] == "validation"
    start = time.perf_counter()
    for i in range(100_000):
        heartbeat.beat(i, "training_step")
    per_call_us = (time.perf_counter() - start) * 10
    figure("heartbeat cost on the training thread", f"{per_call_us:.2f} us per beat (no store traffic)")
    assert per_call_us < 50
