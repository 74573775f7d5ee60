"""Requirement 7: config safety, by mutation: walk the schema -- every field of ``TrainerConfig``
and of every registered strategy's options dataclass -- and feed ``load_config`` (what the CLI runs
before any worker or process group exists) a typo of the key, a value of the wrong type, and
``null`` where the field is not optional (a missing value). Every mutation must raise
``ConfigError`` naming the key and what is valid. YAML ``!!python`` tags and alias bombs are refused
while parsing. ``polytrain fit`` with a bad key exits 2 before starting any worker.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from polytrain.strategies.registry import _STRATEGIES, strategy_class
from polytrain.trainer.configuration.config import ConfigError, TrainerConfig, load_config, parse_yaml

from .helpers import Done, figure, pick

pytestmark = [pytest.mark.own_logic, pytest.mark.reliability, pytest.mark.distributed]

BASE = "module: {_target_: rel_module.RelModule}\ntrainer: {accelerator: cpu, devices: 1}\n"
# The expected-type or valid-choices part of a message.
EXPLAINS = ("expected", "valid", "choose one of", "must be", "use ", "must name")


def _typo(name: str, valid: list[str]) -> str:
    for candidate in (name[:-1], name + "s", name.replace("_", "", 1), "x" + name):
        if candidate not in valid and candidate != name:
            return candidate
    raise AssertionError(name)


def _wrong_value(tp: Any) -> Any:
    """A value of the wrong type for a field annotated ``tp`` (annotations are strings here)."""
    text = str(tp)
    if text.startswith("list"):
        return "not-a-list"
    if "int" in text or "float" in text:
        return "not-a-number"
    if "bool" in text:
        return "maybe"
    if "str" in text:
        return {"not": "a string"}
    return {"unexpected": ["mapping"]}  # Any: devices, strategy, logger


def _wrong_element(tp: Any) -> list[Any] | None:
    """For list fields: a list whose element has the wrong type."""
    text = str(tp)
    if not text.startswith("list"):
        return None
    if "int" in text and "str" in text:  # indices or names (split_points): neither
        return [{"not": "an index or a name"}]
    return ["not-a-number"] if "int" in text else [{"not": "a string"}] if "str" in text else [42]


def _optional(tp: Any) -> bool:
    text = str(tp)
    return "None" in text or "Optional" in text or text == "Any"


def _mutations() -> list[tuple[str, str, str, Any]]:
    """(where, key, mutation kind, override value or typo key)."""
    out = []
    trainer_fields = dataclasses.fields(TrainerConfig)
    valid = [f.name for f in trainer_fields]
    for f in trainer_fields:
        out.append(("trainer", f.name, "typo", _typo(f.name, valid)))
        out.append(("trainer", f.name, "wrong type", _wrong_value(f.type)))
        if _wrong_element(f.type) is not None:
            out.append(("trainer", f.name, "wrong element", _wrong_element(f.type)))
        if not _optional(f.type):
            out.append(("trainer", f.name, "null", None))
    for name in _STRATEGIES:
        fields = dataclasses.fields(strategy_class(name).Options)
        valid = [f.name for f in fields]
        for f in fields:
            out.append((f"strategy:{name}", f.name, "typo", _typo(f.name, valid)))
            out.append((f"strategy:{name}", f.name, "wrong type", _wrong_value(f.type)))
            if _wrong_element(f.type) is not None:
                out.append((f"strategy:{name}", f.name, "wrong element", _wrong_element(f.type)))
            if not _optional(f.type):
                out.append((f"strategy:{name}", f.name, "null", None))
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                out.append((f"strategy:{name}", f.name, "missing", None))
    return out


def _apply(where: str, key: str, kind: str, value: Any) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(BASE)
    if where == "trainer":
        data["trainer"][value if kind == "typo" else key] = 3 if kind == "typo" else value
    else:
        spec: dict[str, Any] = {"name": where.split(":", 1)[1]}
        if kind != "missing":
            spec[value if kind == "typo" else key] = 3 if kind == "typo" else value
        data["trainer"]["strategy"] = spec
    return data


@pytest.mark.timeout(300)
def test_every_key_rejects_typos_wrong_types_and_missing_values(tmp_path: Path) -> None:
    import yaml

    failures, total = [], 0
    for where, key, kind, value in _mutations():
        total += 1
        path = tmp_path / f"{total}.yaml"
        path.write_text(yaml.safe_dump(_apply(where, key, kind, value)))
        try:
            load_config(str(path))
        except ConfigError as err:
            message = str(err)
            named = (value if kind == "typo" else key) in message
            explained = any(w in message for w in EXPLAINS)
            if kind == "typo":
                # the list of valid keys holds the intended one
                explained = "valid:" in message and key in message
            if not (named and explained):
                failures.append(f"{where}.{key} [{kind}={value!r}]: unclear message: {message}")
            continue
        except Exception as err:  # noqa: BLE001 - the wrong kind of error is a failure too
            failures.append(f"{where}.{key} [{kind}={value!r}]: {type(err).__name__}: {err}")
            continue
        failures.append(f"{where}.{key} [{kind}={value!r}]: accepted")
    assert not dist.is_initialized()  # nothing above started a process group
    keys = len(dataclasses.fields(TrainerConfig)) + sum(len(dataclasses.fields(strategy_class(n).Options))
                                                         for n in _STRATEGIES)
    figure("config mutation walk",
           f"rejected with a message naming key and valid choices: {total - len(failures)}/"
           f"{total} mutations over {keys} keys (TrainerConfig + {len(_STRATEGIES)} "
           f"strategies' options)", rejected=total - len(failures), total=total)
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_yaml_python_tags_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    documents = [
        f"trainer: !!python/object/apply:os.system ['touch {marker}']\n",
        "trainer: !!python/name:os.system\n",
        f"trainer: !!python/object/new:subprocess.Popen [['touch', '{marker}']]\n",
        "trainer: !!python/module:os\n",
    ]
    refused = 0
    for text in documents:
        with pytest.raises(ConfigError, match="forbidden tag"):
            parse_yaml(text)
        refused += 1
    figure("YAML !!python tags",
           f"refused {refused}/{len(documents)}; marker files created: {int(marker.exists())}")
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_yaml_alias_bomb_is_refused_quickly() -> None:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    lines.append("trainer: *i")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="alias bomb"):
        parse_yaml("\n".join(lines))
    seconds = time.perf_counter() - start
    figure("YAML alias bomb (10^9 nodes)", f"refused in {seconds * 1000:.0f} ms")
    assert seconds < 5


@pytest.mark.timeout(1800)
def test_cli_rejects_bad_config_before_starting_workers(jobs: dict[str, Done]) -> None:
    lines = []
    for done in pick(jobs, "config/"):
        err = done.stderr
        assert done.returncode == 2, (done.returncode, done.output[-2000:])
        assert err.startswith("polytrain: config error:"), err
        assert done.job.meta["key"] in err and ("valid" in err or "expected" in err), err
        assert "[rank" not in done.output and "rendezvous" not in done.output.lower()  # no worker, no agent
        lines.append(f"{done.job.meta['key']}: exit 2 in {done.seconds:.1f}s")
    figure("polytrain fit with a bad config (devices=2)", "; ".join(lines))


@pytest.mark.timeout(60)
def test_mutation_walk_covers_every_registered_strategy() -> None:
    walked = {where.split(":", 1)[1] for where, *_ in _mutations() if where.startswith("strategy:")}
    figure("config mutation walk coverage",
           f"strategies walked {len(walked)}/{len(_STRATEGIES)}: {sorted(walked)}")
    assert walked == set(_STRATEGIES)
