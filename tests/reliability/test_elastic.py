"""Requirement 1: elastic restart resumes by itself, bitwise.

Under ``torchrun --max-restarts=2`` and ``polytrain fit trainer.max_restarts=2`` a worker SIGKILLs
itself in ``training_step`` after step 5 on the first attempt. The agent restarts every worker;
``resume: auto`` finds the newest complete checkpoint (step 4, from ``every_n_train_steps=2``)
and the job finishes with weights BITWISE equal to an uninterrupted run. Rank 0 (which also
hosts the job's store) and rank 1 are killed in separate trials.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import KILL_STEP
from .helpers import Done, bitwise_equal, events, figure, final_state, pick

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]


def _check_trial(done: Done, reference: dict[str, Any]) -> str | None:
    """None if the trial recovered exactly; else why not."""
    if done.timed_out or done.returncode != 0:
        return f"rc={done.returncode} timed_out={done.timed_out}: {done.output[-3000:]}"
    killed = done.job.meta["rank"]
    kills = [e for e in events(done.job.out_dir, killed) if e["event"] == "killing"]
    if len(kills) != 1 or kills[0]["step"] != KILL_STEP:
        return f"rank {killed} did not kill itself once at step {KILL_STEP}: {kills}"
    if f"local_rank: {killed}" not in done.output or "exitcode: -9" not in done.output:
        return "the agent did not report the SIGKILLed rank"
    for rank in (0, 1):
        resumed = [e for e in events(done.job.out_dir, rank) if e["event"] == "resumed"]
        if [(e["attempt"], e["step"]) for e in resumed] != [(1, KILL_STEP - 1)]:
            return f"rank {rank} did not resume once, on attempt 1, from step {KILL_STEP - 1}: {resumed}"
        if not bitwise_equal(final_state(done.job.out_dir, rank), reference):
            return f"rank {rank}'s final weights differ from the uninterrupted run"
    return None


def _scenario(jobs: dict[str, Done], prefix: str, label: str) -> None:
    reference_job = pick(jobs, "elastic/reference")[0]
    assert reference_job.returncode == 0, reference_job.output[-3000:]
    reference = final_state(reference_job.job.out_dir, 0)
    assert bitwise_equal(reference, final_state(reference_job.job.out_dir, 1))
    trials = pick(jobs, prefix)
    failures = {d.job.name: why for d in trials if (why := _check_trial(d, reference)) is not None}
    recovered = len(trials) - len(failures)
    seconds = sorted(d.seconds for d in trials)
    figure(label, f"recovered {recovered}/{len(trials)} bitwise (SIGKILL at step {KILL_STEP}, "
                  f"resumed from step {KILL_STEP - 1}; job wall time median "
                  f"{seconds[len(seconds) // 2]:.0f}s)",
           recovered=recovered, trials=len(trials))
    assert not failures, failures


@pytest.mark.timeout(1800)
def test_torchrun_restart_after_rank0_sigkill_is_bitwise(jobs: dict[str, Done]) -> None:
    _scenario(jobs, "elastic/torchrun/rank0/", "elastic restart, torchrun, rank 0 SIGKILLed")


@pytest.mark.timeout(1800)
def test_torchrun_restart_after_rank1_sigkill_is_bitwise(jobs: dict[str, Done]) -> None:
    _scenario(jobs, "elastic/torchrun/rank1/", "elastic restart, torchrun, rank 1 SIGKILLed")


@pytest.mark.timeout(1800)
def test_cli_max_restarts_after_rank0_sigkill_is_bitwise(jobs: dict[str, Done]) -> None:
    _scenario(jobs, "elastic/cli/rank0/", "elastic restart, polytrain fit max_restarts, rank 0 SIGKILLed")


@pytest.mark.timeout(1800)
def test_cli_max_restarts_after_rank1_sigkill_is_bitwise(jobs: dict[str, Done]) -> None:
    _scenario(jobs, "elastic/cli/rank1/", "elastic restart, polytrain fit max_restarts, rank 1 SIGKILLed")
