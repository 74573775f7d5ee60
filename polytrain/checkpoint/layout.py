"""Where runs and their checkpoints live, and which checkpoint a run resumes from.

Each run writes into its own version directory under the root (``<run_dir>/version_N``, or the name
the user gave), as Lightning's loggers do, so a new run never writes over an earlier one's files.
``<version>/checkpoints/`` holds ``.ckpt`` files (replicated strategies) and DCP directories (sharded
ones); a ``latest`` file names the newest one written. ``resume: last`` takes the run written most
recently that holds a complete checkpoint, and in it the newest *complete* one: verified against its
checksums (``integrity``: a file's zip records, a directory's manifest) and loadable. A torn or damaged
newer one is skipped with a warning naming it, never loaded. A root that holds ``checkpoints/`` itself
(written before runs were versioned) is a run too.

When checkpoints exist but none is complete, ``last`` refuses to start (it means "continue"), naming
what it found, and so does the config's ``resume: last`` when there is no checkpoint at all; ``resume:
auto`` starts fresh. Only Lightning's ``fit(ckpt_path="last")`` with no checkpoint at all warns and
starts fresh, as Lightning does.

A new run's version directory is claimed by creating it exclusively (``claim_next_version``): two runs
started together into one root never get the same ``version_N``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from polytrain.checkpoint.integrity import verify_directory, verify_file
from polytrain.checkpoint.reading import META_FILE
from polytrain.checkpoint.unpickler import METADATA_FILE
from polytrain.core.errors import CheckpointError, ConfigError, first_few
from polytrain.core.files import replace_text
from polytrain.core.log_files import list_names

log = logging.getLogger("polytrain")

LATEST_POINTER = "latest"


_VERSION = re.compile(r"^version_(\d+)$")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def version_name(version: int | str) -> str:
    """Lightning's rule: a number is ``version_<n>``, a string is the directory's name as given."""
    return version if isinstance(version, str) else f"version_{version}"


def next_version(root: str, kind: str = "version") -> int:
    """One more than the highest ``<kind>_<n>`` under ``root`` (0 for none): never an existing one.
    ``root`` may be a logger's URL (``log_files``)."""
    pattern = re.compile(rf"^{re.escape(kind)}_(\d+)$")
    taken = [int(m.group(1)) for m in map(pattern.match, list_names(root)) if m is not None]
    return max(taken) + 1 if taken else 0


def claim_next_version(root: str, kind: str = "version") -> str:
    """Create ``<root>/<kind>_<n>`` for the next free ``n`` and return its name. The directory is created
    exclusively: when another run created that one first (runs started together), the next ``n`` is
    tried, so no two runs ever share a directory. ``kind``: ``version`` for a fit (Lightning's name),
    ``validate``/``test``/``predict`` for an evaluation of a new Trainer, told apart from trainings."""
    os.makedirs(root, exist_ok=True)
    n = next_version(root, kind)
    while True:
        try:
            os.mkdir(os.path.join(root, f"{kind}_{n}"))
            return f"{kind}_{n}"
        except FileExistsError:
            n += 1


def version_of(name: str) -> int | str:
    """``version_3`` -> 3; any other directory name as it is."""
    match = _VERSION.match(name)
    return int(match.group(1)) if match else name


def run_of_checkpoint(path: str, root: str) -> str | None:
    """The run directory under ``root`` that ``path`` (``<run>/checkpoints/<name>``) belongs to: a
    version directory's name, ``""`` for the root's own ``checkpoints/``, None for elsewhere."""
    run = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if os.path.basename(os.path.dirname(os.path.abspath(path))) != "checkpoints":
        return None
    if run == os.path.abspath(root):
        return ""
    return os.path.basename(run) if os.path.dirname(run) == os.path.abspath(root) else None


def holds_files(path: str) -> list[str]:
    """What a run directory holds (hidden files aside): empty for a fresh or absent one."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def damage(path: str) -> str | None:
    """Why ``path`` is not a complete checkpoint (None: it is). A file: its records match their CRC-32s
    and it loads (weights only); a sharded directory: DCP's metadata and the payload are there and every
    file matches the manifest's size and checksum."""
    try:
        if os.path.isdir(path):
            missing = [n for n in (METADATA_FILE, META_FILE) if not os.path.exists(os.path.join(path, n))]
            if missing:
                return f"{', '.join(missing)} missing"
            verify_directory(path)
            return None
        verify_file(path)
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return None
    except CheckpointError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - torn, truncated or refused: not a resume candidate
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def is_complete(path: str) -> bool:
    return damage(path) is None


def candidates(ckpt_dir: str) -> list[str]:
    """Checkpoints in ``ckpt_dir``, newest first by the step recorded inside each (file times lie once a
    run is copied); on a tie the one the ``latest`` pointer names, then the newest file. A checkpoint
    whose step cannot be read (a torn file) is placed by the step in its name, so it is tried, found
    damaged and named, where it would have stood."""
    if not os.path.isdir(ckpt_dir):
        return []
    entries = [os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir)
               if not n.startswith(".") and n != LATEST_POINTER
               and (n.endswith(".ckpt") or os.path.isdir(os.path.join(ckpt_dir, n)))]
    pointer, named = os.path.join(ckpt_dir, LATEST_POINTER), None
    if os.path.exists(pointer):
        with open(pointer, encoding="utf-8") as fh:
            named = os.path.join(ckpt_dir, fh.read().strip())
    steps = {path: recorded_step(path) for path in entries}
    entries.sort(key=lambda p: (steps[p], p == named, os.path.getmtime(p)), reverse=True)
    return entries


_NAMED_STEP = re.compile(r"step=(\d+)")


def read_payload(path: str) -> Any:
    """A checkpoint's payload without reading its tensors: a file's pickle with them memory-mapped, or a
    directory's payload file."""
    if os.path.isdir(path):
        return torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def holds_weights_only(path: str) -> bool:
    """Whether the checkpoint was written with ``weights_only`` (no optimizer, scheduler or callback state:
    it can start a fit's weights, not resume one). False for what cannot be read: its loader will say why."""
    try:
        data = read_payload(path)
    except Exception:  # noqa: BLE001 - torn, foreign or refused: the load reports it in its own words
        return False
    return isinstance(data, dict) and bool(data.get("weights_only"))


def recorded_step(path: str) -> int:
    """The global step a checkpoint was written at: its loop state (a file's pickle, read with its tensors
    memory-mapped, or a directory's payload), else the ``step=N`` in its name, else -1."""
    try:
        data = read_payload(path)
        loop = data.get("loop") if isinstance(data, dict) else None
        step = loop.get("global_step") if isinstance(loop, dict) else data.get("global_step")
        return int(step)
    except Exception:  # noqa: BLE001 - torn, foreign or refused: its name says what it was
        found = _NAMED_STEP.findall(os.path.basename(path))
        return int(found[-1]) if found else -1


def find_resumable(ckpt_dir: str, rejected: list[str] | None = None) -> str | None:
    """The newest complete checkpoint; a torn or damaged newer one is skipped with a warning naming it
    (and added to ``rejected``, with why)."""
    for i, path in enumerate(candidates(ckpt_dir)):
        why = damage(path)
        if why is None:
            if i:
                log.warning("resuming from %s: %d newer checkpoint(s) in %s are incomplete or corrupt",
                            path, i, ckpt_dir)
            return path
        log.warning("checkpoint %s is incomplete or corrupt (%s); trying an older one", path, why)
        if rejected is not None:
            rejected.append(f"{os.path.basename(path)} ({why})")
    return None


def write_latest_pointer(ckpt_dir: str, path: str) -> None:
    replace_text(os.path.join(ckpt_dir, LATEST_POINTER), os.path.basename(path))


def runs_newest_first(root: str) -> list[str]:
    """The run directories under ``root`` that hold checkpoints, the most recently written first."""
    runs = [os.path.join(root, n) for n in holds_files(root)
            if os.path.isdir(checkpoint_dir(os.path.join(root, n)))]
    if os.path.isdir(checkpoint_dir(root)):
        runs.append(root)

    def written(run: str) -> float:
        found = candidates(checkpoint_dir(run))
        return os.path.getmtime(found[0]) if found else 0.0

    return sorted(runs, key=written, reverse=True)


# What a checkpoint is taken for, as the messages say it.
_VERBS = {"fit": "resume from", "validate": "validate", "test": "test", "predict": "predict with"}


def verb_for(stage: str) -> str:
    return _VERBS.get(stage, stage)


def newest_resumable(root: str, version: int | str | None,
                     rejected: list[str] | None = None) -> tuple[str, str] | None:
    """(run directory, checkpoint) that ``resume: last`` takes: in run ``version`` when given, else in the run
    under ``root`` written most recently that holds a complete checkpoint; None when there is none.
    ``rejected`` collects why the checkpoints passed over cannot be loaded."""
    runs = [os.path.join(root, version_name(version))] if version is not None else runs_newest_first(root)
    for run in runs:
        path = find_resumable(checkpoint_dir(run), rejected if rejected is not None else [])
        if path is not None:
            return run, path
    return None


def resolve_resume(resume: str | None, root: str, version: int | str | None = None,
                   last_may_start_fresh: bool = False, stage: str = "fit", say: bool = True) -> str | None:
    """``None`` | ``"last"`` | ``"auto"`` | a path -> the checkpoint to load (or None). ``last``/``auto``
    look in one run: ``version`` when given, else the run under ``root`` written most recently that
    holds a complete checkpoint; the log says which run and which file. ``last`` with nothing to load
    raises, unless ``last_may_start_fresh`` and there is no checkpoint at all (Lightning's
    ``ckpt_path="last"``). ``stage``: what the checkpoint is for (the words of the log and errors); ``say``:
    whether the log names the file (not in the launcher's check of a fit: its workers name what they take)."""
    if resume is None:
        return None
    verb = verb_for(stage)
    if resume in ("last", "auto"):
        rejected: list[str] = []
        newest = newest_resumable(root, version, rejected)
        if newest is not None:
            run, path = newest
            if say and stage == "fit":
                log.info("resume=%r: continuing the run in %s, %s", resume, run, os.path.basename(path))
            elif say:
                log.info("ckpt_path=%r: %s: the newest checkpoint of the run in %s, %s", resume, stage,
                         run, os.path.basename(path))
            return path
        where = os.path.join(root, version_name(version)) if version is not None else root
        if resume == "last" and last_may_start_fresh and stage == "fit" and not rejected:
            if say:
                log.warning("ckpt_path='last' but %s holds no checkpoint; starting from scratch", where)
            return None
        if resume == "last" or stage != "fit":
            found = "it holds no checkpoint"
            if rejected:
                found = f"its checkpoints cannot be loaded: {'; '.join(rejected)}"
            if stage == "fit":
                raise ConfigError(f"resume='last' continues a run, but there is nothing to continue in "
                                  f"{where}: {found}. Start fresh with resume=auto (a fresh start when there "
                                  f"is no checkpoint) or no resume, or name a checkpoint file")
            raise ConfigError(f"ckpt_path={resume!r}: there is no checkpoint to {verb} in {where}: {found}. "
                              f"Fit first, or name a checkpoint file")
        if rejected:
            log.warning("resume='auto': no checkpoint under %s can be loaded (%s); starting from scratch",
                        root, "; ".join(rejected))
        return None
    if not os.path.exists(resume):
        raise ConfigError(f"the checkpoint to {verb} does not exist: {resume}. {existing_checkpoints(root)}")
    return resume


def existing_checkpoints(root: str, limit: int = 6) -> str:
    """One sentence naming the checkpoints under ``root`` (the newest run's first), for an error."""
    found = [os.path.relpath(path, root) for run in runs_newest_first(root)
             for path in candidates(checkpoint_dir(run))]
    if not found:
        return f"There is no checkpoint under {root}"
    return f"Checkpoints under {root}: {first_few(found, limit)}"


def recorded_best(root: str, version: int | str | None = None) -> str | None:
    """The best checkpoint a run's ModelCheckpoint recorded (in the state its newest complete checkpoint
    holds), when it still exists: ``ckpt_path="best"`` in a process that did not run the fit."""
    runs = [os.path.join(root, version_name(version))] if version is not None else runs_newest_first(root)
    for run in runs:
        newest = find_resumable(checkpoint_dir(run))
        if newest is None:
            continue
        try:
            meta = os.path.join(newest, META_FILE) if os.path.isdir(newest) else newest
            payload = torch.load(meta, map_location="cpu", weights_only=True, mmap=not os.path.isdir(newest))
        except Exception:  # noqa: BLE001 - complete a moment ago; a file replaced since is no record
            continue
        for key, state in (payload.get("callbacks") or {}).items():
            recorded = key.startswith("ModelCheckpoint") and isinstance(state, dict)
            best = state.get("best_model_path") if recorded else None
            if best and os.path.exists(best):
                return best
    return None
