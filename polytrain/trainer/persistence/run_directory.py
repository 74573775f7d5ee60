"""Where a Trainer's run writes, settled once when a stage starts, identically on every rank.

Each run gets a directory of its own under the root, as Lightning's loggers give one:
``<run_dir>/version_<n>`` (the next free ``n``, claimed by creating the directory exclusively, so runs
started together never share one), or ``<run_dir>/<version>`` when ``trainer.version`` names one; an
evaluation of a new Trainer gets ``<run_dir>/<stage>_<n>``, told apart from trainings. When the first
logger is a file logger built by the user (``TensorBoardLogger(save_dir, name)``), its
``<save_dir>/<name>`` is the root instead, as in Lightning. The run's logs and its ``checkpoints/`` live
there, so a new run never writes over an earlier run's files, never moves its ``latest`` pointer, and
``resume: last`` never mixes two runs' checkpoints. A fit that resumes from a checkpoint of a run under
the root continues that run, in its directory; a later stage of the same Trainer stays where it is.

Global rank 0 looks at the file system and decides; the decision (or the error) reaches every rank by
one broadcast, so file systems that differ between nodes cannot split the ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polytrain.callbacks.loggers import DirectoryLogger
from polytrain.checkpoint.failures import agree_on_error
from polytrain.checkpoint.layout import (
    claim_next_version,
    damage,
    find_resumable,
    holds_files,
    next_version,
    run_of_checkpoint,
    verb_for,
    version_name,
    version_of,
)
from polytrain.core.errors import CheckpointError, ConfigError
from polytrain.core.log_files import is_url
from polytrain.trainer.persistence.resume import choose_checkpoint

if TYPE_CHECKING:
    from polytrain.callbacks.loggers import Logger
    from polytrain.callbacks.model_checkpoint import ModelCheckpoint
    from polytrain.trainer.configuration.config import TrainerConfig

log = logging.getLogger("polytrain")


@dataclass(eq=False, repr=False)  # a bundle of live objects: no comparison, no dump
class RunSources:
    """What decides where a run writes and which checkpoint it resumes: the Trainer's options
    (``run_dir``, ``version``, ``resume``, ``fast_dev_run``), its loggers (the first file logger may name
    the root) and its first ModelCheckpoint (the best checkpoint it kept)."""

    config: TrainerConfig
    loggers: list[Logger]
    checkpoint_callback: ModelCheckpoint | None


@dataclass(frozen=True)
class RunDirectory:
    path: str  # the run's directory: its logs, and its checkpoints under checkpoints/
    resume_from: str | None = None  # the checkpoint a fit continues from (None: a fresh start)
    claimed: bool = False  # this stage created the directory: a failure before anything is written removes it


def discard_if_unused(run: RunDirectory | None, is_global_zero: bool) -> None:
    """After a stage failed: the directory it claimed goes again if nothing was written into it, so failed
    attempts leave no empty ``version_<n>`` behind. Global rank 0, which created it; no collective (the
    other ranks may be gone). The other ranks do not look: rank 0 may be removing it as they list it, and
    their error would hide the stage's own."""
    if run is None or not run.claimed or not is_global_zero:
        return
    with contextlib.suppress(OSError):  # gone already, or a file arrived after all: the run is kept
        if not os.listdir(run.path):
            os.rmdir(run.path)


def run_root(sources: RunSources) -> tuple[str, int | str | None]:
    """The directory runs are versioned under, and the version asked for (None: the next free one)."""
    first = sources.loggers[0] if sources.loggers else None
    # The Trainer's own file loggers have run_dir as their root. A logger writing to a URL does not
    # choose it: the run's checkpoints stay local (core/log_files.py says why).
    if isinstance(first, DirectoryLogger) and not is_url(first.root_dir):
        return first.root_dir, first.asked_version
    return sources.config.run_dir, sources.config.version


def settle_run_directory(strategy: Any, sources: RunSources, stage: str, ckpt_path: str | None,
                         previous: RunDirectory | None) -> RunDirectory:
    """Every rank calls this when a stage starts (it holds one broadcast and, when the run writes, an
    agreement on whether its directory could be created)."""
    decision: Any = None
    if strategy.is_global_zero:
        try:
            decision = _decide(sources, stage, ckpt_path, previous, _writes(sources, stage))
        except Exception as err:  # noqa: BLE001 - every rank raises it, after the broadcast below
            decision = err
    decision = strategy.broadcast(decision)
    if isinstance(decision, BaseException):
        raise decision
    run, versions = decision
    for logger, version in zip(_directory_loggers(sources), versions):
        logger.pin_version(version)
    if _writes(sources, stage):
        _create(strategy, run.path, sources.config.run_dir)
    return run


def _directory_loggers(sources: RunSources) -> list[DirectoryLogger]:
    return [lg for lg in sources.loggers if isinstance(lg, DirectoryLogger)]


def _writes(sources: RunSources, stage: str) -> bool:
    """Whether the stage writes into the run's directory: its loggers do, or a fit's ModelCheckpoint that
    was given no ``dirpath`` of its own (with ``logger=False`` and a ``dirpath``, as in Lightning, nothing
    but the checkpoints is written)."""
    if sources.config.fast_dev_run:
        return False
    checkpoints = sources.checkpoint_callback
    return bool(sources.loggers) or (stage == "fit" and checkpoints is not None
                                     and checkpoints.writes_into_run_directory)


def _decide(sources: RunSources, stage: str, ckpt_path: str | None, previous: RunDirectory | None,
            writes: bool) -> tuple[RunDirectory, list[int | str]]:
    """Global rank 0 only: the run's directory, the checkpoint a fit resumes from, each file logger's version.
    A run that writes claims a new version directory as it picks it."""
    root, version = run_root(sources)
    run_dir = sources.config.run_dir
    claimed, kind = False, "version"
    choice = ckpt_path if ckpt_path is not None else sources.config.resume
    resume_from = resolve_path(sources, choice, ckpt_path is not None) if stage == "fit" else None
    adopted = run_of_checkpoint(resume_from, root) if resume_from is not None else None
    if adopted:  # a run under the root: continue it there
        path = os.path.join(root, adopted)
    elif previous is not None:
        path = previous.path
    elif version is not None:
        path = os.path.join(root, version_name(version))
        existing = holds_files(path)
        if stage == "fit" and choice is None and existing:  # resume: auto/last into it continues it
            raise ConfigError(
                f"version {version!r}: {path} already holds a run ({', '.join(existing)}); a fresh fit there "
                f"would write over its files. Continue that run with resume=last (ckpt_path='last'), pick "
                f"another version (the next free one is version_{next_version(root)}), or leave the version "
                f"unset")
    else:  # a new run: a fit is a version_<n>; an evaluation of a new Trainer a <stage>_<n>, told apart
        kind = "version" if stage == "fit" else stage
        path = os.path.join(root, version_name(_new_version(root, writes, kind, run_dir)))
        claimed = writes
    name = version_of(os.path.basename(path))
    versions = [name if os.path.abspath(lg.root_dir) == os.path.abspath(root)
                else lg.asked_version if lg.asked_version is not None
                else _new_version(lg.root_dir, writes, kind, run_dir)
                for lg in _directory_loggers(sources)]
    return RunDirectory(path, resume_from, claimed), versions


def _new_version(root: str, claim: bool, kind: str, run_dir: str) -> int | str:
    """The next free ``<kind>_<n>`` under ``root`` (``version_<n>`` as the number ``n``, Lightning's version),
    claimed (its directory created, exclusively) when ``claim``."""
    try:
        # A logger's URL is numbered, not claimed: an object store has no exclusive directory creation.
        if claim and not is_url(root):
            name = claim_next_version(root, kind)
        else:
            name = f"{kind}_{next_version(root, kind)}"
    except OSError as err:
        raise CheckpointError(_unwritable(run_dir, root, err)) from None
    return version_of(name)


def resolve_path(sources: RunSources, choice: str | None, argument: bool = False,
                 stage: str = "fit") -> str | None:
    """``resume.choose_checkpoint`` for a Trainer's run (global rank 0): its root and version, and the
    best checkpoint its ModelCheckpoint kept. ``last``/``auto`` look first where that ModelCheckpoint
    writes when it was given a ``dirpath`` of its own (the newest complete checkpoint there, by the step
    recorded inside), as Lightning's ``ckpt_path="last"`` looks in its callbacks' directories."""
    root, version = run_root(sources)
    callback = sources.checkpoint_callback
    if choice in ("last", "auto") and callback is not None and not callback.writes_into_run_directory:
        path = find_resumable(callback.dirpath)
        if path is not None:
            log.info("ckpt_path=%r: %s from %s, the newest checkpoint in ModelCheckpoint's dirpath", choice,
                     "continuing" if stage == "fit" else stage, path)
            return path
    kept = getattr(callback, "best_model_path", None)
    return choose_checkpoint(choice, root, version, kept, from_argument=argument, stage=stage)


def checkpoint_for_launch(stage: str, ckpt: str | None, config: TrainerConfig) -> str | None:
    """The launching process's check of a stage's checkpoint, before any worker starts: ``--ckpt`` (for a
    fit, else ``trainer.resume``) resolved as the workers will resolve it, so a missing, damaged or absent
    checkpoint is one line and exit 2, not a traceback from every worker. Returns what the workers take:
    for an evaluation the resolved path (``best`` from the run's records then means the same file on every
    rank); for a fit the choice as given (a restarted fit resolves ``last``/``auto`` again, to the newest
    checkpoint of that moment). Where loggers given as objects choose the root, only a path is checked."""
    choice = ckpt if ckpt is not None else (config.resume if stage == "fit" else None)
    if choice is None:
        return ckpt
    root, version = config.run_dir, config.version
    if choice in ("last", "auto", "best") and _loggers_choose_the_root(config):
        return ckpt
    # A fit's workers resolve the choice again and name the file they take: said here, it would be said twice.
    path = choose_checkpoint(choice, root, version, from_argument=ckpt is not None, stage=stage,
                             say=stage != "fit")
    why = damage(path) if path is not None and choice not in ("last", "auto") else None  # last/auto: verified
    if why is not None:
        raise ConfigError(f"the checkpoint to {verb_for(stage)} cannot be used: {why}")
    return ckpt if stage == "fit" else path


def check_run_dir_for_launch(config: TrainerConfig) -> None:
    """The launching process's look at ``trainer.run_dir`` before any worker starts: a path through a file, or
    under a directory it cannot write, is one line and exit 2, not the same error from every worker. It
    creates nothing (rank 0 does, once the ranks agree on the run's directory)."""
    if config.fast_dev_run or _loggers_choose_the_root(config):
        return
    path = os.path.abspath(config.run_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    problem: OSError | None = None
    if not os.path.isdir(existing):
        problem = NotADirectoryError(20, f"{existing} is a file")
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = PermissionError(13, f"{existing} is not writable")
    if problem is not None:
        raise ConfigError(_unwritable(config.run_dir, path, problem))


def _loggers_choose_the_root(config: TrainerConfig) -> bool:
    loggers = config.logger if isinstance(config.logger, (list, tuple)) else [config.logger]
    return any(not isinstance(lg, (str, bool, type(None))) for lg in loggers)


def _create(strategy: Any, path: str, run_dir: str) -> None:
    """Create the run's directory before the first step: an unwritable path then fails at once, with one
    clear error on every rank, instead of after an epoch inside a logger on one rank only."""
    error = None
    if strategy.is_global_zero or strategy.is_logging_rank:
        try:
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as err:
            error = _unwritable(run_dir, path, err)
    agree_on_error(error, strategy.collective_device)


def _unwritable(run_dir: str, path: str, err: OSError) -> str:
    return (f"cannot write trainer.run_dir={run_dir} (this run's directory: {path}): "
            f"{err.strerror or err}. Point trainer.run_dir at a writable directory")
