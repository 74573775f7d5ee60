"""``connect``: a set-up strategy without a Trainer or a TrainModule, for its collectives alone.

    # torchrun --nproc_per_node=2 script.py
    from polytrain import connect
    strategy = connect("ddp", accelerator="cpu")
    total = strategy.all_reduce(torch.ones(1), "sum")   # world size, on every rank
    strategy.teardown()

Ranks, world size and the rendezvous address come from the launcher's environment (torchrun,
SLURM, ``polytrain``'s own launchers), exactly as for a Trainer. Outside any launcher this is a
one-process job and every collective is the identity.
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.core.environment import detect_environment
from polytrain.core.errors import ConfigError
from polytrain.core.option_checks import check_choice
from polytrain.strategies.base import Strategy
from polytrain.strategies.registry import (
    build_strategy,
    normalize_strategy,
    resolve_strategy_name,
    validate_strategy_spec,
)


def connect(strategy: Any = "ddp", accelerator: str = "auto", precision: str = "32",
            timeout: float = 1800.0) -> Strategy:
    """Build the strategy named by ``strategy`` (a name or ``{name: ..., **options}``), join the
    job's process group through it, and return it. Call ``teardown()`` on it when done."""
    check_choice(accelerator, ("auto", "cpu", "cuda", "gpu"), "accelerator")
    if timeout <= 0:
        raise ConfigError(f"timeout={timeout} must be a positive number of seconds")
    env = detect_environment()
    spec = validate_strategy_spec(normalize_strategy(strategy), accelerator)
    spec["name"] = resolve_strategy_name(spec["name"], env.world_size)
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    elif accelerator == "gpu":
        accelerator = "cuda"
    built = build_strategy(spec, accelerator=accelerator, devices=env.local_world_size,
                           num_nodes=max(1, env.world_size // env.local_world_size), precision=precision,
                           timeout=timeout, env=env)
    built.setup_environment()
    # a strategy may defer its rendezvous to setup_module, which connect never calls
    built.join_process_group()
    return built
