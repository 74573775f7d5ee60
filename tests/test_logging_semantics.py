"""``self.log`` with Lightning's semantics (notes/lightning-spec.md §d), on one process and on 2 gloo ranks.

The one-process expectations were measured on Lightning 2.6.6 with the same module (the values logged,
the names each of callback_metrics / logged_metrics / progress_bar_metrics holds, the evaluation step
axis). One documented difference: polytrain's logger step is the optimizer step count (global_step),
Lightning's the number of batches that stepped before this one (global_step - 1).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule
from distributed import run_distributed
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.callbacks import Logger
from polytrain.core.errors import ConfigError

pytestmark = pytest.mark.own_logic

torchmetrics = pytest.importorskip("torchmetrics")

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False,
             enable_checkpointing=False)


class LogRecorder(Logger):
    """What a logger receives: (step, metrics) per ``log_metrics`` call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.mid_epoch: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx == 2:
            self.mid_epoch = {k: float(v) for k, v in trainer.callback_metrics.items()}

    def rows_with(self, name: str) -> list[tuple[int, float]]:
        return [(s, m[name]) for s, m in self.calls if name in m]


class RankRecorder(LogRecorder):
    """Every rank's published values (the built-in loggers write on the logging rank only)."""

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))


class Logs(TrainModule):
    """4 training batches (values 5, 6, 7, 8) and 3 validation batches per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        g = torch.Generator().manual_seed(0)
        self.train_ds = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        self.val_ds = TensorDataset(torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g))
        self.train_metric = torchmetrics.MeanMetric()
        self.val_metric = torchmetrics.MeanMetric()
        self.batch_means: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        v = torch.tensor(float(batch_idx + 5))
        self.log("a", v)  # per step (the default in training_step)
        self.log("b", v, on_step=True, on_epoch=True, prog_bar=True)  # forked
        self.log("c", v, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("mx", v, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("mn", v, on_step=False, on_epoch=True, reduce_fx="min")
        self.log("w", v, on_step=False, on_epoch=True, batch_size=batch_idx + 1)  # weights 1, 2, 3, 4
        self.log("hidden", v, logger=False)
        self.log("rz", v, rank_zero_only=True)  # accepted; filters nothing
        self.train_metric(batch[0][:, 0])
        self.batch_means.append(float(batch[0][:, 0].mean()))
        self.log("t_metric", self.train_metric, on_step=True, on_epoch=True)
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("v", float(batch_idx + 10))  # per epoch (the default in validation_step)
        self.log("vs", float(batch_idx + 20), on_step=True, on_epoch=True)  # forked in validation too
        self.log("vstep", float(batch_idx + 30), on_step=True, on_epoch=False)
        self.val_metric(batch[0][:, 1])
        self.log("v_metric", self.val_metric)

    def on_train_epoch_end(self) -> None:
        self.log("te", float(self.current_epoch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_ds, batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=4)


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any) -> tuple[Trainer, Logs, LogRecorder]:
    recorder = LogRecorder()
    module = Logs()
    trainer = Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path_factory.mktemp("log")), max_epochs=2,
                      log_every_n_steps=3, callbacks=[recorder])
    trainer.fit(module)
    return trainer, module, recorder


def test_a_validation_step_value_never_reaches_a_training_logging_step(run: tuple) -> None:
    _, _, recorder = run
    train_rows = [m for _, m in recorder.calls if "a" in m or "b_epoch" in m]
    assert train_rows and all(not any(k.startswith("v") for k in m) for m in train_rows)
    # Validation step values get their own axis: the validation batch count over the fit, without the
    # sanity check's batches (Lightning: 0, 1, 2 then 3, 4, 5).
    assert recorder.rows_with("vstep") == [(0, 30.0), (1, 31.0), (2, 32.0), (3, 30.0), (4, 31.0), (5, 32.0)]
    # Training step rows at the logging steps (global steps 3 and 6: Lightning's 2 and 5) and every row an
    # epoch.
    assert recorder.rows_with("a") == [(3, 7.0), (6, 6.0)]
    assert [m["epoch"] for _, m in recorder.calls if "a" in m] == [0.0, 1.0]


def test_forked_names_in_logged_callback_and_progress_bar_metrics(run: tuple) -> None:
    trainer, _, recorder = run
    assert recorder.rows_with("b_step") == [(3, 7.0), (6, 6.0)]
    assert recorder.rows_with("b_epoch") == [(4, 6.5), (8, 6.5)]  # at each epoch's end
    assert (recorder.rows_with("vs_epoch") == [(4, 21.0), (8, 21.0)]
            and recorder.rows_with("vs_step")[0] == (0, 20.0))
    assert not recorder.rows_with("b") and not recorder.rows_with("vs")  # loggers never see the plain name
    # callback_metrics: all three forms; the plain name is the latest (the step value mid-epoch) ...
    assert ({k: recorder.mid_epoch[k] for k in ("b", "b_step", "b_epoch")}
            == {"b": 7.0, "b_step": 7.0, "b_epoch": 6.5})
    cm = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # ... the epoch value after it
    assert ({k: cm[k] for k in ("b", "b_step", "b_epoch", "vs", "vs_epoch")}
            == {"b": 6.5, "b_step": 8.0, "b_epoch": 6.5, "vs": 21.0, "vs_epoch": 21.0})
    assert "hidden" in cm and "hidden" not in trainer.logged_metrics  # logger=False: callbacks only
    # logged_metrics: only the suffixed forms; progress_bar_metrics: only prog_bar ones, suffixed.
    assert "b" not in trainer.logged_metrics and {"b_step", "b_epoch"} <= set(trainer.logged_metrics)
    assert "epoch" not in trainer.logged_metrics
    assert trainer.progress_bar_metrics == {"b_step": 8.0, "b_epoch": 6.5}


def test_metrics_at_fit_end_are_the_latest_not_the_last_logging_steps(run: tuple) -> None:
    trainer, _, _ = run
    # The last logging step was batch 1 of epoch 1 (value 6); the last batch logged 8 (Lightning: the same).
    assert float(trainer.callback_metrics["a"]) == 8.0
    assert trainer.logged_metrics["a"] == 8.0 and trainer.logged_metrics["b_step"] == 8.0
    # An evaluation's per-step values leave callback_metrics when it ends; its epoch values stay.
    assert "vstep" not in trainer.callback_metrics and "vs_step" not in trainer.callback_metrics
    assert float(trainer.callback_metrics["te"]) == 1.0


def test_reduce_fx_over_the_epoch(run: tuple) -> None:
    trainer, _, _ = run
    cm = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert cm["c"] == 26.0 and cm["mx"] == 8.0 and cm["mn"] == 5.0  # sum of 5..8, max, min
    assert cm["w"] == (5 * 1 + 6 * 2 + 7 * 3 + 8 * 4) / 10  # mean weighted by batch_size: 7.0
    assert cm["b_epoch"] == 6.5  # weighted by the inferred batch size (4 each)


def test_torchmetrics_objects(run: tuple) -> None:
    trainer, module, recorder = run
    # Step value = the metric's forward on that batch; epoch value = compute() over the epoch, then reset.
    assert recorder.rows_with("t_metric_step")[0][1] == pytest.approx(module.batch_means[2])
    x = module.train_ds.tensors[0][:, 0]
    assert float(trainer.callback_metrics["t_metric_epoch"]) == pytest.approx(float(x.mean()))
    assert float(trainer.callback_metrics["v_metric"]) == pytest.approx(
        float(module.val_ds.tensors[0][:, 1].mean()))
    assert module.train_metric.update_count == 0  # reset at the epoch's end


def test_after_validate_callback_metrics_hold_only_its_metrics(run: tuple) -> None:
    trainer, module, recorder = run
    recorder.calls.clear()
    result = trainer.validate(module, verbose=False)
    assert set(trainer.callback_metrics) == {"v", "vs", "vs_epoch", "v_metric"}
    assert result[0]["v"] == 11.0
    assert [s for s, m in recorder.calls if "vstep" in m] == [0, 1, 2]  # validate() counts its own steps


def test_print_and_all_gather_on_one_process(tmp_path: Any, capsys: Any) -> None:
    seen: dict[str, Any] = {}

    class Gathers(Logs):
        def on_train_start(self) -> None:
            self.print("hello from", self.global_rank)
            seen["vector"] = self.all_gather(torch.arange(3.0))
            seen["scalar"] = self.all_gather(torch.tensor(1.0))

    Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1,
            num_sanity_val_steps=0).fit(Gathers())
    assert "hello from 0" in capsys.readouterr().out
    assert seen["vector"].shape == (3,) and seen["scalar"].shape == ()  # unchanged on one process


@pytest.mark.parametrize(("hook", "args"), [
    ("setup", ("fit",)), ("configure_model", ()), ("on_fit_start", ()), ("on_train_end", ()),
    ("on_fit_end", ()),
    ("on_validation_end", ()), ("on_validation_model_eval", ()), ("on_validation_model_zero_grad", ()),
    ("on_save_checkpoint", (None,)), ("on_before_batch_transfer", (None, 0)), ("teardown", ("fit",)),
])
def test_logging_in_a_forbidden_hook_is_a_clear_error(tmp_path: Any, hook: str, args: tuple) -> None:
    def body(self: Any, *a: Any, **kw: Any) -> Any:
        self.log("x", 1.0)
        return a[0] if hook == "on_before_batch_transfer" else None

    body.__code__ = body.__code__.replace(co_name=hook)  # as if written `def <hook>(self, ...)`
    module = type("Forbidden", (Logs,), {hook: body})()
    trainer = Trainer(**{**QUIET, "enable_checkpointing": True}, devices=1, default_root_dir=str(tmp_path),
                      max_epochs=1)
    with pytest.raises(RuntimeError, match=rf"self.log\('x'\) in {hook}\(\): nothing can be logged there"):
        trainer.fit(module)


def test_logging_in_predict_and_lr_scheduler_step_is_an_error(tmp_path: Any) -> None:
    class Predicts(Logs):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            self.log("x", 1.0)

    trainer = Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1)
    with pytest.raises(RuntimeError, match=r"in predict_step\(\).*a predict hook"):
        trainer.predict(Predicts(), DataLoader(torch.zeros(4, 4)))

    class Schedules(Logs):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            self.log("lr", 1.0)

    with pytest.raises(RuntimeError, match=r"in lr_scheduler_step\(\)"):
        Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1).fit(Schedules())


@pytest.mark.parametrize("hook", ["on_train_start", "on_train_epoch_end", "on_validation_epoch_end"])
def test_on_step_true_in_an_epoch_level_hook_is_an_error(tmp_path: Any, hook: str) -> None:
    def body(self: Any) -> None:
        self.log("x", 1.0, on_step=True)

    body.__code__ = body.__code__.replace(co_name=hook)
    trainer = Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1)
    with pytest.raises(ValueError, match=rf"on_step=True\) in {hook}\(\): an epoch-level hook"):
        trainer.fit(type("EpochStep", (Logs,), {hook: body})())


# --------------------------------------------------------------------------- 2 gloo ranks


# Per rank: the value logged and the batch size it is weighted by, for its 2 training batches.
VALUES = {0: [(1.0, 1), (2.0, 2)], 1: [(10.0, 3), (20.0, 1)]}


class TwoRanks(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        g = torch.Generator().manual_seed(0)
        self.ds = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
        self.metric = torchmetrics.MeanMetric()
        self.seen_x: list[torch.Tensor] = []
        self.gathered: dict[str, Any] = {}

    def on_train_start(self) -> None:
        self.print(f"printed by rank {self.global_rank}")
        self.gathered = {
            "vector": self.all_gather(torch.arange(3.0) + 10 * self.global_rank),
            "scalar": self.all_gather(torch.tensor(float(self.global_rank))),
            "dict": self.all_gather({"k": torch.ones(2) * self.global_rank}),
        }

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        value, weight = VALUES[self.global_rank][batch_idx]
        for fx in ("mean", "sum", "max", "min"):
            self.log(f"e_{fx}", value, on_step=False, on_epoch=True, reduce_fx=fx, batch_size=weight)
        self.log("local", value)  # no sync_dist: each rank keeps its own step value
        self.log("synced", value, sync_dist=True)  # per step, averaged across ranks on the logging step
        self.log("rz", float(self.global_rank), rank_zero_only=True, on_step=False, on_epoch=True,
                 reduce_fx="max")
        # Names only one rank logs, with a reduction other than mean: the ranks must agree on the name and
        # on its reduction (the other rank contributes nothing), or their all-reduces would not match.
        if self.global_rank == 1:
            self.log("only_r1", 5.0 + batch_idx, on_step=False, on_epoch=True, reduce_fx="max")
        else:
            self.log("only_r0", 7.0 - batch_idx, on_step=False, on_epoch=True, reduce_fx="min")
        self.seen_x.append(batch[0][:, 0])
        self.metric(batch[0][:, 0])
        self.log("m", self.metric, on_step=True, on_epoch=True)
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=2)  # 4 samples per rank: 2 batches


def _two_rank_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    recorder = RankRecorder()
    module = TwoRanks()
    trainer = Trainer(**QUIET, strategy="ddp", devices=world_size, default_root_dir=root, max_epochs=1,
                      log_every_n_steps=1, callbacks=[recorder])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(module)
    return {
        "cm": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "calls": recorder.calls,
        "printed": out.getvalue(),
        "gathered": module.gathered,
        "seen_x": [x.clone() for x in module.seen_x],
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return run_distributed(_two_rank_worker, 2, str(tmp_path_factory.mktemp("ranks")), timeout=180.0)


@pytest.mark.distributed
def test_reduce_fx_across_two_ranks(two_ranks: list[dict]) -> None:
    for r in two_ranks:  # every rank ends with the same epoch values
        cm = r["cm"]
        # mean: the global sample-weighted mean (sum of value*weight over both ranks / sum of weights)
        assert cm["e_mean"] == pytest.approx((1 * 1 + 2 * 2 + 10 * 3 + 20 * 1) / 7)
        assert (cm["e_sum"], cm["e_max"], cm["e_min"]) == (33.0, 20.0, 1.0)
        assert cm["rz"] == 1.0  # rank_zero_only filters nothing: rank 1's value took part
        assert (cm["only_r1"], cm["only_r0"]) == (6.0, 6.0)  # one rank's names, reduced as that rank asked
    rows = [[m for _, m in r["calls"] if "synced" in m] for r in two_ranks]
    for i in range(2):
        expected = (VALUES[0][i][0] + VALUES[1][i][0]) / 2
        assert rows[0][i]["synced"] == rows[1][i]["synced"] == expected
        assert (rows[0][i]["local"], rows[1][i]["local"]) == (VALUES[0][i][0], VALUES[1][i][0])


@pytest.mark.distributed
def test_torchmetrics_across_two_ranks(two_ranks: list[dict]) -> None:
    everything = torch.cat([x for r in two_ranks for x in r["seen_x"]])
    assert everything.numel() == 8  # the two ranks saw disjoint halves of the data
    for r in two_ranks:
        steps = [m["m_step"] for _, m in r["calls"] if "m_step" in m]
        assert steps == pytest.approx([float(x.mean()) for x in r["seen_x"]])  # this rank's batch, unsynced
        assert r["cm"]["m_epoch"] == pytest.approx(float(everything.mean()))  # compute() syncs the ranks


@pytest.mark.distributed
def test_print_and_all_gather_across_two_ranks(two_ranks: list[dict]) -> None:
    assert "printed by rank 0" in two_ranks[0]["printed"]
    assert "printed by rank" not in two_ranks[1]["printed"]
    for r in two_ranks:
        g = r["gathered"]
        assert torch.equal(g["vector"],
                           torch.stack([torch.arange(3.0), torch.arange(3.0) + 10]))  # [3] -> [2, 3]
        assert torch.equal(g["scalar"], torch.tensor([0.0, 1.0]))  # scalar -> [2]
        assert torch.equal(g["dict"]["k"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))  # dicts elementwise


class _LogsAMetric(TinyModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mean = torchmetrics.MeanMetric()
        self.other = torchmetrics.MeanMetric()
        self.loose = [torchmetrics.MeanMetric()]  # in a plain list: not one of the module's submodules
        if kind == "alone":
            del self.mean, self.other  # no metric is the module's: the message says to make it one

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        metric = self.mean if self.kind == "held" else self.loose[0]
        metric(batch[0][:, 0])
        if self.kind == "named_wrong":
            self.log("m", metric, metric_attribute="other")
        else:
            self.log("m", metric)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("kind", "match"), [
    ("held", None),
    ("loose", r"metric_attribute=name\)` where `name` is one of \['mean', 'other'\]"),
    ("alone", "setting an attribute for the metric in your `LightningModule`"),
    ("named_wrong", r"metric_attribute='other'\): _LogsAMetric.other is not the metric being logged"),
])
def test_a_logged_metric_must_be_one_of_the_modules_attributes(make_trainer: Any, kind: str,
                                                               match: str | None) -> None:
    # one that is not would stay on the CPU under a GPU strategy and never be reset with the module
    trainer = make_trainer(max_epochs=1)
    if match is None:
        trainer.fit(_LogsAMetric(kind))
        assert "m" in trainer.callback_metrics
    else:
        with pytest.raises(ConfigError, match=match):
            trainer.fit(_LogsAMetric(kind))


class _LogsTwice(TinyModule):
    def __init__(self, same_hook: bool) -> None:
        super().__init__()
        self.same_hook = same_hook

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("foo", 1.0)
        if self.same_hook:
            self.log("foo", 2.0, prog_bar=True)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.same_hook:
            self.log("foo", 3.0, prog_bar=True)  # another hook may log the name with its own arguments


def test_one_name_logged_twice_in_one_hook_with_other_arguments_is_refused(make_trainer: Any) -> None:
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(ConfigError, match=r"`self.log\(foo, ...\)` twice in `training_step` with different"):
        trainer.fit(_LogsTwice(same_hook=True))
    # the next fit of this Trainer starts with no record of the failed one
    trainer.fit(_LogsTwice(same_hook=False))
    assert float(trainer.callback_metrics["foo"]) == 3.0
