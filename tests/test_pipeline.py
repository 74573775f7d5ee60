"""``pipeline`` trains exactly like one device, under every schedule, with data parallel on top.

``Regressor`` is written for DDP (its ``training_step`` calls ``self.net``) plus ``pipeline_loss``:
the whole contract. Every pipeline run is compared with a single-device run on the same global
batch: the 20 published losses and the final weights within 1e-5, validation metrics, the
metrics every rank's callbacks see, and which rank logs. Two-rank runs (all schedules, gradient
accumulation + clipping, errors, a checkpoint) share one spawn; pp=2 x dp=2 has its own.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer, TrainModule

pytestmark = pytest.mark.torch_api

NUM_SAMPLES = 80  # 10 batches of 8 per epoch: 2 epochs = 20 optimizer steps
BATCH = 8  # the global batch; per data-parallel replica it is BATCH // dp
TOL = {"rtol": 0.0, "atol": 1e-5}
CLIP = 0.05  # small enough that every step is clipped

# name -> strategy options for 2 ranks (pp=2); "accumulate" also uses ACCUMULATE below.
SCHEDULES: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe", "n_microbatches": 4},
    "1f1b": {"schedule": "1f1b", "n_microbatches": 4},
    "interleaved_1f1b": {"schedule": "interleaved_1f1b", "n_microbatches": 4, "stages_per_rank": 2},
    "zero_bubble": {"schedule": "zero_bubble", "n_microbatches": 4, "stages_per_rank": 2},
    "zbv": {"schedule": "zbv", "n_microbatches": 4, "stages_per_rank": 2},
}
# 84 samples: the last batch of each epoch holds 4 (2 microbatches of 2), a second microbatch shape.
ACCUMULATE = {"trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": CLIP}, "samples": 84}


def _data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, x[:, :1] * 0.3 - x[:, 1:2] * 0.2 + 0.05 * torch.randn(n, 1, generator=gen))


class Regressor(TrainModule):
    """A module written for DDP; ``pipeline_loss`` is the only addition the pipeline needs."""

    def __init__(self, batch_size: int = BATCH, num_samples: int = NUM_SAMPLES) -> None:
        super().__init__()
        self.batch_size, self.num_samples = batch_size, num_samples

    def configure_model(self) -> None:
        if hasattr(self, "net"):  # idempotent: called again by validate/test
            return
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.log("val/loss", F.mse_loss(out, y))
        self.log("val/mae", (out - y).abs().mean(), prog_bar=True)
        return out

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(self.num_samples, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(10, 1), batch_size=4)  # batches of 4, 4, 2: the last one is short

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.losses[step] = metrics["train/loss"]


def _fit(run_dir: str, strategy: Any, devices: int | str, batch_size: int, samples: int = NUM_SAMPLES,
         ckpt_path: str | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    module, recorder = Regressor(batch_size, samples), LossRecorder()
    trainer_kwargs = {"max_epochs": 2, **trainer_kwargs}
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, run_dir=run_dir,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      log_every_n_steps=1, callbacks=[recorder], seed=0, use_distributed_sampler="always",
                      **trainer_kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return {"losses": [recorder.losses[s] for s in sorted(recorder.losses)], "steps": trainer.global_step,
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "logging": trainer.is_logging_rank, "trainer": trainer}


def _errors(root: str) -> dict[str, str]:
    """Each case must fail on every rank with the same clear message (no rank left waiting)."""

    class NoLoss(Regressor):
        pipeline_loss = None  # type: ignore[assignment]

    cases = {
        "empty_stage": (Regressor, {"stages_per_rank": 2, "schedule": "interleaved_1f1b",
                                    "split_points": [2, 4, 4]}),
        "too_few_children": (Regressor, {"stages_per_rank": 4, "schedule": "interleaved_1f1b"}),
        "microbatches": (Regressor, {"n_microbatches": 3}),
        "fewer_microbatches_than_stages": (Regressor, {"n_microbatches": 1}),
        "no_pipeline_loss": (NoLoss, {}),
    }
    messages = {}
    for name, (cls, options) in cases.items():
        trainer = Trainer(accelerator="cpu", devices=2, strategy={"name": "pipeline", **options},
                          max_epochs=1, run_dir=os.path.join(root, name), enable_progress_bar=False,
                          logger=False, enable_checkpointing=False)
        try:
            trainer.fit(cls())
            messages[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the message is what is checked
            messages[name] = f"{type(err).__name__}: {err}"
    return messages


def _two_rank_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, options in SCHEDULES.items():
        run = _fit(os.path.join(root, name), {"name": "pipeline", **options}, world_size, BATCH)
        if name == "1f1b":  # every rank writes its stage; a single device must be able to resume
            trainer = run["trainer"]
            trainer.save_checkpoint(os.path.join(root, "ckpt-1f1b"))
            run["validate"] = trainer.validate(trainer.module)
            run["predict"] = trainer.predict(trainer.module)
        run.pop("trainer")
        out[name] = run
    # A single-device checkpoint after epoch 1 (a replicated .ckpt file) resumed by the pipeline.
    out["from_single"] = _fit(os.path.join(root, "from-single"), {"name": "pipeline", "schedule": "1f1b"},
                              world_size, BATCH, ckpt_path=os.path.join(root, "single-epoch1.ckpt"))
    out["from_single"].pop("trainer")
    out["accumulate"] = _fit(os.path.join(root, "acc"),
                             {"name": "pipeline", "schedule": "1f1b", "n_microbatches": 2},
                             world_size, BATCH, ACCUMULATE["samples"], **ACCUMULATE["trainer"])
    out["accumulate"].pop("trainer")
    out["errors"] = _errors(root)
    return out


def _single(root: str, name: str, **kwargs: Any) -> dict[str, Any]:
    run = _fit(os.path.join(root, f"single-{name}"), "single", 1, BATCH, **kwargs)
    trainer = run.pop("trainer")
    if name == "plain":
        run["validate"] = trainer.validate(trainer.module)
        run["predict"] = trainer.predict(trainer.module)
    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("pipeline"))
    first_epoch = _fit(os.path.join(root, "single-epoch1"), "single", 1, BATCH, max_epochs=1)
    first_epoch["trainer"].save_checkpoint(os.path.join(root, "single-epoch1.ckpt"))
    ranks = run_distributed(_two_rank_worker, 2, root, timeout=200.0)
    single = {"plain": _single(root, "plain"),
              "accumulate": _single(root, "acc", samples=ACCUMULATE["samples"], **ACCUMULATE["trainer"])}
    return {"root": root, "ranks": ranks, "single": single}


def _check_parity(ranks: list[dict[str, Any]], single: dict[str, Any], steps: int, what: str) -> None:
    assert single["steps"] == steps and len(single["losses"]) == steps
    assert single["losses"][-1] < single["losses"][0]  # it trained: parity of frozen weights proves nothing
    for rank in ranks:
        assert rank["steps"] == steps
        # Every rank's callbacks saw the same published losses and end-of-fit metrics.
        assert rank["losses"] == ranks[0]["losses"] and rank["metrics"] == ranks[0]["metrics"]
    assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), **TOL)
    assert sorted(ranks[0]["metrics"]) == sorted(single["metrics"]) == ["train/loss", "val/loss", "val/mae"]
    for key, value in single["metrics"].items():
        assert abs(ranks[0]["metrics"][key] - value) < 1e-5, (what, key)
    # Each rank holds its stages under the single model's names; together they hold all of it.
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        assert set(rank["state"]) < set(single["state"]) and not set(rank["state"]) & set(merged)
        merged.update(rank["state"])
    assert merged.keys() == single["state"].keys()
    for key, value in single["state"].items():
        assert_close(merged[key], value, **TOL, msg=lambda m, k=key: f"{what} {k}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_matches_single_device(two_ranks: dict[str, Any], schedule: str) -> None:
    ranks = [r[schedule] for r in two_ranks["ranks"]]
    _check_parity(ranks, two_ranks["single"]["plain"], 20, schedule)
    # The last stage's first replica logs: rank 1, except under zbv's V placement (rank 0).
    assert [r["logging"] for r in ranks] == ([True, False] if schedule == "zbv" else [False, True])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_validate_and_predict_after_fit(two_ranks: dict[str, Any]) -> None:
    single = two_ranks["single"]["plain"]
    ranks = [r["1f1b"] for r in two_ranks["ranks"]]
    for rank in ranks:  # every rank returns the same metrics (the last stage's, copied)
        assert rank["validate"][0].keys() == single["validate"][0].keys() == {"val/loss", "val/mae"}
        for key, value in single["validate"][0].items():
            assert abs(rank["validate"][0][key] - value) < 1e-5
    # Predictions come back on the last stage; the first stage's steps return None.
    assert ranks[0]["predict"] == [None, None, None]
    assert_close(torch.cat(ranks[1]["predict"]), torch.cat(single["predict"]), **TOL)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_accumulation_clipping_and_short_batches_match_single_device(two_ranks: dict[str, Any]) -> None:
    # 11 batches per epoch in windows of 2: 6 steps per epoch, the last on one short batch.
    _check_parity([r["accumulate"] for r in two_ranks["ranks"]], two_ranks["single"]["accumulate"], 12,
                  "accumulate")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_errors_are_clear_and_raised_on_every_rank(two_ranks: dict[str, Any]) -> None:
    errors = [r["errors"] for r in two_ranks["ranks"]]
    assert errors[0] == errors[1]
    e = errors[0]
    assert "split_points=[2, 4, 4] leave stage 2 empty (children 4..3 of 7)" in e["empty_stage"]
    assert "7 children into 8 stages" in e["too_few_children"] and "stages_per_rank" in e["too_few_children"]
    assert "n_microbatches=3 does not divide the per-rank batch size 8" in e["microbatches"]
    assert "[1, 2, 4, 8]" in e["microbatches"]
    assert "pipeline_loss(self, outputs, targets)" in e["no_pipeline_loss"]
    assert e["fewer_microbatches_than_stages"].startswith("ConfigError: pipeline schedule='1f1b' with "
                                                          "n_microbatches=1, pp=2, stages_per_rank=1")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_pipeline_checkpoint_resumes_on_a_single_device(two_ranks: dict[str, Any]) -> None:
    """The 1F1B run's checkpoint (2 stages' shards in one DCP directory, original names, momentum
    buffers keyed by name) resumes on one device: a third epoch from it equals a 3-epoch single run."""
    path = os.path.join(two_ranks["root"], "ckpt-1f1b")
    assert os.path.isdir(path)
    torch.manual_seed(0)
    module = Regressor()
    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", max_epochs=3,
                      run_dir=os.path.join(two_ranks["root"], "resumed"), enable_progress_bar=False,
                      logger=False, enable_checkpointing=False, log_every_n_steps=1, seed=0,
                      use_distributed_sampler="always")
    trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 30
    torch.manual_seed(0)
    fresh = Regressor()
    Trainer(accelerator="cpu", devices=1, strategy="single", max_epochs=3, enable_progress_bar=False,
            logger=False, enable_checkpointing=False, run_dir=os.path.join(two_ranks["root"], "fresh"),
            seed=0, use_distributed_sampler="always").fit(fresh)
    for key, value in fresh.state_dict().items():
        assert_close(module.state_dict()[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_single_device_checkpoint_resumes_under_the_pipeline(two_ranks: dict[str, Any]) -> None:
    """Epoch 1 on one device (a .ckpt file), epoch 2 on two stages: the 2-epoch single run exactly."""
    ranks = [r["from_single"] for r in two_ranks["ranks"]]
    assert [r["steps"] for r in ranks] == [20, 20] and len(ranks[0]["losses"]) == 10
    single = two_ranks["single"]["plain"]
    assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"][10:]), **TOL)
    merged = {k: v for r in ranks for k, v in r["state"].items()}
    assert merged.keys() == single["state"].keys()
    for key, value in single["state"].items():
        assert_close(merged[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


def _dp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    # devices="auto": the launcher's 4 processes, more than this machine's cores.
    run = _fit(root, {"name": "pipeline", "pp": 2, "schedule": "1f1b", "n_microbatches": 2}, "auto",
               BATCH // 2)
    strategy = run.pop("trainer").strategy
    run["topology"] = (strategy.pp_rank, strategy.dp_rank, strategy.dp_size)
    return run


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_pp2_dp2_matches_single_device(tmp_path: Any) -> None:
    ranks = run_distributed(_dp_worker, 4, str(tmp_path), timeout=250.0)
    # pp is the outer mesh dimension: ranks 0, 1 hold stage 0 (dp 0, 1), ranks 2, 3 stage 1.
    assert [r["topology"] for r in ranks] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert [r["logging"] for r in ranks] == [False, False, True, False]
    single = _single(str(tmp_path), "plain")
    _check_parity([ranks[0], ranks[2]], single, 20, "pp2 x dp2")
    for replica, first in ((ranks[1], ranks[0]), (ranks[3], ranks[2])):
        assert replica["losses"] == first["losses"] and replica["metrics"] == first["metrics"]
        for key, value in first["state"].items():
            assert torch.equal(replica["state"][key], value)  # dp replicas stay bit-identical


def _summary_on_two_stages(rank: int, world_size: int, root: str) -> str:
    import contextlib
    import io

    trainer = Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, run_dir=root,
                      strategy={"name": "pipeline", "schedule": "1f1b", "n_microbatches": 2},
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(Regressor())
    return printed.getvalue()


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_the_model_summary_counts_the_layers_of_every_stage(tmp_path: Any) -> None:
    """Each stage holds its own layers only; the table, printed once, counts the whole model."""
    printed = run_distributed(_summary_on_two_stages, 2, str(tmp_path), timeout=150)
    whole = Regressor()
    whole.configure_model()
    total = sum(p.numel() for p in whole.parameters())
    tables = [text for text in printed if "total parameters" in text]
    assert len(tables) == 1, printed
    assert f"{total} trainable / {total} total parameters" in tables[0], tables[0]
    assert [line.split() for line in tables[0].splitlines() if line.startswith("net ")] == [
        ["net", "Sequential", str(total)]], tables[0]
