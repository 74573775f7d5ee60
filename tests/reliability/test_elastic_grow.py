"""Issue 26 item 3: elastic both ways, 2 -> 1 -> 2 nodes in one run, through ``polytrain fit`` with
``trainer.num_nodes: "1:2"`` (c10d rendezvous in torch's elastic agent).

Three launchers on this host act as nodes, one worker each, sharing one run_dir (as nodes share a
file system): A hosts the rendezvous store; B joins with A, and at step ``KILL_AT`` (mid epoch 2)
SIGKILLs its own agent and worker, so a whole node is gone; A's worker fails in its next collective,
A's agent restarts it (one of ``max_restarts``) and the rendezvous closes with A alone: training
continues at world size 1 from the newest checkpoint. Once A has trained ``HOLD_AFTER`` steps (and
checkpointed) at world size 1, launcher C starts; A's agent sees a node waiting, restarts its
worker (a membership change, which torch does not count against max_restarts) and A and C finish
the run at world size 2 from the newest checkpoint.

Checked from what the workers recorded: for each step, the batches of the worker group that trained
it last (earlier ones were rolled back by a resume) cover every sample of every epoch exactly once,
the kept steps run at world sizes 2, then 1, then 2, and the final weights equal, within 1e-5, a
plain PyTorch loop (same init, Adam, same global batches: the mean of each rank's mean loss).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from .helpers import _kill_tree, figure, free_port, job_env, polytrain_cli, rel_module, write_config

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]

N, BATCH, EPOCHS = 32, 4, 3  # world size 2: 4 steps an epoch; world size 1: 8
KILL_AT = 7  # newest checkpoint then: step 6 (every 2 steps), 16 samples into epoch 2
HOLD_AFTER = 3  # steps 6, 7, 8 at world size 1 (checkpoint at 8), then wait for the new node
DEADLINE = 420.0  # the whole scenario, on a loaded machine; ~1-2 minutes on a quiet one
# A lost node is dropped after 6 s without a heartbeat (torch writes one every ~2 intervals, so fewer than
# 3 attempts drops live nodes); no long wait for stragglers; B and C never host the store.
RDZV = "join_timeout=300,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=6"


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(out.glob(f"{name}_rank*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["t"])


def _start(name: str, config: Path, env: dict[str, str], out: Path) -> tuple[subprocess.Popen, Any]:
    log = open(out / f"{name}.log", "w+")  # noqa: SIM115 - closed in _stop
    proc = subprocess.Popen(polytrain_cli(config), env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    return proc, log


def _wait_for(out: Path, event: str, procs: list[subprocess.Popen], until: float) -> None:
    while not any(r["event"] == event for r in _records(out, "events")):
        if time.time() > until or any(p.poll() not in (None, -9) for p in procs):
            raise AssertionError(f"no {event!r} event before the deadline or a launcher ended early: "
                                 f"{[p.poll() for p in procs]}")
        time.sleep(0.2)


def _run_scenario(out: Path) -> dict[str, tuple[int | None, str]]:
    config = write_config(out / "config.yaml", out / "run", out, devices=1, max_epochs=EPOCHS,
                          every_n_steps=2, extra_trainer={"num_nodes": "1:2", "max_restarts": 3},
                          module={"_target_": "grow_module.GrowModule", "n": N, "batch_size": BATCH,
                                  "dropout": 0.0})
    base = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), POLYTRAIN_RDZV_CONF=RDZV,
                   POLYTRAIN_GROW_HOLD_AFTER=str(HOLD_AFTER), LOGLEVEL="INFO")
    joiner = dict(base, POLYTRAIN_RDZV_CONF=RDZV + ",is_host=0")
    started = time.time()
    until = started + DEADLINE
    launchers = {"A": _start("A", config, base, out),
                 "B": _start("B", config, dict(joiner, POLYTRAIN_GROW_KILL_AT=str(KILL_AT)), out)}
    try:
        _wait_for(out, "holding", [p for p, _ in launchers.values()], until)
        launchers["C"] = _start("C", config, joiner, out)
        for proc, _ in launchers.values():
            proc.wait(timeout=max(1.0, until - time.time()))
    except (AssertionError, subprocess.TimeoutExpired):
        pass  # reported below with every launcher's output
    finally:
        for proc, _ in launchers.values():
            if proc.poll() is None:
                _kill_tree(proc)
    results = {}
    for name, (proc, log) in launchers.items():
        log.seek(0)
        results[name] = (proc.returncode, log.read())
        log.close()
    results["seconds"] = (None, f"{time.time() - started:.0f}")
    return results


def _kept_steps(samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per global step, the records of the worker group that trained it last (one per rank)."""
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for r in samples:
        by_step.setdefault(r["step"], {}).setdefault(r["group"], []).append(r)
    kept = []
    for step in sorted(by_step):
        last = max(by_step[step].values(), key=lambda rows: max(r["t"] for r in rows))
        assert sorted(r["rank"] for r in last) == list(range(last[0]["world_size"])), (step, last)
        kept.append(sorted(last, key=lambda r: r["rank"]))
    assert [rows[0]["step"] for rows in kept] == list(range(len(kept))), "a step is missing"
    return kept


def _replay(out: Path, kept: list[list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
    module = rel_module().RelModule(n=N, batch_size=BATCH, dropout=0.0)
    module.configure_model()
    module.load_state_dict(torch.load(out / "init_state.pt", weights_only=True))
    data = rel_module().IndexedRegression(N)
    optimizer = torch.optim.Adam(module.parameters(), lr=module.lr)
    for rows in kept:
        optimizer.zero_grad()
        losses = [F.mse_loss(module(data.x[r["indices"]]), data.y[r["indices"]]) for r in rows]
        torch.stack(losses).mean().backward()  # DDP: the mean over ranks of each rank's mean loss
        optimizer.step()
    return {k: v.detach() for k, v in module.state_dict().items()}


def _world_sizes(kept: list[list[dict[str, Any]]]) -> list[int]:
    sizes = [rows[0]["world_size"] for rows in kept]
    return [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]


@pytest.mark.timeout(600)
def test_two_nodes_lose_one_and_regain_one_in_one_run(tmp_path: Path) -> None:
    out = tmp_path
    results = _run_scenario(out)
    outputs = "\n".join(f"--- {n} rc={rc}\n{text[-4000:]}"
                        for n, (rc, text) in results.items() if rc is not None)
    assert results["A"][0] == 0 and results.get("C", (None,))[0] == 0, outputs
    assert results["B"][0] == -9, outputs  # B's agent was SIGKILLed: the node is gone
    events = _records(out, "events")
    kills = [e for e in events if e["event"] == "node_kill"]
    assert len(kills) == 1 and kills[0]["step"] == KILL_AT, kills
    a_log = results["A"][1]
    assert "3/3 attempts left; will restart worker group" in a_log, outputs  # the lost node: one restart used
    assert "new nodes from group_rank" in a_log, outputs  # the joining node: a membership restart

    starts = [e for e in events if e["event"] == "fit_start"]
    # The final group: A's worker and C's first. torch counts a restart for each failed worker group (the
    # lost node's, and any a loaded machine adds, e.g. a collective timing out while C's worker starts),
    # never for the joining node: A's count is its agent's failures.
    failures = a_log.count("attempts left; will restart worker group")
    assert failures >= 1 and sorted(e["restart_count"] for e in starts[-2:]) == [0, failures], (starts,
                                                                                                  outputs)
    kept = _kept_steps(_records(out, "samples"))
    assert _world_sizes(kept) == [2, 1, 2], _world_sizes(kept)
    for epoch in range(EPOCHS):
        seen = sorted(i for rows in kept for r in rows if r["epoch"] == epoch for i in r["indices"])
        assert seen == list(range(N)), f"epoch {epoch}: {len(seen)} samples, {len(set(seen))} distinct"
    resumed = [(e["world_size"], e["step"]) for e in events if e["event"] == "fit_start" and e["step"] > 0]
    final = torch.load(out / "final_rank0.pt", weights_only=True)["state"]
    assert final["net.0.weight"].shape == (8, 4) and final.keys() == _replay(out, kept).keys()
    replay = _replay(out, kept)
    diff = max((final[k] - replay[k]).abs().max().item() for k in final)
    restarts = sorted({(e["pid"], e["restart_count"]) for e in events if e["event"] == "fit_start"},
                      key=lambda p: p[0])
    figure("elastic both ways, polytrain fit num_nodes 1:2",
           f"world sizes {_world_sizes(kept)} over {len(kept)} kept steps, "
           f"resumed (world size, step) {resumed}; "
           f"{EPOCHS} epochs x {N} samples each trained exactly once; max |weights - replay| {diff:.2e}; "
           f"{results['seconds'][1]}s", max_diff=diff, steps=len(kept), restarts=restarts)
    assert diff < 1e-5, diff
    final1 = torch.load(out / "final_rank1.pt", weights_only=True)["state"]
    assert all(torch.equal(final[k], final1[k]) for k in final)
