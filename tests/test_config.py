"""Config validation, YAML loading, overrides, ``_target_`` instantiation and the CLI's exit code."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from polytrain.cli import main as cli_main
from polytrain.strategies.registry import available_strategies, validate_strategy_spec
from polytrain.trainer.configuration.config import (
    ACCELERATORS,
    LAUNCHERS,
    PRECISIONS,
    ConfigError,
    TrainerConfig,
    instantiate,
    load_config,
    parse_yaml,
    validate_run_config,
    validate_trainer_config,
)

pytestmark = pytest.mark.own_logic


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


MODULE_YAML = "module: {_target_: conftest.TinyModule}\n"


# --------------------------------------------------------------------------- trainer section


def test_typo_key_names_key_suggestion_and_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        validate_trainer_config({"max_epoch": 3})
    msg = str(info.value)
    assert "'max_epoch'" in msg
    assert "did you mean 'max_epochs'" in msg
    # The valid keys are listed so the user can fix a typo with no suggestion as well.
    for key in ("accumulate_grad_batches", "gradient_clip_val", "precision", "run_dir"):
        assert key in msg


def test_typo_without_close_match_still_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        validate_trainer_config({"zzzzzz": 1})
    msg = str(info.value)
    assert "'zzzzzz'" in msg and "did you mean" not in msg
    assert "max_epochs" in msg


@pytest.mark.parametrize(("key", "value"), [("max_epochs", "abc"), ("max_steps", "x"),
                                            ("gradient_clip_val", "big"), ("enable_checkpointing", "maybe")])
def test_wrong_type_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        validate_trainer_config({key: value})
    assert f"trainer.{key}" in str(info.value)


def test_valid_values_are_converted_and_defaults_kept() -> None:
    cfg = validate_trainer_config({"max_epochs": "3", "precision": 32})
    assert cfg.max_epochs == 3 and isinstance(cfg.max_epochs, int)
    assert cfg.precision == "32"
    assert cfg.max_steps == TrainerConfig().max_steps


@pytest.mark.parametrize(("key", "good", "bad", "choices"), [
    ("precision", "bf16-mixed", "16-true", PRECISIONS),  # "16", "bf16", "32-true": Lightning's aliases
    ("accelerator", "cpu", "tpu", ACCELERATORS),
    ("launcher", "spawn", "mpi", LAUNCHERS),
    ("gradient_clip_algorithm", "value", "l2", ("norm", "value")),
    ("nan_policy", "skip", "ignore", ("error", "skip")),
])
def test_choices(key: str, good: str, bad: str, choices: tuple[str, ...]) -> None:
    assert getattr(validate_trainer_config({key: good}), key) == good
    with pytest.raises(ConfigError) as info:
        validate_trainer_config({key: bad})
    msg = str(info.value)
    assert f"trainer.{key}" in msg and repr(bad) in msg
    for choice in choices:
        assert choice in msg


@pytest.mark.parametrize(("data", "fragment"), [
    ({"devices": 0}, "trainer.devices"),
    ({"devices": True}, "trainer.devices"),
    ({"accumulate_grad_batches": 0}, "trainer.accumulate_grad_batches"),
    ({"max_epochs": -2}, "trainer.max_epochs"),
    ({"gradient_clip_val": -1.0}, "trainer.gradient_clip_val"),
    ({"timeout": 0}, "trainer.timeout"),
])
def test_out_of_range_values(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        validate_trainer_config(data)


# --------------------------------------------------------------------------- strategies


def test_unknown_strategy_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        validate_trainer_config({"strategy": "dpp"})
    msg = str(info.value)
    assert "'dpp'" in msg
    for name in available_strategies():
        assert name in msg


def test_unknown_strategy_option_lists_that_strategys_options() -> None:
    with pytest.raises(ConfigError) as info:
        validate_trainer_config({"strategy": {"name": "ddp", "bucket_cap": 1}})
    msg = str(info.value)
    assert msg.startswith("strategy 'ddp' has no option 'bucket_cap'; valid: ")
    assert "bucket_cap_mb" in msg and "sync_batchnorm" in msg


def test_strategy_option_wrong_type_names_option() -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        validate_trainer_config({"strategy": {"name": "ddp", "bucket_cap_mb": "huge"}})


def test_strategy_shorthand_and_mapping_normalise_to_full_options() -> None:
    short = validate_trainer_config({"strategy": "ddp"}).strategy
    full = validate_trainer_config({"strategy": {"name": "ddp", "static_graph": True}}).strategy
    assert short["name"] == "ddp" and short["static_graph"] is False
    assert full["static_graph"] is True and full["bucket_cap_mb"] == short["bucket_cap_mb"]
    assert validate_trainer_config({}).strategy == {"name": "auto"}


def test_auto_strategy_takes_no_options() -> None:
    with pytest.raises(ConfigError, match="'auto' takes no options"):
        validate_strategy_spec({"name": "auto", "static_graph": True})


@pytest.mark.parametrize("points", [[2], ["net.3"]])
def test_split_points_parse_as_child_indices_or_module_paths(points: list[Any]) -> None:
    """``list[int] | list[str]`` is a union of containers: OmegaConf 2.3 (the lowest supported, in
    .venv-torch-min) refuses such an annotation outright, 2.4 lets it through unchecked. Either way the
    value arrives as written, and a mixed list is refused."""
    config = validate_trainer_config({"strategy": {"name": "pipeline", "pp": 2, "split_points": points}})
    spec = config.strategy
    assert spec["split_points"] == points
    with pytest.raises(ConfigError, match=r"split_points=\[1, 'net.3'\] is not valid .*all child indices"):
        validate_trainer_config({"strategy": {"name": "pipeline", "pp": 2, "split_points": [1, "net.3"]}})


def test_the_torch_free_strategy_options_are_the_registered_classes_options() -> None:
    """``polytrain`` checks a config's strategy against ``strategies/options.py`` before torch loads; the
    workers build from the registered classes. Both must know the same names, options and Lightning
    strings, or a config would pass one check and fail (or be read differently by) the other."""
    from polytrain.strategies import options
    from polytrain.strategies.registry import _STRATEGIES, lightning_names, strategy_class

    assert list(options.OPTIONS) == list(_STRATEGIES)
    for name, options_class in options.OPTIONS.items():
        assert strategy_class(name).Options is options_class, name
    assert lightning_names() == options.LIGHTNING_NAMES
    for alias, spec in options.LIGHTNING_NAMES.items():
        assert (options.check_strategy_spec(options.spec_mapping(alias))
                == options.check_strategy_spec(spec)), alias


@pytest.mark.parametrize("spec", [
    "dpp", {"name": "ddp", "bucket_cap": 1}, {"name": "ddp", "bucket_cap_mb": "huge"},
    {"name": "auto", "static_graph": True}, {"name": "parallel", "schedule": "gpipee"},
    {"name": "parallel", "cp": 0}, {"name": "model_parallel", "mode": "layers", "tp": 2},
    {"name": "pipeline", "schedule": "zbv", "stages_per_rank": 1},
    {"name": "parallel", "plan": True, "hardware": "h1000"}, {"name": "parallel", "plan": "yes"},
    {"name": "parallel", "tp": "auto", "tpp": 2}, {"name": "parallel", "cp": "auto", "tp": "auto"},
    {"name": "parallel", "plan": True, "global_batch": 0}, {"name": "parallel", "cp": 2},
    {"name": "parallel", "tp": "auto", "cp": 2},
])
def test_the_torch_free_check_says_what_the_full_check_says(spec: Any) -> None:
    from polytrain.strategies import options
    from polytrain.trainer.configuration import config_file

    with pytest.raises(ConfigError) as full:
        validate_trainer_config({"strategy": spec, "accelerator": "cpu"})
    with pytest.raises(ConfigError) as first:
        config_file._check_strategy(options.spec_mapping(spec), "cpu")
    assert str(first.value) == str(full.value)


# --------------------------------------------------------------------------- load_config


def test_merge_order_defaults_then_yaml_then_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, MODULE_YAML + "trainer: {max_epochs: 5, max_steps: 7, seed: 3}\n")
    cfg = load_config(path, ["trainer.max_epochs=9"])
    trainer = cfg["trainer"]
    assert trainer["max_epochs"] == 9  # override beats YAML
    assert trainer["max_steps"] == 7 and trainer["seed"] == 3  # YAML beats defaults
    assert trainer["precision"] == TrainerConfig().precision  # untouched default
    assert cfg["module"] == {"_target_": "conftest.TinyModule"}
    assert cfg["config_dir"] == str(tmp_path)


def test_override_values_are_yaml_typed(tmp_path: Path) -> None:
    path = write(tmp_path, MODULE_YAML)
    cfg = load_config(path, ["trainer.gradient_clip_val=0.5", "trainer.enable_checkpointing=false",
                             "trainer.resume=null", "module.lr=0.25"])
    assert cfg["trainer"]["gradient_clip_val"] == 0.5
    assert cfg["trainer"]["enable_checkpointing"] is False
    assert cfg["trainer"]["resume"] is None
    assert cfg["module"]["lr"] == 0.25


def test_strategy_shorthand_override_then_option_on_it(tmp_path: Path) -> None:
    path = write(tmp_path, MODULE_YAML)
    cfg = load_config(path, ["trainer.strategy=ddp", "trainer.strategy.sync_batchnorm=true"])
    strategy = cfg["trainer"]["strategy"]
    assert strategy["name"] == "ddp" and strategy["sync_batchnorm"] is True


def test_option_override_on_yaml_shorthand(tmp_path: Path) -> None:
    path = write(tmp_path, MODULE_YAML + "trainer: {strategy: ddp}\n")
    cfg = load_config(path, ["trainer.strategy.sync_batchnorm=true"])
    assert cfg["trainer"]["strategy"]["name"] == "ddp"
    assert cfg["trainer"]["strategy"]["sync_batchnorm"] is True


def test_override_typo_is_reported(tmp_path: Path) -> None:
    path = write(tmp_path, MODULE_YAML)
    with pytest.raises(ConfigError, match="did you mean 'max_epochs'"):
        load_config(path, ["trainer.max_epoch=2"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(path, ["trainer.max_epochs"])


def test_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "nope.yaml"))


def test_python_tags_rejected(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write(tmp_path, f"module: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="forbidden tag"):
        load_config(path)
    with pytest.raises(ConfigError, match="forbidden tag"):
        parse_yaml("module: !!python/object:collections.OrderedDict {}\n")
    assert not marker.exists()


def test_alias_bomb_rejected_quickly() -> None:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="alias"):
        parse_yaml("\n".join(lines), "bomb.yaml")
    assert time.perf_counter() - start < 2.0


def test_small_aliases_are_fine() -> None:
    data = parse_yaml("base: &b {max_epochs: 2}\ntrainer: *b\n")
    assert data["trainer"] == {"max_epochs": 2}


def test_top_level_must_be_mapping_with_known_sections() -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        parse_yaml("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="has no key 'trainr'"):
        validate_run_config({"module": {"_target_": "x.Y"}, "trainr": {}})


@pytest.mark.parametrize("data", [{"trainer": {}}, {"module": {"lr": 1.0}}, {"module": {}}])
def test_missing_module_target(data: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"module.*_target_"):
        validate_run_config(data)


# --------------------------------------------------------------------------- _target_


def test_instantiate_builds_nested_targets() -> None:
    spec = {"_target_": "builtins.dict", "lr": 0.5,
            "inner": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}}
    obj = instantiate(spec, "module")
    assert obj["lr"] == 0.5
    assert isinstance(obj["inner"], torch.nn.Linear) and tuple(obj["inner"].weight.shape) == (3, 2)


def test_instantiate_bad_kwargs_names_target() -> None:
    with pytest.raises(ConfigError) as info:
        instantiate({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3, "bogus": 1},
                    "module")
    msg = str(info.value)
    assert "torch.nn.Linear" in msg and "bogus" in msg and msg.startswith("module")


@pytest.mark.parametrize(("target", "fragment"), [
    ("torch.nn.Linearx", "has no attribute 'Linearx'"),
    ("no_such_pkg_xyz.Thing", "cannot import module 'no_such_pkg_xyz'"),
    ("Linear", "dotted path"),
])
def test_instantiate_bad_target(target: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        instantiate({"_target_": target}, "module")
    assert target in str(info.value) and fragment in str(info.value)


def test_instantiate_without_target() -> None:
    with pytest.raises(ConfigError, match="module needs a _target_"):
        instantiate({"lr": 1.0}, "module")


# --------------------------------------------------------------------------- CLI


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(argv)
    return code, capsys.readouterr().err


def test_cli_typo_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MODULE_YAML + "trainer: {max_epoch: 1}\n")
    code, err = _cli(["fit", "--config", path], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "max_epoch" in lines[0] and lines[0].startswith("polytrain: config error:")


def test_cli_bad_override_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MODULE_YAML)
    code, err = _cli(["validate", "--config", path, "trainer.max_epochs=abc"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "trainer.max_epochs" in err


def test_cli_forbidden_tag_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The YAML parser's own message spans several lines (source excerpt and caret).
    path = write(tmp_path, "module: !!python/object/apply:os.getcwd []\n")
    code, err = _cli(["fit", "--config", path], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "forbidden tag" in err
