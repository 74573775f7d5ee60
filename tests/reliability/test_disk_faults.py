"""Requirement 4, disk faults: a full file system and a file-size limit during sync and async saves.

Real faults (``scripts/disk_fault.py``): a small tmpfs, mounted in the job's own mount namespace, filled
until the OS says ENOSPC; ``RLIMIT_FSIZE`` lowered on the rank that writes (under fsdp rank 1, so the
message must name the right rank), giving EFBIG. On single, ddp x2 and fsdp x2, sync and async saves:

- every rank raises the same ``CheckpointError``, one line, naming the OS error (``No space left on
  device (ENOSPC)``, ``File too large (EFBIG)``), the kind (file or sharded), the checkpoint's path, the
  rank that failed, and how many bytes the checkpoint needs;
- the previous checkpoint is intact and nothing partial is visible (no hidden temporary left);
- ``resume: last`` continues from it and ends bitwise equal to a run that met no fault.
"""

from __future__ import annotations

import json
import os

import pytest

from .conftest import DISK_FAULT_STRATEGIES
from .helpers import Done, figure, pick

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]

CAUSE = {"enospc": "No space left on device (ENOSPC): it needs about ",
         "efbig": "File too large (EFBIG): it needs about "}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fault", ["efbig", "enospc"])
@pytest.mark.parametrize("strategy", [s for s, _ in DISK_FAULT_STRATEGIES])
def test_disk_fault_is_named_on_every_rank_and_nothing_is_lost(jobs: dict[str, Done], strategy: str,
                                                               fault: str) -> None:
    done = pick(jobs, f"disk/{strategy}")[0]
    if fault == "enospc" and not done.job.meta["full_fs"]:
        pytest.skip("no mount namespace can be made here (unshare -m / -rm), so no file system to fill")
    assert done.returncode == 0 and not done.timed_out, done.output[-4000:]
    with open(os.path.join(done.job.out_dir, "results.json"), encoding="utf-8") as fh:
        ranks = json.load(fh)
    kind = "sharded checkpoint" if strategy == "fsdp" else "checkpoint file"
    lines = []
    for mode in ("sync", "async"):
        case = f"{fault}-{mode}"
        errors = [r["cases"][case]["error"] for r in ranks]
        first = ranks[0]["cases"][case]
        failing = ranks[0]["failing_rank"] if fault == "efbig" else 0  # a full disk: rank 0 meets it first
        assert errors[0] is not None and len(set(errors)) == 1, (case, errors)
        message = errors[0]
        assert ("\n" not in message
                and message.startswith(f"checkpoint failed on rank {failing}: cannot write {kind} ")), message
        assert CAUSE[fault] in message and "step=4" in message, message
        assert (first["after_fault"]["complete"]
                and all("step=2" in n for n in first["after_fault"]["complete"])), first
        assert not [n for n in first["after_fault"]["names"] if n.startswith(".")], first["after_fault"]
        assert all(r["cases"][case]["resumed_to"] == 8 for r in ranks)
        assert first["bitwise"], case
        lines.append(f"{mode}: rank {failing}: {message[message.index(CAUSE[fault]):][:110]}")
    figure(f"{fault} during a save, {strategy}",
           f"same one-line error on {len(ranks)} rank(s), previous checkpoint "
           f"intact, resume bitwise; {' | '.join(lines)}")
