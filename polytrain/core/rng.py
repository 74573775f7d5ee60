"""Seeding and RNG state capture (stored as plain types and tensors so checkpoints load with
``weights_only=True``).

The rule polytrain follows (docs/reproducibility.md): with no ``trainer.seed`` it never reseeds, so
one process draws exactly what the user's own loop seeded the same way draws. Everything built
before training (``__init__``, ``prepare_data``, ``setup``, ``*_dataloader``) sees one stream on every
rank (rank 0's, shared when the job starts); training steps then get a stream per data-parallel
rank (``fork_stream``), so dropout differs between replicas but not between tensor- or
pipeline-parallel peers of one replica."""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import torch

try:  # optional: seeded and checkpointed when installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with most torch installs
    np = None


def seed_everything(seed: int) -> int:
    os.environ["PL_GLOBAL_SEED"] = os.environ["POLYTRAIN_SEED"] = str(seed)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if np is not None:
        np.random.seed(seed % 2**32)
    return seed


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
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
    if "numpy" in state and np is not None:
        npst = state["numpy"]
        np.random.set_state((npst["kind"], npst["keys"].numpy().astype("uint32"), npst["pos"],
                             npst["has_gauss"], npst["cached"]))


def enable_deterministic() -> None:
    """Deterministic kernels only (an error names any op without one); cuBLAS needs a fixed
    workspace for that, which must be set before the first CUDA matmul."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


class isolate_rng:  # noqa: N801 - used like a function, as torch.random.fork_rng
    """Save the torch (CPU and initialised CUDA), Python and numpy RNG states; restore them on exit.
    Whatever ran inside leaves no trace in the random streams (the sanity check)."""

    def __enter__(self) -> None:
        self._state = capture_rng_state()

    def __exit__(self, *exc: Any) -> None:
        restore_rng_state(self._state)


def fork_stream(rank: int) -> None:
    """Give data-parallel rank ``rank`` a stream of its own, derived from the current (shared) one.

    Rank 0 keeps the stream untouched, so one process draws exactly what the user's own loop would.
    Other ranks reseed torch, Python and numpy from a hash of the shared state and their rank: the
    same on every run, different for every rank."""
    if rank == 0:
        return
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + rank.to_bytes(4, "little")).digest()
    seed = int.from_bytes(digest[:8], "little") % 2**63
    random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA device
    if np is not None:
        np.random.seed(seed % 2**32)
