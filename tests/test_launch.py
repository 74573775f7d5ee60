"""Every way a job's worker processes come to exist, proved with real processes and real gloo.

- ``torchrun --standalone --nproc_per_node=2 script.py`` (strategy auto -> ddp);
- ``python script.py`` with ``Trainer(devices=2)``: the script re-runs under torch's elastic agent;
- ``Trainer(launcher="spawn")``: workers via torch.multiprocessing, weights handed back;
- SLURM's variables (unit tests of ``detect_environment`` and a real 2-task run);
- two torchrun "nodes" on loopback against one rendezvous;
- a launcher/config mismatch fails with a ConfigError.

Each run of the tiny script trains a 5-parameter linear regression for 2 epochs on 2 ranks, so all
of them must end with the weights of one plain PyTorch loop over the same global batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import (  # noqa: E402
    SCRIPTS,
    TORCHRUN,
    TRAIN_SCRIPT,
    child_env,
    free_port,
    read_records,
    reference_weights,
    run,
    run_together,
)

from polytrain.core.environment import detect_environment  # noqa: E402
from polytrain.strategies.launcher import plan_launch  # noqa: E402
from polytrain.trainer.configuration.config import ConfigError, validate_trainer_config  # noqa: E402

pytestmark = pytest.mark.torch_api

RUN_TIMEOUT = 120  # seconds for one launch (imports alone take several seconds per process on 2 cores)
RETRIED = 2 * RUN_TIMEOUT + 30  # a launch hit by the known exit-time abort runs once more (see procs.py)
STEPS = 8  # 64 samples / (2 ranks x batch 8) = 4 steps per epoch, 2 epochs
ATOL = 1e-5  # all-reduce mean of two half-batch gradients vs one full-batch mean: float rounding only


@pytest.fixture(scope="module")
def expected_weights() -> list[float]:
    return reference_weights()


def assert_two_rank_ddp(records: dict[int, dict], expected: list[float], source: str) -> None:
    assert sorted(records) == [0, 1], f"expected records from ranks 0 and 1, got {sorted(records)}"
    for rank, rec in records.items():
        assert rec["world_size"] == 2, rec
        assert rec["strategy"] == "ddp", f"rank {rank} trained with {rec['strategy']}, expected ddp"
        assert rec["env_source"] == source, rec
        assert rec["global_step"] == STEPS, rec
    assert records[0]["pid"] != records[1]["pid"]
    assert records[0]["weights"] == records[1]["weights"], "replicas diverged"
    assert records[0]["weights"] == pytest.approx(expected, abs=ATOL), "not the single-process result"


def assert_ok(result) -> None:
    assert result.returncode == 0, result.describe()


# --------------------------------------------------------------------------- torchrun


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RETRIED)
def test_torchrun_standalone_two_processes(tmp_path, expected_weights):
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN_SCRIPT, tmp_path], RUN_TIMEOUT)
    assert_ok(result)
    records = read_records(tmp_path)
    assert_two_rank_ddp(records, expected_weights, source="torchrun")
    assert {r["local_rank"] for r in records.values()} == {0, 1}
    assert all(r["env"]["TORCHELASTIC_RUN_ID"] for r in records.values())
    assert not (tmp_path / "parent.json").exists()  # each worker trained itself; nothing was relaunched


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RETRIED)
def test_torchrun_process_count_disagreeing_with_devices_is_a_config_error(tmp_path):
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN_SCRIPT, tmp_path, "--devices", "3"],
                 RUN_TIMEOUT, retry_exit_abort=False)
    assert result.returncode != 0, result.describe()
    assert "ConfigError" in result.stderr, result.describe()
    assert "the launcher started 2 processes but trainer.devices=3" in result.stderr, result.describe()
    assert not read_records(tmp_path)


@pytest.mark.parametrize("devices, num_nodes", [(1, 1), (3, 1), (1, 3)])
def test_launcher_mismatch_is_a_config_error_before_any_process_group(monkeypatch, devices, num_nodes):
    _clear_launcher_env(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = validate_trainer_config({"accelerator": "cpu", "devices": devices, "num_nodes": num_nodes})
    with pytest.raises(ConfigError, match=rf"started 2 processes but trainer.devices={devices} x "
                                          rf"num_nodes={num_nodes} asks for {devices * num_nodes}"):
        plan_launch(cfg)


def test_launcher_agreement_runs_here(monkeypatch):
    _clear_launcher_env(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GROUP_RANK", "1")
    for devices, num_nodes in (("auto", 1), (1, 2)):
        plan = plan_launch(validate_trainer_config({"accelerator": "cpu", "devices": devices,
                                                    "num_nodes": num_nodes}))
        assert ((plan.method, plan.strategy_name, plan.env.global_rank, plan.env.node_rank)
                == ("here", "ddp", 1, 1))


def test_more_cpu_processes_than_cores_is_refused_with_the_way_to_ask_for_it(monkeypatch):
    _clear_launcher_env(monkeypatch)
    monkeypatch.delenv("POLYTRAIN_OVERSUBSCRIBE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = validate_trainer_config({"accelerator": "cpu", "devices": 3, "launcher": "spawn"})
    with pytest.raises(ConfigError) as info:
        plan_launch(cfg)
    message = str(info.value)
    assert "trainer.devices=3 CPU processes but only 2 CPU cores" in message
    # both ways out, with the numbers
    assert "at most 2" in message and "POLYTRAIN_OVERSUBSCRIBE=1" in message
    monkeypatch.setenv("POLYTRAIN_OVERSUBSCRIBE", "1")  # asked for on purpose: planned as given
    plan = plan_launch(cfg)
    assert (plan.devices, plan.world_size, plan.method) == (3, 3, "spawn")


def test_lightnings_launcher_strategy_names_are_ddp_with_that_launcher():
    for name, launcher in (("ddp_spawn", "spawn"), ("ddp_fork", "fork"), ("ddp_notebook", "fork")):
        cfg = validate_trainer_config({"accelerator": "cpu", "devices": 2, "strategy": name})
        assert (cfg.strategy["name"], cfg.launcher) == ("ddp", launcher)
    cfg = validate_trainer_config({"strategy": {"name": "ddp_spawn", "find_unused_parameters": True}})
    assert (cfg.strategy["find_unused_parameters"], cfg.launcher) == (True, "spawn")
    with pytest.raises(ConfigError, match="strategy='ddp_spawn' starts its processes with the 'spawn' "
                                          "launcher, but trainer.launcher='elastic'"):
        validate_trainer_config({"strategy": "ddp_spawn", "launcher": "elastic"})


# --------------------------------------------------------------------------- Trainer(devices=2) from a script


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RETRIED)
def test_plain_script_relaunches_itself_under_the_elastic_agent(tmp_path, expected_weights):
    result = run([sys.executable, TRAIN_SCRIPT, tmp_path, "--devices", "2"], RUN_TIMEOUT)
    assert_ok(result)
    records = read_records(tmp_path)
    assert_two_rank_ddp(records, expected_weights, source="torchrun")
    for rec in records.values():
        # Started by torch's elastic agent (which names the run), not by a home-made spawner.
        assert rec["env"]["TORCHELASTIC_RUN_ID"].startswith("polytrain-"), rec["env"]
        assert rec["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert records[0]["ppid"] == records[1]["ppid"]  # one agent is the parent of both workers
    # The launching process exits with the job's status instead of carrying on untrained.
    assert not (tmp_path / "parent.json").exists()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RETRIED)
def test_relaunched_script_failing_on_one_rank_ends_the_job_with_its_traceback(tmp_path):
    # trainer.timeout=600: had rank 0 waited for its all-reduce to time out, the run would be killed.
    result = run([sys.executable, TRAIN_SCRIPT, tmp_path, "--devices", "2", "--fail-rank", "1",
                  "--timeout", "600"], RUN_TIMEOUT, retry_exit_abort=False)
    assert result.returncode == 1, result.describe()
    # Rank 1's own traceback once (written to the agent's error file, not printed by every worker and
    # again by the agent), torch's and polytrain's frames left out, then the one line naming the rank.
    said = result.stderr.strip().splitlines()
    start = said.index("polytrain: rank 1 failed (torch's and polytrain's frames left out; "
                       "POLYTRAIN_FULL_ERROR=1 shows them):")
    error = "RuntimeError: tiny-module deliberate failure on rank 1"
    assert said[-2:] == [error, f"polytrain: fit failed on rank 1: {error}"], result.describe()
    report = said[start:]
    frames = [line.strip() for line in report if line.strip().startswith("File ")]
    assert [f.split(", in ")[-1] for f in frames] == ["<module>", "main", "training_step"], result.describe()
    assert all(str(SCRIPTS) in f for f in frames), result.describe()  # the user's files and lines only
    assert len(report) <= 30 and result.stderr.count(error) == 2, result.describe()  # its line, the summary
    assert "Root Cause" not in result.stderr and "[rank" not in result.stderr, result.describe()
    failed_at = float(json.loads((tmp_path / "failed-rank1.json").read_text())["time"])
    lingered = result.ended - failed_at
    assert lingered < 60, f"the job took {lingered:.1f}s to end after rank 1 failed\n{result.describe()}"
    assert not read_records(tmp_path)  # nobody reached the end of fit


# --------------------------------------------------------------------------- launcher: spawn, fork


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RETRIED)
@pytest.mark.parametrize("launch", [["--launcher", "spawn"], ["--launcher", "fork"],
                                    # Lightning's name: ddp started by the spawn launcher; no logging step
                                    # in the run, so the epoch's end reduces the step values shown
                                    ["--strategy", "ddp_spawn", "--log-every", "50"]],
                         ids=["spawn", "fork", "ddp_spawn"])
def test_spawn_launcher_hands_trained_weights_back_to_the_caller(tmp_path, expected_weights, launch):
    import torch

    result = run([sys.executable, TRAIN_SCRIPT, tmp_path, "--devices", "2", *launch], RUN_TIMEOUT)
    assert_ok(result)
    records = read_records(tmp_path)
    assert_two_rank_ddp(records, expected_weights, source="torchrun")
    for rec in records.values():
        assert rec["env"]["TORCHELASTIC_RUN_ID"] is None  # torch.multiprocessing, not the elastic agent
    parent = json.loads((tmp_path / "parent.json").read_text())
    assert parent["pid"] not in {r["pid"] for r in records.values()}
    assert parent["weights"] != parent["initial"]
    assert parent["weights"] == records[0]["weights"]
    ckpt = torch.load(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)
    assert ckpt["loop"]["global_step"] == STEPS and ckpt["loop"]["world_size"] == 2
    saved = [float(v) for t in ckpt["model"].values() for v in t.flatten().tolist()]
    assert parent["weights"] == saved
    assert "val/loss" in parent["callback_metrics"]
    assert parent["callback_metrics"]["train/rank_sum"] == 0 + 1  # reduced across the two ranks (sync_dist)
    assert parent["finished"]  # the workers' trainer.state, handed back


# --------------------------------------------------------------------------- SLURM


def _clear_launcher_env(monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_")) or key in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key)


def _slurm(monkeypatch, **overrides: str) -> None:
    _clear_launcher_env(monkeypatch)
    values = dict(SLURM_NTASKS="4", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1",
                  SLURM_NODELIST="node[003-004]", SLURM_JOB_ID="123456", SLURM_JOB_NAME="train")
    values.update(overrides)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_slurm_batch_job_variables(monkeypatch):
    _slurm(monkeypatch)
    env = detect_environment()
    assert env.source == "slurm"
    assert (env.global_rank, env.local_rank, env.world_size, env.node_rank) == (3, 1, 4, 1)
    assert env.master_addr == "node003"
    assert env.master_port == 10000 + 123456 % 10000  # derived from the job id: jobs sharing a node differ
    _slurm(monkeypatch, SLURM_JOB_ID="123457")
    assert detect_environment().master_port == env.master_port + 1


@pytest.mark.parametrize("nodelist, first", [("node[003-004]", "node003"), ("gpu[7,9-12],cpu1", "gpu7"),
                                             ("single-host", "single-host"), ("127.0.0.1", "127.0.0.1")])
def test_slurm_master_is_the_first_host_of_the_nodelist(monkeypatch, nodelist, first):
    _slurm(monkeypatch, SLURM_NODELIST=nodelist)
    assert detect_environment().master_addr == first


def test_slurm_explicit_master_address_and_port_win(monkeypatch):
    _slurm(monkeypatch)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29876")
    env = detect_environment()
    assert (env.source, env.master_addr, env.master_port) == ("slurm", "10.0.0.5", 29876)


def test_torchrun_variables_take_precedence_over_slurm(monkeypatch):
    _slurm(monkeypatch)
    for key, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
        monkeypatch.setenv(key, value)
    env = detect_environment()
    assert env.source == "torchrun"
    assert (env.global_rank, env.local_rank, env.world_size, env.node_rank) == (1, 1, 2, 0)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29555)


@pytest.mark.parametrize("job_name", ["bash", "interactive"])
def test_interactive_slurm_allocation_is_not_a_job(monkeypatch, job_name):
    _slurm(monkeypatch, SLURM_JOB_NAME=job_name)
    env = detect_environment()
    assert env.source == "none" and not env.is_distributed
    plan = plan_launch(validate_trainer_config({"accelerator": "cpu", "devices": 1}))
    assert (plan.method, plan.strategy_name) == ("here", "single")


def test_single_task_slurm_job_is_one_process(monkeypatch):
    _slurm(monkeypatch, SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    assert not detect_environment().is_distributed


def test_no_launcher_is_a_single_process(monkeypatch):
    _clear_launcher_env(monkeypatch)
    env = detect_environment()
    assert (env.source, env.global_rank, env.world_size) == ("none", 0, 1)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RETRIED)
def test_two_slurm_tasks_train_as_ddp(tmp_path, expected_weights):
    def tasks():
        port = str(free_port())
        return [([sys.executable, TRAIN_SCRIPT, tmp_path],
                 child_env(SLURM_JOB_ID="4242", SLURM_JOB_NAME="tiny", SLURM_NTASKS="2",
                           SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NODEID="0",
                           SLURM_NODELIST="127.0.0.1", MASTER_PORT=port))
                for task in (0, 1)]

    for result in run_together(tasks, RUN_TIMEOUT):
        assert_ok(result)
    records = read_records(tmp_path)
    assert_two_rank_ddp(records, expected_weights, source="slurm")
    assert {r["local_rank"] for r in records.values()} == {0, 1}
    for rec in records.values():
        assert rec["env"]["SLURM_PROCID"] == str(rec["rank"])
        # polytrain exported torch's variables itself; the launch set none of them.
        assert rec["env"]["RANK"] == str(rec["rank"]) and rec["env"]["WORLD_SIZE"] == "2"
        assert rec["env"]["MASTER_ADDR"] == "127.0.0.1" and rec["env"]["TORCHELASTIC_RUN_ID"] is None


# --------------------------------------------------------------------------- multi-node


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RETRIED)
def test_two_nodes_on_loopback(tmp_path, expected_weights):
    def nodes():
        port = free_port()
        return [([*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
                  "--master_addr=127.0.0.1", f"--master_port={port}", TRAIN_SCRIPT, tmp_path, "--devices",
                  "1", "--num-nodes", "2"], child_env())
                for node in (0, 1)]

    for result in run_together(nodes, RUN_TIMEOUT):
        assert_ok(result)
    records = read_records(tmp_path)
    assert_two_rank_ddp(records, expected_weights, source="torchrun")
    for rank, rec in records.items():
        assert (rec["node_rank"], rec["local_rank"]) == (rank, 0), rec  # one process on each "node"
        assert rec["env"]["LOCAL_WORLD_SIZE"] == "1"
    assert records[0]["ppid"] != records[1]["ppid"]  # two agents, one per node


def _join_and_sum(path: str) -> None:
    import torch

    from polytrain import connect

    strategy = connect("ddp", accelerator="cpu", timeout=30)
    total = strategy.all_reduce(torch.ones(1), "sum")
    if strategy.is_global_zero:
        Path(path).write_text(str(float(total)))
    strategy.teardown()


@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_spawn_starts_again_on_another_port_when_its_port_was_taken(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The port chosen for the rendezvous is free when chosen; another program may bind it before rank 0
    does (a busy machine). The spawn launcher then starts the job again on another port."""
    import socket

    from polytrain.core.environment import ClusterEnvironment
    from polytrain.strategies import launcher

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        taken = iter([held.getsockname()[1]])
        chosen: list[int] = []

        def first_the_taken_one() -> int:
            port = next(taken, None) or free_port()
            chosen.append(port)
            return port

        monkeypatch.setattr(launcher, "free_port", first_the_taken_one)
        plan = launcher.LaunchPlan("cpu", 2, 1, "ddp", 2, ClusterEnvironment(), "fork")
        launcher.launch_spawn(plan, _join_and_sum, (str(tmp_path / "sum"),))
    assert len(chosen) == 2 and (tmp_path / "sum").read_text() == "2.0"
