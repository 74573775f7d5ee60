"""Lightning parity in the details real projects hit (``detail_modules.py``), compared with Lightning after
every Trainer call: the hook calls (with the global RNG at each, on one process), losses, weights and
buffers, ``callback_metrics``/``logged_metrics``/``progress_bar_metrics``, and the CSV logger's rows read
back from the file.

CSV rows are compared value for value and in order, ``epoch`` included. Two differences are documented
(docs/migrating-from-lightning.md) and allowed here: a row logged inside a fit carries polytrain's step
(optimizer steps counted from 1), one more than Lightning's (from 0); polytrain adds one row of its own
``goodput/*`` columns when a fit ends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from compat import harness  # noqa: E402 - after the skip on purpose
from compat.test_lightning_compat import assert_same_run  # noqa: E402

pytestmark = pytest.mark.own_logic

ONE_CYCLE = ("onecycle", {}, dict(max_epochs=2), ["fit"])
FIT_THEN_TEST = ("fit_then_test", {}, dict(max_epochs=2), ["fit", "test"])
SECOND_FIT = ("second_fit", {}, dict(max_epochs=1), ["fit", ("call", {"fn": "next_phase"}), "fit"])


def _run(framework: str, spec: tuple, **kwargs: Any) -> harness.RunResult:
    case, case_kwargs, trainer_kwargs, stages = spec
    return harness.run_case(framework, case, case_kwargs=case_kwargs, trainer_kwargs=trainer_kwargs,
                            stages=stages, **kwargs)


def _run_ddp(framework: str, spec: tuple, seed: int = 0) -> list[harness.RunResult]:
    case, case_kwargs, trainer_kwargs, stages = spec
    return harness.run_case_distributed(framework, case, 2, case_kwargs=case_kwargs,
                                        trainer_kwargs=trainer_kwargs, stages=stages, seed=seed, timeout=300)


def _rows(rows: list[dict[str, str]] | None) -> list[dict[str, str]]:
    """The CSV's rows without polytrain's goodput columns (and the row holding only those)."""
    kept = [{k: v for k, v in row.items() if not k.startswith("goodput/")} for row in rows or []]
    return [row for row in kept if any(v != "" for k, v in row.items() if k != "step")]


def assert_same_rows(lightning: list[dict[str, str]] | None, polytrain: list[dict[str, str]] | None) -> None:
    theirs, ours = _rows(lightning), _rows(polytrain)
    assert theirs and len(ours) == len(theirs), (theirs, ours)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert ({k: v for k, v in a.items() if k != "step"}
                == {k: v for k, v in b.items() if k != "step"}), (i, a, b)
        assert int(b["step"]) - int(a["step"]) in (0, 1), (i, a, b)  # polytrain counts a fit's steps from 1


def assert_same_after_every_call(lightning: harness.RunResult, polytrain: harness.RunResult) -> None:
    calls_a, calls_b = lightning.extra["after_stage"], polytrain.extra["after_stage"]
    assert [c["stage"] for c in calls_a] == [c["stage"] for c in calls_b] and calls_a
    for a, b in zip(calls_a, calls_b):
        assert b["metrics"] == a["metrics"], (a["stage"], a["metrics"], b["metrics"])
        assert a["state_dict"].keys() == b["state_dict"].keys()
        for k in a["state_dict"]:
            assert torch.equal(a["state_dict"][k], b["state_dict"][k]), (a["stage"], k)
        assert (a["global_step"], a["current_epoch"]) == (b["global_step"], b["current_epoch"]), a["stage"]
        if lightning.rank == 0 and a["csv"] is not None:
            assert_same_rows(a["csv"], b["csv"])


def test_detail_modules_differ_only_in_the_framework_line() -> None:
    lightning, polytrain = (harness.module_source(f, harness.DETAIL_FILE).splitlines()
                            for f in ("lightning", "polytrain"))
    differing = [(a, b) for a, b in zip(lightning, polytrain) if a != b]
    assert differing == [(harness.FRAMEWORK_LINES["lightning"], harness.FRAMEWORK_LINES["polytrain"])]


def test_lr_monitor_by_step_logs_the_rate_each_step_used() -> None:
    lightning, polytrain = _run("lightning", ONE_CYCLE), _run("polytrain", ONE_CYCLE)
    assert_same_run(lightning, polytrain, rng=True)
    assert_same_after_every_call(lightning, polytrain)
    rates = [float(r["lr-SGD"]) for r in _rows(polytrain.extra["after_stage"][0]["csv"]) if r.get("lr-SGD")]
    assert len(rates) == 8 and rates[0] < rates[3]  # one per logged step (16 steps, every 2nd), warming up
    assert polytrain.metrics["callback_metrics"]["lr-SGD"] == pytest.approx(rates[-1])


def test_metrics_after_test_hold_the_test_only_and_the_csv_keeps_each_epoch() -> None:
    lightning, polytrain = _run("lightning", FIT_THEN_TEST), _run("polytrain", FIT_THEN_TEST)
    assert_same_run(lightning, polytrain, rng=True)
    assert_same_after_every_call(lightning, polytrain)
    after_test = polytrain.extra["after_stage"][1]
    assert set(after_test["metrics"]["logged_metrics"]) == {"test_loss", "test_acc"}
    assert after_test["metrics"]["progress_bar_metrics"] == {}
    rows = _rows(after_test["csv"])
    assert [r["epoch"] for r in rows if r.get("val_loss")] == ["0", "1"]  # the last validation stays epoch 1
    assert [r["epoch"] for r in rows if r.get("test_loss")] == ["2"]


def test_a_second_fit_builds_its_optimizers_again_and_runs_the_new_callback() -> None:
    lightning, polytrain = _run("lightning", SECOND_FIT), _run("polytrain", SECOND_FIT)
    assert_same_run(lightning, polytrain, rng=True)
    assert_same_after_every_call(lightning, polytrain)
    assert polytrain.extra["optimizer_builds"] == lightning.extra["optimizer_builds"] == 2
    assert polytrain.extra["seen_in_hooks"] == lightning.extra["seen_in_hooks"] == [1]  # the new callback ran
    assert polytrain.global_step == 16


@pytest.mark.distributed
def test_ddp_after_seed_everything_reseeds_every_rank_and_the_sampler_as_lightning() -> None:
    spec = ("augmented", {}, dict(max_epochs=2), ["fit", "validate"])
    lightning, polytrain = _run_ddp("lightning", spec, seed=7), _run_ddp("polytrain", spec, seed=7)
    for a, b in zip(lightning, polytrain):
        assert_same_run(a, b, rng=False)
        assert_same_after_every_call(a, b)
        assert b.extra["train_sampler"]["seed"] == 7
    # Lightning's seeding: both ranks drew the same augmentation noise, so their losses differ by data only.
    assert polytrain[0].losses != polytrain[1].losses


@pytest.mark.distributed
def test_ddp_batchnorm_buffers_and_evaluation_match_lightning_on_every_rank() -> None:
    spec = ("batchnorm", {}, dict(max_epochs=2), ["fit", "validate", "test"])
    lightning, polytrain = _run_ddp("lightning", spec), _run_ddp("polytrain", spec)
    for a, b in zip(lightning, polytrain):
        assert_same_run(a, b, rng=False)
        assert_same_after_every_call(a, b)
    stats = [r.extra["after_stage"][0]["state_dict"]["net.1.running_mean"] for r in polytrain]
    # after fit (its last validation), rank 1 holds rank 0's statistics
    assert torch.equal(stats[0], stats[1])


@pytest.mark.distributed
def test_ddp_metrics_after_test_the_lr_monitor_and_a_second_fit_match_lightning() -> None:
    for spec in (FIT_THEN_TEST, ONE_CYCLE, SECOND_FIT):
        lightning, polytrain = _run_ddp("lightning", spec), _run_ddp("polytrain", spec)
        for a, b in zip(lightning, polytrain):
            assert_same_run(a, b, rng=False)
            assert_same_after_every_call(a, b)


@pytest.mark.distributed
def test_ddp_unused_parameters_are_named_with_the_fix() -> None:
    spec = ("unused", {}, dict(max_epochs=1), [("fit", {"expect_error": True})])
    lightning, polytrain = _run_ddp("lightning", spec), _run_ddp("polytrain", spec)
    for rank, (a, b) in enumerate(zip(lightning, polytrain)):
        theirs, ours = a.extra["after_stage"][0]["error"], b.extra["after_stage"][0]["error"]
        assert theirs.startswith("RuntimeError") and "ddp_find_unused_parameters_true" in theirs
        assert ours.startswith("RuntimeError") and "ddp_find_unused_parameters_true" in ours
        assert f"on rank {rank}, spare.weight, spare.bias got no gradient" in ours, ours
    allowed = ("unused", dict(allowed=True), dict(max_epochs=1), ["fit"])
    for a, b in zip(_run_ddp("lightning", allowed), _run_ddp("polytrain", allowed)):
        assert_same_run(a, b, rng=False)
        assert_same_after_every_call(a, b)
