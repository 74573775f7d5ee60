"""Resume, on one screen: which checkpoint, then everything in it taken back in one order (Lightning's
``checkpoint_connector.restore`` is the model; the file format is the checkpoint I/O's, ``checkpoint/``).

``choose_checkpoint``: the config's ``resume`` or ``ckpt_path`` (``last`` | ``auto`` | ``best`` | a path)
-> the file or sharded directory to load. A fit's choice is settled with the run's directory on global
rank 0 and broadcast (``run_directory.settle_run_directory``); the planner reads the layout stored in the
same checkpoint (``planned.py``); an evaluation's is settled in ``agree_on_checkpoint``.

``restore_fit``, every rank, in this order:

0. callbacks that reshape the optimizers' parameter groups (``BaseFinetuning``: its
   ``restore_param_groups``) rebuild them from their saved state, read from the file's payload by global
   rank 0 and broadcast, so the optimizer state of step 1 finds the groups it was saved from
1. model and optimizers: the strategy's ``load_checkpoint`` (whole or sharded, as its I/O holds them)
2. the module's ``on_load_checkpoint``
3. the DataModule's state
4. the callbacks' ``on_load_checkpoint``, then their state
5. the LR schedulers and the grad scaler
6. the loop's position: ``FitProgress.load_state_dict``
7. what the first epoch takes back, returned as ``Resumed``: this rank's RNG streams and its stateful
   data (``data_connector.epoch_iterator`` applies them when it makes that epoch's iterator)

``restore_weights``: an evaluation's checkpoint, the weights and the module's ``on_load_checkpoint``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from polytrain.checkpoint.layout import (
    existing_checkpoints,
    holds_weights_only,
    read_payload,
    recorded_best,
    resolve_resume,
)
from polytrain.core.errors import ConfigError
from polytrain.data.stateful import select_rank_state
from polytrain.trainer.api.hooks import Hooks
from polytrain.trainer.loops.progress import FitProgress, Resumed

log = logging.getLogger("polytrain")


def choose_checkpoint(choice: str | None, root: str, version: int | str | None, kept_best: str | None = None,
                      from_argument: bool = False, stage: str = "fit", say: bool = True) -> str | None:
    """The checkpoint ``choice`` names under the run ``root``/``version``, or None (a fresh start).
    ``kept_best``: the best path this process's ModelCheckpoint kept; ``from_argument``: the choice came
    as ``ckpt_path`` (Lightning's argument, whose ``"last"`` starts fresh when there is no checkpoint at
    all), not as the config's ``resume``; ``stage``: what the checkpoint is for (its messages say so);
    ``say``: whether the log names the file taken."""
    if choice == "best":
        path = best_checkpoint(kept_best, root, version)
        if say:
            log.info("ckpt_path='best': %s: the best checkpoint ModelCheckpoint recorded, %s", stage, path)
        return path
    return resolve_resume(choice, root, version, last_may_start_fresh=from_argument, stage=stage, say=say)


def best_checkpoint(kept: str | None, root: str, version: int | str | None) -> str:
    """``ckpt_path="best"``: the ModelCheckpoint callback's best (``kept``) after a fit of this Trainer, else
    the best the run's own checkpoints recorded (a new process: ``polytrain test --ckpt best``)."""
    best = kept or recorded_best(root, version)
    if not best:
        raise ConfigError(f"ckpt_path='best' loads the best checkpoint a ModelCheckpoint recorded, and no "
                          f"run under {root} recorded one. Fit with checkpointing enabled first (monitor=... "
                          f"ranks them), or pass a path or 'last'. {existing_checkpoints(root)}")
    return best


def agree_on_checkpoint(strategy: Any, choose: Callable[[], str | None], ckpt_path: str, run_dir: str) -> str:
    """Global rank 0 chooses (``choose``), every rank gets its answer (or its error, raised on all)."""
    path: Any = None
    if strategy.is_global_zero:
        try:
            path = choose()
        except Exception as err:  # noqa: BLE001 - every rank raises it, after the broadcast below
            path = err
    path = strategy.broadcast(path)
    if isinstance(path, BaseException):
        raise path
    if path is None:
        raise FileNotFoundError(f"no checkpoint found for ckpt_path={ckpt_path!r} under {run_dir}")
    return path


def restore_fit(path: str, *, strategy: Any, hooks: Hooks, module: Any, datamodule: Any,
                callbacks: list[Any], schedulers: list[Any], progress: FitProgress) -> Resumed:
    """Take a fit back from ``path`` (the same on every rank), steps 1-7 of the module's docstring."""
    log.info("restoring from %s", path)
    # Global rank 0 reads the file and every rank gets its answer: file systems that differ between nodes
    # cannot leave one rank raising while another waits in the load's collectives.
    regrouping = [cb for cb in callbacks if callable(getattr(cb, "restore_param_groups", None))]
    head = ((holds_weights_only(path), _callback_states(path) if regrouping else {})
            if strategy.is_global_zero else None)
    weights_only, early_states = strategy.broadcast(head)
    if weights_only:
        raise ConfigError(
            f"{path} holds the model's weights only (written with ModelCheckpoint(save_weights_only=True) or "
            f"save_checkpoint(weights_only=True)): there is no optimizer, scheduler or callback state to "
            f"resume a fit from. Start a new fit from its weights (Module.load_from_checkpoint(path), then "
            f"fit without ckpt_path), or save full checkpoints to resume")
    for callback in regrouping:  # 0
        state = _state_of(callback, early_states)
        if state is not None:
            callback.restore_param_groups(module, list(strategy.optimizers), state)
    payload = strategy.load_checkpoint(path)  # 1
    if "state_dict" not in payload:  # what Lightning code reads there: the weights just loaded
        payload["state_dict"] = payload.get("model") or module.state_dict()
    hooks.module("on_load_checkpoint", payload)  # 2
    if datamodule is not None:  # 3
        state = payload.get("datamodule", {}).get(type(datamodule).__qualname__)
        if state is not None:
            hooks.datamodule("load_state_dict", state)
    hooks.callbacks("on_load_checkpoint", payload)  # 4
    states = payload.get("callbacks", {})
    for callback in callbacks:
        state = _state_of(callback, states)
        if state is not None:
            callback.load_state_dict(state)
    for config, state in zip(schedulers, payload.get("schedulers", [])):  # 5
        config.scheduler.load_state_dict(state)
    if payload.get("precision"):
        strategy.precision.load_state_dict(payload["precision"])
    loop = payload.get("loop")
    if loop is None:  # a checkpoint without the loop's state: the fit starts at step 0 with these weights
        return Resumed()
    progress.load_state_dict(loop)  # 6
    rng = rank_rng(payload, strategy.world_size, strategy.global_rank)  # 7
    data = select_rank_state(payload.get("data"), strategy.dp_rank)
    return Resumed(loop, rng, progress.batch_in_epoch > 0, data)


def _state_of(callback: Any, states: dict[str, Any]) -> Any:
    """``callback``'s saved state, or None. A checkpoint written before the callback's key named its
    settings holds it under the class's name."""
    key = callback.state_key if callback.state_key in states else type(callback).__qualname__
    return states.get(key)


def _callback_states(path: str) -> dict[str, Any]:
    """The callbacks' states in the checkpoint at ``path`` (empty for what cannot be read: the load
    reports that in its own words)."""
    try:
        payload = read_payload(path)
    except Exception:  # noqa: BLE001 - torn, foreign or refused: step 1 raises with the reason
        return {}
    return payload.get("callbacks", {}) if isinstance(payload, dict) else {}


def rank_rng(payload: dict[str, Any], world_size: int, global_rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG state, or None (with a warning) when the checkpoint had another world size."""
    rng = payload.get("rng") or []
    if len(rng) == world_size:
        return rng[global_rank]
    if rng:
        log.warning("checkpoint was written by %d ranks and this job has %d: RNG streams restart from the "
                    "seed, so random ops (dropout, augmentation) will differ from the original run",
                    len(rng), world_size)
    return None


def restore_weights(path: str, strategy: Any, hooks: Hooks) -> None:
    """An evaluation's checkpoint: the weights only (optimizer state is not restored), then the module's
    ``on_load_checkpoint``."""
    payload = strategy.load_checkpoint(path, weights_only=True)
    hooks.module("on_load_checkpoint", payload)
