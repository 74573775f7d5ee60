"""Lightning names real projects use every day: ``rank_zero_only`` and friends (``polytrain.utilities``),
``TQDMProgressBar(refresh_rate=...)``, the learning rates ``LearningRateMonitor`` puts in
``callback_metrics``, and the results table ``validate``/``test`` print."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from conftest import TinyModule
from distributed import run_distributed

import polytrain as pl
from polytrain import Trainer
from polytrain.callbacks import LearningRateMonitor, TQDMProgressBar

pytestmark = pytest.mark.own_logic


def test_utilities_are_where_lightning_code_imports_them() -> None:
    from polytrain.utilities import rank_zero_info, rank_zero_only, rank_zero_warn, seed_everything
    from polytrain.utilities.rank_zero import rank_zero_debug

    assert pl.utilities.rank_zero_only is rank_zero_only
    assert callable(rank_zero_info) and callable(rank_zero_warn) and callable(rank_zero_debug)
    assert seed_everything(3) == 3


class _RankZeroModule(TinyModule):
    def on_fit_start(self) -> None:
        from polytrain.utilities import rank_zero_only, rank_zero_warn

        @rank_zero_only
        def note() -> str:
            return "ran"

        self.noted = note()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rank_zero_warn("only once per job")
        self.warned = [str(w.message) for w in caught]


def _rank_zero_worker(rank: int, world_size: int, run_dir: str) -> tuple[Any, list[str]]:
    module = _RankZeroModule(n=16)
    Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, run_dir=run_dir, logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            num_sanity_val_steps=0, timeout=60).fit(module)
    return module.noted, module.warned


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_rank_zero_only_runs_on_global_rank_zero_under_ddp(tmp_path: Any) -> None:
    """The Trainer tells ``rank_zero_only`` its rank: the decorated function runs on rank 0 and returns
    its default (None) on rank 1; ``rank_zero_warn`` warns on rank 0 only."""
    (noted0, warned0), (noted1, warned1) = run_distributed(_rank_zero_worker, 2, str(tmp_path), timeout=200)
    assert (noted0, noted1) == ("ran", None)
    assert warned0 == ["only once per job"] and warned1 == []


def test_rank_zero_only_takes_a_default() -> None:
    from polytrain.utilities import rank_zero_only

    saved = rank_zero_only.rank
    try:
        rank_zero_only.rank = 1
        assert rank_zero_only(lambda: "ran", default="skipped")() == "skipped"
        rank_zero_only.rank = 0
        assert rank_zero_only(default="skipped")(lambda: "ran")() == "ran"
    finally:
        rank_zero_only.rank = saved


@pytest.mark.parametrize("refresh_rate", [1, 3, 0])
def test_tqdm_progress_bar_redraws_every_refresh_rate_batches(make_trainer: Any, monkeypatch: Any,
                                                              refresh_rate: int) -> None:
    from tqdm.auto import tqdm

    moves: list[int] = []
    original = tqdm.update

    def counted(self: Any, n: float = 1) -> Any:
        moves.append(int(n))
        return original(self, n)

    monkeypatch.setattr(tqdm, "update", counted)
    bar = TQDMProgressBar(refresh_rate=refresh_rate)
    trainer = make_trainer(max_epochs=1, enable_progress_bar=True, callbacks=[bar], limit_val_batches=0)
    trainer.fit(TinyModule(n=32))  # 8 batches
    assert [cb for cb in trainer.callbacks if isinstance(cb, pl.callbacks.ProgressBar)] == [bar]
    expected = {1: [1] * 8, 3: [3, 3, 2], 0: []}[refresh_rate]
    assert moves == expected


@pytest.mark.parametrize("sized", [True, False])
def test_the_train_bar_counts_the_steps_left_when_max_steps_ends_an_endless_fit(make_trainer: Any,
                                                                              sized: bool) -> None:
    """``max_epochs=-1`` with ``max_steps=6`` over 8-batch epochs (or a stream with no length): the bar's
    total is the 6 steps, not the epoch's 8 (or nothing); ``train_progress_bar`` and ``trainer`` are there
    as Lightning's bars have them."""
    bar = TQDMProgressBar()
    with pytest.raises(TypeError, match="reference has not been set yet"):
        bar.trainer  # noqa: B018 - the property raises until a stage starts
    module = TinyModule(n=32)
    if not sized:
        stream = [batch for batch in module.train_dataloader()]
        module.train_dataloader = lambda: (batch for _ in range(2) for batch in stream)  # type: ignore
    trainer = make_trainer(max_epochs=-1, max_steps=6, enable_progress_bar=True, callbacks=[bar],
                           limit_val_batches=0)
    trainer.fit(module)
    assert bar.trainer is trainer and trainer.global_step == 6
    assert bar.train_progress_bar.total == 6


def test_learning_rates_are_in_callback_metrics(make_trainer: Any) -> None:
    class Adam(TinyModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    trainer = make_trainer(max_epochs=1,
                           callbacks=[LearningRateMonitor(logging_interval="epoch")])  # no logger
    trainer.fit(Adam(n=16))
    assert float(trainer.callback_metrics["lr-Adam"]) == pytest.approx(0.01)


def test_validate_and_test_print_their_results_table(make_trainer: Any, capsys: Any) -> None:
    trainer = make_trainer(max_epochs=1)
    module = TinyModule(n=16)
    trainer.fit(module)
    capsys.readouterr()
    [result] = trainer.validate(module)
    out = capsys.readouterr().out
    assert "Validate metric" in out and "DataLoader 0" in out
    assert "val/loss" in out and str(result["val/loss"]) in out
    trainer.test(module)
    assert "Test metric" in capsys.readouterr().out
    trainer.validate(module, verbose=False)
    assert "metric" not in capsys.readouterr().out


class _StepsWithoutBatchIdx(TinyModule):
    """Lightning passes ``batch_idx`` only to a step that takes it (``def training_step(self, batch)``)."""

    def training_step(self, batch: Any) -> Any:  # type: ignore[override]
        return super().training_step(batch, 0)

    def validation_step(self, batch: Any) -> Any:  # type: ignore[override]
        return super().validation_step(batch, 0)

    def test_step(self, batch: Any) -> Any:  # type: ignore[override]
        return super().test_step(batch, 0)

    def predict_step(self, batch: Any) -> Any:  # type: ignore[override]
        return super().predict_step(batch, 0)


def _fit_without_batch_idx(rank: int, world: int, strategy: str) -> list[float]:
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = _StepsWithoutBatchIdx()
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    trainer.test(module, verbose=False)
    assert len(trainer.predict(module)) == 2 // world  # 8 samples in batches of 4, split over the ranks
    return [float(v) for v in module.net.weight.flatten()]


@pytest.mark.parametrize("strategy,world", [("single", 1), ("ddp", 2)])
def test_steps_declared_without_batch_idx_run(strategy: str, world: int) -> None:
    torch.manual_seed(0)
    reference = TinyModule()
    torch.manual_seed(0)
    if world == 1:
        weights = [_fit_without_batch_idx(0, 1, strategy)]
    else:
        weights = run_distributed(_fit_without_batch_idx, world, strategy, timeout=240)
    assert all(w == weights[0] for w in weights)
    assert weights[0] != [float(v) for v in reference.net.weight.flatten()]  # it trained
