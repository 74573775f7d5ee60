"""``trainer.num_nodes: "MIN:MAX"`` (elastic, like torchrun's --nnodes): validation, launch planning and
the c10d rendezvous it asks torch's elastic agent for. The 2 -> 1 -> 2 run itself is
tests/reliability/test_elastic_grow.py."""

from __future__ import annotations

import pytest

from polytrain.core.errors import ConfigError
from polytrain.strategies.launcher import _launch_config, plan_launch, rdzv_conf
from polytrain.trainer.configuration.config import TrainerConfig, load_config, validate_trainer_config

pytestmark = pytest.mark.torch_api

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_JOB_ID", "POLYTRAIN_RDZV_CONF",
                 "POLYTRAIN_RUN_ID")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", ["1:4", "2:2", " 1 : 3 ", 3, "2"])
def test_counts_and_ranges_are_accepted(value: object) -> None:
    validate_trainer_config({"num_nodes": value})


@pytest.mark.parametrize(("value", "shown"), [("0:2", "MIN=0, MAX=2"), ("3:1", "MIN=3, MAX=1"),
                                              (0, "=0 must"), ("1:2:3", "'1:2:3' is not"),
                                              ("a:b", "'a:b' is not"), (True, "True is not"),
                                              (1.5, "1.5 is not")])
def test_bad_ranges_name_the_value_and_the_fix(value: object, shown: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_trainer_config({"num_nodes": value})
    assert shown in str(err.value) and 'num_nodes: "1:4"' in str(err.value)


def test_an_unquoted_range_in_yaml_is_not_base_60(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("module: {_target_: torch.nn.Linear, in_features: 1, out_features: 1}\n"
                    "trainer:\n  num_nodes: 1:4\n")
    assert load_config(str(path))["trainer"]["num_nodes"] == "1:4"  # YAML 1.1 would read 64
    assert load_config(str(path), ["trainer.num_nodes=2:3"])["trainer"]["num_nodes"] == "2:3"


def _cfg(**kw: object) -> TrainerConfig:
    return TrainerConfig(**{"accelerator": "cpu", "devices": 1, "strategy": "ddp", **kw})


def test_a_range_starts_the_elastic_agent_on_c10d(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_launch(_cfg(num_nodes="1:4"))
    assert (plan.method, plan.node_range, plan.num_nodes) == ("elastic", (1, 4), 1)
    with pytest.raises(ConfigError, match="set MASTER_ADDR and MASTER_PORT"):
        _launch_config(plan, 3)
    monkeypatch.setenv("MASTER_ADDR", "head")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv("POLYTRAIN_RDZV_CONF", "last_call_timeout=5,is_host=0")
    lc = _launch_config(plan, 3)
    assert (lc.min_nodes, lc.max_nodes, lc.rdzv_backend, lc.rdzv_endpoint, lc.max_restarts) == (
        1, 4, "c10d", "head:29400", 3)
    assert lc.rdzv_configs["last_call_timeout"] == 5 and lc.rdzv_configs["is_host"] == 0
    assert lc.run_id == "polytrain-29400"  # the same on every node; SLURM_JOB_ID or POLYTRAIN_RUN_ID override


def test_a_range_needs_the_elastic_launcher() -> None:
    with pytest.raises(ConfigError, match="needs the elastic launcher.*torchrun --nnodes=1:2"):
        plan_launch(_cfg(num_nodes="1:2", launcher="spawn"))


@pytest.mark.parametrize("world", [1, 2])
def test_a_worker_of_a_range_trains_at_whatever_size_the_rendezvous_admitted(monkeypatch: pytest.MonkeyPatch,
                                                                            world: int) -> None:
    # WORLD_SIZE=1 is the survivor of a lost node: it must train, not start an agent of its own.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    plan = plan_launch(_cfg(num_nodes="1:2"))
    assert (plan.method, plan.num_nodes, plan.node_range) == ("here", world, None)


def test_a_world_outside_the_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="started 3 processes.*allows 1..2"):
        plan_launch(_cfg(num_nodes="1:2"))


def test_rdzv_conf_syntax_errors_show_an_example() -> None:
    assert rdzv_conf("join_timeout=900, last_call_timeout=2") == {"join_timeout": 900, "last_call_timeout": 2}
    with pytest.raises(ConfigError, match="last_call_timeout=5"):
        rdzv_conf("last_call_timeout")
