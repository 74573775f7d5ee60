"""``strategy: {name: parallel, plan: true}``: the planner chooses the layout when training starts.

    strategy: {name: parallel, plan: true}                 # every degree planned
    strategy: {name: parallel, tp: auto, dp_shard: 2}      # dp_shard pinned, tp (and the rest) planned

A degree is an integer (pinned) or ``"auto"`` (planned); under ``plan: true`` every degree not given is
planned; with ``"auto"`` degrees alone, the degrees not given keep their defaults (1) but ``dp_shard``
(default: whatever the others leave) is planned. ``-1`` counts as ``"auto"``. ``cp`` is never planned
(pin it). ``ep`` (expert parallel, borrowed from the data-parallel ranks) is planned like the others
under ``plan: true`` (for a model with experts; 1 for any other) and kept when given. Planning options:
``global_batch`` (default: the train loader's batch x the data-parallel size the pinned degrees leave, as
``polytrain plan``), ``hardware`` (a preset; default: the accelerator's)
and ``chosen`` (written by the Trainer: the layout picked, which a resume at the same world size
reuses). Plain ``strategy: auto`` is not the planner: it keeps Lightning's meaning, ``single`` on one
device and ``ddp`` on several.

This module checks and rewrites the spec only; ``polytrain.trainer.launch.planned`` does the planning.
"""

from __future__ import annotations

import math
from typing import Any

from polytrain.core.errors import ConfigError
from polytrain.parallel.hardware import PRESETS
from polytrain.strategies.options import DEGREES, PLAN_KEYS, PLANNABLE, PLANNED_NAME

AUTO = "auto"
# cp: CUDA-only ring attention, pinned or 1
PLANNED_DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "ep")
CHOSEN_REQUIRED = ("world_size", *DEGREES, "n_microbatches", "activation_checkpointing")
# ep: not a factor of the world size; absent from a plan written before it was planned (then 1)
CHOSEN_KEYS = (*CHOSEN_REQUIRED, "ep", "hardware", "memory_bytes", "step_s")
WHERE = "trainer.strategy (parallel)"


def is_planned(spec: Any) -> bool:
    """A spec ``validate_strategy_spec`` returned that the planner resolves at start."""
    return isinstance(spec, dict) and spec.get("name") == PLANNED_NAME and spec.get("plan") is True


def _degree(key: str, value: Any, planning: bool) -> int | str:
    if value == AUTO or (planning and value == -1 and key != "cp"):
        if key == "cp":
            raise ConfigError(f"{WHERE} cp='auto' is not valid: the planner keeps cp at 1 (ring attention is "
                              f"CUDA-only); pin an integer")
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{WHERE} {key}={value!r} is not valid: a degree is an integer (pinned) or 'auto' "
                          f"(chosen by the planner)")
    return value


def _check_chosen(chosen: Any) -> None:
    if chosen is None:
        return
    if (not isinstance(chosen, dict) or not set(CHOSEN_REQUIRED) <= set(chosen)
            or not set(chosen) <= set(CHOSEN_KEYS)):
        raise ConfigError(f"{WHERE} chosen={chosen!r} is not valid: the Trainer writes it, a mapping with "
                          f"the keys {', '.join(CHOSEN_REQUIRED)} (optional: "
                          f"{', '.join(CHOSEN_KEYS[len(CHOSEN_REQUIRED):])})")
    ints = [chosen[k] for k in ("world_size", *DEGREES)]
    ep = chosen.get("ep", 1)
    if (any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in [*ints, ep])
            or math.prod(ints[1:]) != ints[0]):
        raise ConfigError(f"{WHERE} chosen={chosen!r}: degrees must be positive integers whose product is "
                          f"world_size")


def _check_plan_options(options: dict[str, Any]) -> None:
    plan, batch, preset = options.get("plan", True), options.get("global_batch"), options.get("hardware")
    if not isinstance(plan, bool):
        raise ConfigError(f"{WHERE} plan={plan!r} is not valid: true (the planner chooses every degree not "
                          f"given) or false")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ConfigError(f"{WHERE} global_batch={batch!r} is not valid: a positive integer "
                          f"(samples per step)")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"{WHERE} hardware={preset!r} is not valid; choose one of: "
                          f"{', '.join(sorted(PRESETS))}")
    _check_chosen(options.get("chosen"))


def split_plan(options: dict[str, Any], valid: list[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``options`` (without ``name``) -> (the strategy's own options, auto degrees at their defaults; the
    planning request to put back with ``with_plan``, or None when nothing is planned after all)."""
    unknown = [k for k in options if k not in valid and k not in PLAN_KEYS]
    if unknown:
        raise ConfigError(f"strategy 'parallel' has no option '{unknown[0]}'; valid: {', '.join(valid)}, "
                          f"and for the planner: {', '.join(PLAN_KEYS)}")
    _check_plan_options(options)
    planning = options.get("plan", False) is True or any(options.get(k) == AUTO for k in PLANNABLE)
    degrees = {k: _degree(k, options[k], planning) for k in PLANNABLE if k in options}
    # plan: true plans every degree not given; 'auto' degrees alone, dp_shard (default: the rest)
    if planning:
        missing = PLANNED_DEGREES if options.get("plan") is True else ("dp_shard",)
        degrees = {**{k: AUTO for k in missing if k not in degrees}, **degrees}
    plain = {k: v for k, v in options.items() if k not in PLAN_KEYS and k not in PLANNABLE}
    plain.update({k: v for k, v in degrees.items() if v != AUTO})
    if not planning:
        extra = [k for k in PLAN_KEYS if k in options and k != "plan"]
        if extra:
            raise ConfigError(f"{WHERE} option(s) {', '.join(extra)} plan the layout: add plan: true or "
                              f"set a degree to 'auto'")
        return plain, None
    auto = sorted((k for k, v in degrees.items() if v == AUTO), key=PLANNABLE.index)
    return plain, {"auto": auto, **{k: options.get(k) for k in PLAN_KEYS if k != "plan"}}


def with_plan(checked: dict[str, Any], request: dict[str, Any] | None) -> dict[str, Any]:
    """The checked options with the planning request put back (the form ``split_plan`` reads again)."""
    if request is None:
        return checked
    spec = {**checked, **{k: AUTO for k in request["auto"]}, "plan": True}
    spec.update({k: request[k] for k in PLAN_KEYS if k != "plan"})
    return spec


def pinned_degrees(spec: dict[str, Any]) -> dict[str, int]:
    """What the planner must keep: integer degrees (``ep`` included), and ``n_microbatches`` when given."""
    pinned = {k: spec[k] for k in PLANNABLE if isinstance(spec.get(k), int)}
    if isinstance(spec.get("n_microbatches"), int):
        pinned["n_microbatches"] = spec["n_microbatches"]
    return pinned


def resolved_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], bool | str]:
    """A planned spec with its ``chosen`` layout -> (the plain ``parallel`` spec, activation checkpointing:
    False off, True full, "op" per-op)."""
    chosen = spec.get("chosen")
    if chosen is None:
        raise ConfigError(f"{WHERE} plan: true is resolved when a stage starts (the planner needs the "
                          f"module); this strategy was built before that")
    plain = {k: v for k, v in spec.items() if k not in PLAN_KEYS}
    plain.update({k: chosen[k] for k in DEGREES})
    plain["ep"] = chosen.get("ep", 1)
    if chosen["pp"] > 1 and plain.get("n_microbatches") is None:
        plain["n_microbatches"] = chosen["n_microbatches"]
    ac = chosen["activation_checkpointing"]
    return plain, ac if ac == "op" else bool(ac)
