"""Seeding and RNG state capture (stored as plain types and tensors so checkpoints load with
``weights_only=True``).

The rule polytrain follows (docs/reproducibility.md): with no ``trainer.seed`` it never reseeds, so
one process draws exactly what the user's own loop seeded the same way draws. Everything built
before training (``__init__``, ``prepare_data``, ``setup``, ``*_dataloader``) sees one stream on every
rank (rank 0's, shared when the job starts); training steps then get a stream per data-parallel
rank (``fork_stream``), so dropout differs between replicas but not between tensor- or
pipeline-parallel peers of one replica. Inside a sharded region (between a column- and a
row-parallel layer, where each tensor-parallel peer holds other columns) dropout runs under
``sharded_rng()``: a second stream per global rank, as Megatron's RNG tracker."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Iterator
from typing import Any

import torch

try:  # optional: seeded and checkpointed when installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with most torch installs
    np = None


SEED_VARIABLE = "PL_GLOBAL_SEED"  # Lightning's: where seed_everything leaves its seed for every process


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's, numpy's and torch's generators, and leave the seed in ``PL_GLOBAL_SEED`` (Lightning's
    signature; ``seed=None`` reads ``PL_GLOBAL_SEED``, else 0). A user who calls it has asked for
    Lightning's seeding: a multi-process stage re-seeds every process from it (``user_seed``).
    ``workers`` is accepted for Lightning code: DataLoader workers get torch's per-worker seeds from the
    seeded base seed either way."""
    if seed is None:
        seed = int(os.environ.get(SEED_VARIABLE, os.environ.get("POLYTRAIN_SEED", "0")))
    os.environ[SEED_VARIABLE] = os.environ["POLYTRAIN_SEED"] = str(seed)
    seed_all(seed)
    return seed


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (``trainer.seed``'s seeding: no variable is left)."""
    random.seed(seed)
    seed_torch(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


def user_seed() -> int | None:
    """The seed the user gave ``seed_everything`` in this process (or its launcher), or None."""
    value = os.environ.get(SEED_VARIABLE)
    return int(value) if value not in (None, "") else None


def seed_torch(seed: int) -> None:
    """``torch.manual_seed``: the CPU generator and every accelerator's. Where no accelerator is available
    only the CPU generator is seeded: torch would also queue a seed, with the caller's stack trace, for each
    device kind that cannot start, at least twice per fit."""
    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _SHARDED:
        state["sharded"] = dict(_SHARDED)
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "sharded" in state:
        _SHARDED.clear()
        _SHARDED.update(state["sharded"])
    if "numpy" in state and np is not None:
        npst = state["numpy"]
        np.random.set_state((npst["kind"], npst["keys"].numpy().astype("uint32"), npst["pos"],
                             npst["has_gauss"], npst["cached"]))


def enable_deterministic(warn_only: bool = False) -> None:
    """Deterministic kernels only (an error names any op without one; ``warn_only``: a warning); cuBLAS
    needs a fixed workspace for that, which must be set before the first CUDA matmul."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.benchmark = False


class isolate_rng:  # noqa: N801 - used like a function, as torch.random.fork_rng
    """Save the torch (CPU and initialised CUDA), Python and numpy RNG states; restore them on exit.
    Whatever ran inside leaves no trace in the random streams (the sanity check)."""

    def __enter__(self) -> None:
        self._state = capture_rng_state()

    def __exit__(self, *exc: Any) -> None:
        restore_rng_state(self._state)


def training_streams(seed: int | None, dp_rank: int, global_rank: int,
                     lightning_seed: int | None = None) -> None:
    """The streams training steps draw from (called once, before the first training batch).

    The default stream becomes per data-parallel rank: ``fork_stream(dp_rank)`` with no seed, else
    ``seed_all(seed + dp_rank)``. The sharded-region stream (``sharded_rng``) is per global rank:
    seeded ``seed + SHARDED_SEED_OFFSET + global_rank``, or, with no seed, from a hash of the shared
    stream and the rank (nothing is drawn from the default stream for it). ``lightning_seed`` (no
    ``seed``; the user called ``seed_everything``): Lightning's seeding, where every rank keeps the one
    stream it was re-seeded with, so replicas draw what Lightning's draw."""
    if seed is None and lightning_seed is not None:
        seed_sharded_stream(lightning_seed + SHARDED_SEED_OFFSET + global_rank)
    elif seed is None:
        seed_sharded_stream(_derived_seed(b"sharded", global_rank))
        fork_stream(dp_rank)
    else:
        seed_all(seed + dp_rank)
        seed_sharded_stream(seed + SHARDED_SEED_OFFSET + global_rank)


def _derived_seed(tag: bytes, rank: int) -> int:
    """A seed from the current (shared) torch state, ``tag`` and ``rank``: the same on every run."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + tag
                            + rank.to_bytes(4, "little")).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def fork_stream(rank: int) -> None:
    """Give data-parallel rank ``rank`` a stream of its own, derived from the current (shared) one.

    Rank 0 keeps the stream untouched, so one process draws exactly what the user's own loop would.
    Other ranks reseed torch, Python and numpy from a hash of the shared state and their rank: the
    same on every run, different for every rank."""
    if rank == 0:
        return
    seed = _derived_seed(b"", rank)
    random.seed(seed)
    seed_torch(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


# --------------------------------------------------------------------------- sharded-region stream
# Megatron's rule for tensor parallelism: tensor-parallel peers (one data-parallel rank) share the
# default stream, so they draw identical masks on the replicated activations they all hold (or their
# replicated parameters get different gradients and drift apart); a sharded activation is different
# columns on every peer, so its dropout draws from this second stream, seeded per global rank.
# Its state travels with the other RNG states (``capture_rng_state``), so checkpoints hold it.
SHARDED_SEED_OFFSET = 2718  # Megatron's offset between the two streams
_SHARDED: dict[str, Any] = {}  # {"seed": int, "torch": CPU state, "cuda": state once used on CUDA}


def seed_sharded_stream(seed: int) -> None:
    gen = torch.Generator()
    gen.manual_seed(seed)
    _SHARDED.clear()
    _SHARDED.update(seed=int(seed), torch=gen.get_state())


@contextlib.contextmanager
def sharded_rng() -> Iterator[None]:
    """Random ops inside draw from this rank's sharded-region stream; the default stream then
    continues exactly where it was (Megatron's ``get_cuda_rng_tracker().fork()``). Before a Trainer
    seeded the stream (outside ``fit``), the default stream is used."""
    if not _SHARDED:
        yield
        return
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    saved = torch.get_rng_state()
    torch.set_rng_state(_SHARDED["torch"])
    if cuda:
        saved_cuda = torch.cuda.get_rng_state()
        if "cuda" in _SHARDED:
            torch.cuda.set_rng_state(_SHARDED["cuda"])
        else:
            torch.cuda.manual_seed(_SHARDED["seed"])
    try:
        yield
    finally:
        _SHARDED["torch"] = torch.get_rng_state()
        torch.set_rng_state(saved)
        if cuda:
            _SHARDED["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved_cuda)
