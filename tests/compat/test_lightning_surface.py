"""The names around a Lightning module run unchanged: ``surface_modules.py`` uses ``pl.loggers``
(TensorBoard and CSV, with Lightning's arguments, ``self.logger.experiment.add_histogram``),
``pl.utilities.rank_zero_only``, a ``pl.callbacks.BasePredictionWriter``, ``LearningRateMonitor`` and a
``WeightedRandomSampler``, and runs under Lightning and polytrain with only the import changed: the
same hook calls, losses and weights bitwise, the same ``callback_metrics``, the same CSV values and
TensorBoard tags read back from the files, the same prediction files, the same rank-zero-only calls,
on one process and on ddp x2 (where the user's sampler is split over the ranks)."""

from __future__ import annotations

import csv
import glob
import os
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from compat import harness  # noqa: E402 - after the skip on purpose
from compat.test_lightning_compat import assert_same_run  # noqa: E402

pytestmark = pytest.mark.own_logic

STAGES = ["fit", ("predict", {"return_predictions": False})]
TRAINER = dict(max_epochs=2, log_every_n_steps=2)


def test_surface_module_differs_only_in_the_framework_line() -> None:
    lightning, polytrain = (harness.module_source(f, harness.SURFACE_FILE).splitlines()
                            for f in ("lightning", "polytrain"))
    differing = [(a, b) for a, b in zip(lightning, polytrain) if a != b]
    assert differing == [(harness.FRAMEWORK_LINES["lightning"], harness.FRAMEWORK_LINES["polytrain"])]


def _csv_values(log_dir: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every (name, value) the CSV logger wrote, and the epoch beside each training loss. Steps aside:
    polytrain counts optimizer steps from 1, Lightning batches from 0 (docs/migrating-from-lightning.md;
    test_lightning_details.py compares the rows themselves)."""
    with open(os.path.join(log_dir, "metrics.csv"), newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    values = sorted((k, v) for row in rows for k, v in row.items()
                    if v != "" and k not in ("step", "epoch")
                    and not k.startswith("goodput/"))  # polytrain's own
    return values, [(row["train_loss"], row["epoch"]) for row in rows if row.get("train_loss")]


def _tensorboard_tags(log_dir: str) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = [t for t in tags["scalars"] if not t.startswith("goodput/")]  # polytrain's own, at fit end
    return {"histograms": sorted(tags["histograms"]), "scalars": sorted(scalars)}


def _prediction_files(root: str) -> dict[str, Any]:
    return {os.path.basename(p): torch.load(p, weights_only=True)
            for p in sorted(glob.glob(os.path.join(root, "predictions", "*.pt")))}


def _assert_same_files(lightning: harness.RunResult, polytrain: harness.RunResult) -> None:
    # Lightning's two loggers each take the next free version (TensorBoard version_0, CSV version_1);
    # polytrain's share the run's one. Each is read where its logger says it wrote.
    ours, theirs = polytrain.extra["logger_dirs"], lightning.extra["logger_dirs"]
    assert polytrain.extra["log_dir"] == ours["TensorBoardLogger"] == ours["CSVLogger"] == os.path.join(
        polytrain.extra["root_dir"], "surface", "version_0")
    assert lightning.extra["log_dir"] == theirs["TensorBoardLogger"]
    if lightning.rank == 0:
        assert _csv_values(ours["CSVLogger"]) == _csv_values(theirs["CSVLogger"])
        tags = _tensorboard_tags(ours["TensorBoardLogger"])
        assert tags == _tensorboard_tags(theirs["TensorBoardLogger"])
        assert "lr-SGD" in tags["scalars"] and "logits" in tags["histograms"]
    written, reference = (_prediction_files(polytrain.extra["root_dir"]),
                          _prediction_files(lightning.extra["root_dir"]))
    assert sorted(written) == sorted(reference) and written
    for name in reference:
        a, b = reference[name], written[name]
        assert a.keys() == b.keys()
        assert a.get("indices") == b.get("indices")
        for x, y in zip(a.get("predictions", [a.get("prediction")]),
                        b.get("predictions", [b.get("prediction")])):
            assert torch.equal(x, y), name


def test_surface_one_process_matches_lightning() -> None:
    lightning = harness.run_case("lightning", "surface", trainer_kwargs=TRAINER, stages=STAGES)
    polytrain = harness.run_case("polytrain", "surface", trainer_kwargs=TRAINER, stages=STAGES)
    assert_same_run(lightning, polytrain, rng=True)
    assert polytrain.metrics["callback_metrics"] == lightning.metrics["callback_metrics"]
    assert polytrain.extra["rank_zero_notes"] == lightning.extra["rank_zero_notes"] == ["epoch 0", "epoch 1"]
    _assert_same_files(lightning, polytrain)


@pytest.mark.distributed
def test_surface_ddp_matches_lightning() -> None:
    lightning = harness.run_case_distributed("lightning", "surface", 2, trainer_kwargs=TRAINER, stages=STAGES,
                                             timeout=300)
    polytrain = harness.run_case_distributed("polytrain", "surface", 2, trainer_kwargs=TRAINER, stages=STAGES,
                                             timeout=300)
    for a, b in zip(lightning, polytrain):
        assert_same_run(a, b, rng=False)
        assert b.metrics["callback_metrics"] == a.metrics["callback_metrics"]
        assert b.extra["rank_zero_notes"] == a.extra["rank_zero_notes"]
        _assert_same_files(a, b)
    assert [r.extra["rank_zero_notes"] for r in polytrain] == [["epoch 0", "epoch 1"], []]
