"""Lightning behaviour a project relies on in its first hour, as Lightning's own tests check it:
``trainer.state``, Ctrl-C, ``MisconfigurationException``, ``max_epochs=-1``/``0``, ``callbacks=None``,
a settable ``module.trainer``, EarlyStopping's reason and state key, ModelCheckpoint's attributes and
``save_on_exception``, ``OnExceptionCheckpoint``, LearningRateMonitor's ``lrs``, the checkpoint's
``state_dict`` key, and several evaluation loaders (single process; tests/test_several_loaders.py runs
them under every strategy)."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import pytest
import torch
import yaml
from conftest import TinyModule
from torch.utils.data import DataLoader

from polytrain import Callback
from polytrain.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, OnExceptionCheckpoint
from polytrain.callbacks.early_stopping import EarlyStoppingReason
from polytrain.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus
from polytrain.utilities.exceptions import MisconfigurationException

pytestmark = pytest.mark.own_logic


# --------------------------------------------------------------------------- trainer.state


class _StateRecorder(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any, Any, Any, bool, bool, bool]] = []

    def _note(self, trainer: Any, hook: str) -> None:
        s = trainer.state
        self.seen.append((hook, s.fn, s.stage, s.status, trainer.training, trainer.validating,
                          trainer.sanity_checking))

    def on_sanity_check_start(self, trainer: Any, module: Any) -> None:
        self._note(trainer, "sanity_start")

    def on_sanity_check_end(self, trainer: Any, module: Any) -> None:
        self._note(trainer, "sanity_end")

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._note(trainer, "train_batch")

    def on_validation_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._note(trainer, "val_batch")

    def on_test_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self._note(trainer, "test_batch")


def test_trainer_state_names_the_entry_point_the_loop_and_the_status(make_trainer: Any) -> None:
    recorder = _StateRecorder()
    trainer = make_trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=1,
                           callbacks=[recorder])
    assert trainer.state == TrainerState(status=TrainerStatus.INITIALIZING, fn=None, stage=None)
    trainer.fit(TinyModule(n=8))
    assert trainer.state.finished and trainer.state.stage is None and trainer.state.fn == "fit"
    trainer.test(TinyModule(n=8, val_n=4), dataloaders=DataLoader(TinyModule(n=4).train_ds, batch_size=4))
    running = TrainerStatus.RUNNING
    fit, test = TrainerFn.FITTING, TrainerFn.TESTING
    assert recorder.seen == [
        ("sanity_start", fit, RunningStage.SANITY_CHECKING, running, False, False, True),
        ("val_batch", fit, RunningStage.SANITY_CHECKING, running, False, False, True),
        ("sanity_end", fit, RunningStage.SANITY_CHECKING, running, False, False, True),
        ("train_batch", fit, RunningStage.TRAINING, running, True, False, False),
        # a fit's validation is `validating`, not `training`, as in Lightning
        ("val_batch", fit, RunningStage.VALIDATING, running, False, True, False),
        ("test_batch", test, RunningStage.TESTING, running, False, False, False),
    ]
    assert TrainerFn.FITTING == "FIT" and RunningStage.VALIDATING.dataloader_prefix == "val"


def test_an_error_leaves_the_trainer_interrupted(make_trainer: Any) -> None:
    class Failing(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise RuntimeError("boom")

    trainer = make_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing())
    assert trainer.state.status == TrainerStatus.INTERRUPTED and trainer.interrupted


def test_ctrl_c_inside_fit_tells_the_callbacks_then_exits_130_without_a_traceback(make_trainer: Any) -> None:
    """Lightning's graceful shutdown: ``on_exception`` sees the KeyboardInterrupt, then the program exits
    (SystemExit; polytrain with Ctrl-C's status, 130)."""
    seen: list[str] = []

    class Interrupt(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            raise KeyboardInterrupt

        def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
            seen.append(type(exception).__name__)

    trainer = make_trainer(max_epochs=1, callbacks=[Interrupt()])
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(TinyModule())
    assert stopped.value.code == 130 and seen == ["KeyboardInterrupt"] and trainer.interrupted


# --------------------------------------------------------------------------- options and names


def test_config_errors_are_lightnings_misconfiguration_exception(make_trainer: Any) -> None:
    with pytest.raises(MisconfigurationException, match="max_epochs=-2"):
        make_trainer(max_epochs=-2)
    with pytest.raises(ValueError):  # and still a ValueError, as before
        make_trainer(max_epochs=-2)
    with pytest.raises(MisconfigurationException, match="Must be >= -1"):
        ModelCheckpoint(save_top_k=-3)
    with pytest.raises(MisconfigurationException, match="`mode` can be min, max"):
        EarlyStopping("val/loss", mode="maximum")


def test_max_epochs_minus_one_trains_until_max_steps_and_zero_trains_nothing(make_trainer: Any) -> None:
    trainer = make_trainer(max_epochs=-1, max_steps=10)  # 4 batches an epoch: past two epochs
    trainer.fit(TinyModule(n=16))
    assert (trainer.global_step, trainer.current_epoch) == (10, 2)
    assert trainer.estimated_stepping_batches == 10

    module = TinyModule(n=16)
    before = module.net.weight.detach().clone()
    trainer = make_trainer(max_epochs=0)
    trainer.fit(module)
    assert trainer.global_step == 0 and torch.equal(module.net.weight, before)


def test_an_unset_max_epochs_warns_that_the_fit_stops_at_1000(make_trainer: Any) -> None:
    trainer = make_trainer(limit_train_batches=1, limit_val_batches=0, callbacks=[_StopAfterFirstEpoch()])
    with pytest.warns(UserWarning, match="max_epochs was not set.*max_epochs=-1"):
        trainer.fit(TinyModule())


class _StopAfterFirstEpoch(Callback):
    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        trainer.should_stop = True


def test_callbacks_may_be_none_or_a_single_callback(make_trainer: Any) -> None:
    assert not any(type(cb) is _StopAfterFirstEpoch for cb in make_trainer(callbacks=None).callbacks)
    single = _StopAfterFirstEpoch()
    assert single in make_trainer(callbacks=single).callbacks


def test_a_module_is_attached_to_a_trainer_by_assignment(make_trainer: Any) -> None:
    module, trainer = TinyModule(), make_trainer()
    with pytest.raises(RuntimeError, match="attached to a `Trainer`"):
        _ = module.trainer
    module.trainer = trainer
    assert module.trainer is trainer


def test_lightnings_utility_names_are_importable() -> None:
    from polytrain import LightningModule
    from polytrain.utilities import AttributeDict, is_overridden
    from polytrain.utilities.model_helpers import is_overridden as is_overridden_there
    from polytrain.utilities.parsing import AttributeDict as AttributeDictThere

    assert AttributeDict is AttributeDictThere and is_overridden is is_overridden_there
    assert is_overridden("training_step", TinyModule()) and not is_overridden("on_fit_start", TinyModule())
    assert LightningModule.CHECKPOINT_HYPER_PARAMS_KEY == "hyper_parameters"


# --------------------------------------------------------------------------- EarlyStopping


class _Scored(TinyModule):
    """Logs ``score`` from a list, one value per validation."""

    def __init__(self, scores: list[float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scores = scores

    def on_validation_epoch_end(self) -> None:
        self.log("score", self.scores[min(self.current_epoch, len(self.scores) - 1)])


@pytest.mark.parametrize(("scores", "kwargs", "reason", "message"), [
    ([1.0, 1.0, 1.0, 1.0], dict(patience=2), EarlyStoppingReason.PATIENCE_EXHAUSTED, "did not improve"),
    ([1.0, 0.1], dict(stopping_threshold=0.5), EarlyStoppingReason.STOPPING_THRESHOLD, "Stopping threshold"),
    ([1.0, 9.0], dict(divergence_threshold=5.0), EarlyStoppingReason.DIVERGENCE_THRESHOLD, "Divergence"),
    ([1.0, math.nan], {}, EarlyStoppingReason.NON_FINITE_METRIC, "is not finite"),
])
def test_early_stopping_says_why_it_stopped(make_trainer: Any, scores: list[float], kwargs: dict[str, Any],
                                            reason: EarlyStoppingReason, message: str) -> None:
    stopper = EarlyStopping("score", verbose=False, **kwargs)
    trainer = make_trainer(max_epochs=10, limit_train_batches=1, callbacks=[stopper])
    assert stopper.stopping_reason == EarlyStoppingReason.NOT_STOPPED
    trainer.fit(_Scored(scores))
    assert stopper.stopping_reason == reason and message in stopper.stopping_reason_message
    assert trainer.current_epoch < 10


def test_early_stopping_strict_false_skips_a_missing_metric_with_a_warning(make_trainer: Any) -> None:
    stopper = EarlyStopping("nowhere", strict=False, verbose=True)
    with pytest.warns(RuntimeWarning, match="nowhere"):
        make_trainer(max_epochs=2, limit_train_batches=1, callbacks=[stopper]).fit(TinyModule())
    with pytest.raises(RuntimeError, match="monitors 'nowhere'"):
        make_trainer(max_epochs=1, limit_train_batches=1,
                     callbacks=[EarlyStopping("nowhere", verbose=False)]).fit(TinyModule())


def test_two_callbacks_of_one_class_keep_their_own_state_in_a_checkpoint(make_trainer: Any,
                                                                         tmp_path: Any) -> None:
    """The state key names the callback's settings, as Lightning's: before, both EarlyStoppings (and both
    ModelCheckpoints) wrote one entry, and one's state was lost."""
    first, second = EarlyStopping("score", patience=5, verbose=False), EarlyStopping("score", mode="max",
                                                                                    patience=5, verbose=False)
    by_loss = ModelCheckpoint(dirpath=str(tmp_path / "a"), monitor="val/loss")
    by_step = ModelCheckpoint(dirpath=str(tmp_path / "b"), monitor="step", mode="max")
    trainer = make_trainer(max_epochs=3, limit_train_batches=1, callbacks=[first, second, by_loss, by_step])
    trainer.fit(_Scored([3.0, 2.0, 1.0]))
    path = str(tmp_path / "end.ckpt")
    trainer.save_checkpoint(path)
    states = torch.load(path, weights_only=True)["callbacks"]
    assert first.state_key != second.state_key and by_loss.state_key != by_step.state_key
    assert states[first.state_key]["best_score"] == 1.0 and states[second.state_key]["best_score"] == 3.0
    assert states[by_step.state_key]["best_model_path"] != states[by_loss.state_key]["best_model_path"]
    again_first, again_second = (EarlyStopping("score", patience=5, verbose=False),
                                 EarlyStopping("score", mode="max", patience=5, verbose=False))
    make_trainer(max_epochs=3, callbacks=[again_first, again_second]).fit(_Scored([3.0]), ckpt_path=path)
    assert (again_first.best_score, again_second.best_score) == (1.0, 3.0)


# --------------------------------------------------------------------------- ModelCheckpoint


def test_model_checkpoint_exposes_lightnings_top_k_attributes(make_trainer: Any, tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", save_top_k=2, filename="{epoch}")
    assert checkpoint.kth_value == math.inf and checkpoint.best_model_path == "" == checkpoint.last_model_path
    make_trainer(max_epochs=4, limit_train_batches=1, callbacks=[checkpoint],
                 enable_checkpointing=True).fit(_Scored([4.0, 1.0, 3.0, 2.0]))
    best = {os.path.basename(p): s for p, s in checkpoint.best_k_models.items()}
    assert best == {"epoch=1.ckpt": 1.0, "epoch=3.ckpt": 2.0}
    assert os.path.basename(checkpoint.kth_best_model_path) == "epoch=3.ckpt" and checkpoint.kth_value == 2.0
    assert checkpoint.current_score == 2.0 and checkpoint.best_model_score == 1.0
    checkpoint.to_yaml()
    with open(tmp_path / "best_k_models.yaml") as f:
        assert {os.path.basename(k): v for k, v in yaml.safe_load(f).items()} == best


def test_model_checkpoint_state_is_settable_and_reloads_only_into_its_own_dirpath(tmp_path: Any) -> None:
    """Lightning code restores a ModelCheckpoint by setting ``best_k_models`` (``kth_*`` follow from it, and
    a consistent value is accepted); the state carries Lightning's keys; loaded into a callback writing
    elsewhere only ``best_model_path`` comes back, with Lightning's warning."""
    here, elsewhere = str(tmp_path / "a"), str(tmp_path / "b")
    writer = ModelCheckpoint(dirpath=here, monitor="loss", mode="max", save_top_k=-1)
    writer.best_k_models = {os.path.join(here, "x.ckpt"): torch.tensor(1.0),
                            os.path.join(here, "y.ckpt"): torch.tensor(3.0)}
    assert writer.kth_best_model_path == os.path.join(here, "x.ckpt") and writer.kth_value == 1.0
    writer.kth_value = torch.tensor(1.0)  # what it is: accepted
    with pytest.raises(ValueError, match="set best_k_models to change it"):
        writer.kth_best_model_path = os.path.join(here, "y.ckpt")
    writer.best_model_path = os.path.join(here, "y.ckpt")
    writer.last_model_path = os.path.join(here, "l.ckpt")
    state = writer.state_dict()
    assert {"best_k_models", "kth_best_model_path", "kth_value", "dirpath"} <= set(state)
    assert state["best_k_models"] == {os.path.join(here, "x.ckpt"): 1.0, os.path.join(here, "y.ckpt"): 3.0}
    same = ModelCheckpoint(dirpath=here, monitor="loss", mode="max", save_top_k=-1)
    same.load_state_dict(state)
    assert same.best_k_models == writer.best_k_models and same.last_model_path == writer.last_model_path
    other = ModelCheckpoint(dirpath=elsewhere, monitor="loss", mode="max", save_top_k=-1)
    with pytest.warns(UserWarning, match="The dirpath has changed from .* Only `best_model_path` will be"):
        other.load_state_dict(state)
    assert other.best_model_path == writer.best_model_path
    assert other.best_k_models == {} and other.last_model_path == "" and other.best_model_score is None


def test_model_checkpoint_ranks_a_nan_below_every_number(make_trainer: Any, tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", save_top_k=1, filename="{epoch}")
    make_trainer(max_epochs=2, limit_train_batches=1, callbacks=[checkpoint],
                 enable_checkpointing=True).fit(_Scored([math.nan, 5.0]))
    assert os.path.basename(checkpoint.best_model_path) == "epoch=1.ckpt"
    assert checkpoint.best_model_score == 5.0


def test_model_checkpoint_expands_home_and_every_n_epochs_zero_saves_no_epoch(make_trainer: Any,
                                                                              tmp_path: Any,
                                                                              monkeypatch: Any) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    checkpoint = ModelCheckpoint(dirpath="~/ckpts", every_n_epochs=0, save_on_fit_end=False, save_last=False)
    assert checkpoint.dirpath == os.path.realpath(tmp_path / "ckpts")
    make_trainer(max_epochs=2, limit_train_batches=1, callbacks=[checkpoint], enable_checkpointing=True,
                 ).fit(TinyModule())
    assert not os.path.exists(tmp_path / "ckpts") or not os.listdir(tmp_path / "ckpts")


class _FailsAtStep(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 3:
            raise RuntimeError("Trouble!")
        return super().training_step(batch, batch_idx)


def test_save_on_exception_writes_the_state_when_the_fit_raises(make_trainer: Any, tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), filename="exception", save_on_exception=True,
                                 every_n_epochs=7)
    trainer = make_trainer(max_epochs=4, limit_train_batches=2, callbacks=[checkpoint],
                           enable_checkpointing=True)
    module = _FailsAtStep()
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(module)
    saved = torch.load(tmp_path / "exception.ckpt", weights_only=True)
    assert saved["loop"]["global_step"] == 3
    assert torch.equal(saved["state_dict"]["net.weight"], module.net.weight.detach())


def test_on_exception_checkpoint_saves_resumes_and_never_replaces_a_foreign_file(make_trainer: Any,
                                                                                 tmp_path: Any) -> None:
    (tmp_path / "on_exception.ckpt").write_text("someone else's")
    saver = OnExceptionCheckpoint(str(tmp_path))
    with pytest.raises(RuntimeError, match="Trouble!"):
        make_trainer(max_epochs=4, limit_train_batches=2, callbacks=[saver]).fit(_FailsAtStep())
    assert (tmp_path / "on_exception.ckpt").read_text() == "someone else's"
    assert saver.ckpt_path == str(tmp_path / "on_exception-v1.ckpt")
    resumed = make_trainer(max_epochs=4, limit_train_batches=2, callbacks=[saver])
    resumed.fit(TinyModule(), ckpt_path=saver.ckpt_path)
    assert resumed.global_step == 8
    assert not os.path.exists(tmp_path / "on_exception-v1.ckpt")  # stale once a stage ends without error
    assert os.path.exists(tmp_path / "on_exception.ckpt")


def test_a_checkpoint_file_holds_the_weights_under_state_dict_once(make_trainer: Any, tmp_path: Any) -> None:
    trainer = make_trainer(max_epochs=1)
    module = TinyModule()
    module.net = torch.nn.Linear(4, 4096)  # weights large enough that a second copy would show
    module.training_step = lambda batch, batch_idx: module.net(batch[0]).pow(2).mean()
    trainer.fit(module)
    path = str(tmp_path / "w.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["state_dict"].keys() == saved["model"].keys()
    weights = sum(t.numel() * t.element_size() for t in saved["model"].values())
    optimizer = sum(t.numel() * t.element_size() for s in saved["optimizer"] for t in _tensors(s))
    assert os.path.getsize(path) < weights + optimizer + 256 * 1024


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


# --------------------------------------------------------------------------- LearningRateMonitor


def test_learning_rate_monitor_keeps_what_it_logged(make_trainer: Any) -> None:
    class Scheduled(TinyModule):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    monitor = LearningRateMonitor(logging_interval="epoch", log_momentum=True)
    make_trainer(max_epochs=3, limit_train_batches=1, callbacks=[monitor]).fit(Scheduled())
    assert monitor.lrs == {"lr-SGD": [0.1, 0.05, 0.025]}
    assert monitor.last_momentum_values == {"lr-SGD-momentum": 0.9}


# --------------------------------------------------------------------------- several evaluation loaders


class _SeveralLoaders(TinyModule):
    """Two validation/test/predict loaders of different lengths; records each step's arguments."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(n=8, **kwargs)
        self.calls: list[tuple[str, int, int]] = []
        self.hook_calls: list[tuple[int, int]] = []

    def _loaders(self) -> list[DataLoader]:
        return [DataLoader(TinyModule(n=8).train_ds, batch_size=4),
                DataLoader(TinyModule(n=4).train_ds, batch_size=2)]

    def val_dataloader(self) -> list[DataLoader]:
        return self._loaders()

    def test_dataloader(self) -> dict[str, DataLoader]:
        a, b = self._loaders()
        return {"a": a, "b": b}

    def predict_dataloader(self) -> list[DataLoader]:
        return self._loaders()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.calls.append(("val", batch_idx, dataloader_idx))
        loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("val/loss", loss)
        self.log("seen", 1.0, reduce_fx="sum", add_dataloader_idx=False)
        return loss

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.calls.append(("test", batch_idx, dataloader_idx))
        self.log("test/loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch[0])

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.hook_calls.append((batch_idx, dataloader_idx))


def test_several_validation_loaders_run_one_after_the_other_with_their_index(make_trainer: Any) -> None:
    module = _SeveralLoaders()
    trainer = make_trainer()
    results = trainer.validate(module, verbose=False)
    assert module.calls == [("val", 0, 0), ("val", 1, 0), ("val", 0, 1), ("val", 1, 1)]
    assert module.hook_calls == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert trainer.num_val_batches == [2, 2] and len(trainer.val_dataloaders) == 2
    assert [sorted(r) for r in results] == [["seen", "val/loss/dataloader_idx_0"],
                                           ["seen", "val/loss/dataloader_idx_1"]]
    assert results[0]["seen"] == results[1]["seen"] == 4.0  # logged without a suffix: the whole pass
    weight = module.net.weight.detach()
    for i, loader in enumerate(module._loaders()):
        x, y = (torch.cat(t) for t in zip(*loader))
        expected = torch.nn.functional.mse_loss(x @ weight.T + module.net.bias.detach(), y)
        assert results[i][f"val/loss/dataloader_idx_{i}"] == pytest.approx(float(expected), rel=1e-6)


def test_a_dict_of_test_loaders_and_a_list_of_predict_loaders(make_trainer: Any, capsys: Any) -> None:
    module = _SeveralLoaders()
    results = make_trainer().test(module)
    assert [list(r) for r in results] == [["test/loss/dataloader_idx_0"], ["test/loss/dataloader_idx_1"]]
    assert "DataLoader 1" in capsys.readouterr().out  # the table has a column per loader
    predictions = make_trainer().predict(module)
    assert [len(p) for p in predictions] == [2, 2] and predictions[1][0].shape == (2, 1)


def test_a_fit_validates_every_loader_and_the_sanity_check_reads_each(make_trainer: Any) -> None:
    module = _SeveralLoaders()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=1)
    trainer.fit(module)
    assert module.calls == [("val", 0, 0), ("val", 0, 1),  # the sanity check: one batch of each
                            ("val", 0, 0), ("val", 1, 0), ("val", 0, 1), ("val", 1, 1)]
    assert {"val/loss/dataloader_idx_0", "val/loss/dataloader_idx_1"} <= set(trainer.callback_metrics)


def test_limit_val_batches_zero_asks_for_no_loader_and_runs_no_hook(make_trainer: Any) -> None:
    class Watched(_SeveralLoaders):
        def val_dataloader(self) -> Any:
            raise AssertionError("the loader was asked for")

        def on_validation_start(self) -> None:
            raise AssertionError("a validation hook ran")

    assert make_trainer(limit_val_batches=0).validate(Watched()) == []


# --------------------------------------------------------------------------- hyperparameters


class _FromNamespace(TinyModule):
    def __init__(self, hparams: Any) -> None:
        super().__init__()
        self.received = type(hparams)
        self.save_hyperparameters(hparams)


def test_hyperparameters_held_by_one_argument_come_back_through_it(make_trainer: Any, tmp_path: Any) -> None:
    """A Namespace or DictConfig saved whole is passed back to that argument by load_from_checkpoint (the file
    records the argument's name and kind), a DictConfig stays one, and nothing in the file is pickled."""
    import argparse

    from omegaconf import DictConfig, OmegaConf

    for given, kind in ((argparse.Namespace(width=3, name="a"), argparse.Namespace),
                        (OmegaConf.create({"width": 3, "inner": {"depth": 2}}), DictConfig)):
        module = _FromNamespace(given)
        trainer = make_trainer(max_epochs=1, limit_train_batches=1)
        trainer.fit(module)
        path = str(tmp_path / f"{kind.__name__}.ckpt")
        trainer.save_checkpoint(path)
        saved = torch.load(path, weights_only=True)  # plain values only
        assert saved["hparams_name"] == "hparams" and saved["hparams_type"] in ("Namespace", "DictConfig")
        loaded = _FromNamespace.load_from_checkpoint(path, weights_only=False)
        assert issubclass(loaded.received, kind) and loaded.hparams.width == 3
        assert isinstance(loaded.hparams, DictConfig) == (kind is DictConfig)


class _WithConfigArgument(TinyModule):
    def __init__(self, width: int = 3, options: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_a_config_among_the_hyperparameters_comes_back_a_config(make_trainer: Any, tmp_path: Any) -> None:
    """An OmegaConf config passed as one of several arguments is stored as plain values (the file loads with
    weights_only=True) and load_from_checkpoint hands it back as a config, as Lightning's (pickled) does."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    for options in (OmegaConf.create({"depth": 2, "inner": {"name": "a"}}), OmegaConf.create([1, 2])):
        trainer = make_trainer(max_epochs=1, limit_train_batches=1)
        trainer.fit(_WithConfigArgument(width=5, options=options))
        path = str(tmp_path / f"{type(options).__name__}.ckpt")
        trainer.save_checkpoint(path)
        saved = torch.load(path, weights_only=True)
        assert saved["hparams_omegaconf"] == ["options"]
        loaded = _WithConfigArgument.load_from_checkpoint(path)
        assert isinstance(loaded.hparams.options, (DictConfig, ListConfig))
        assert type(loaded.hparams.options) is type(options) and loaded.hparams.options == options
        assert loaded.hparams.width == 5
    trainer.fit(_WithConfigArgument(options={"depth": 2}))  # a plain dict stays a dict
    trainer.save_checkpoint(str(tmp_path / "dict.ckpt"))
    assert "hparams_omegaconf" not in torch.load(str(tmp_path / "dict.ckpt"), weights_only=True)
    assert type(_WithConfigArgument.load_from_checkpoint(str(tmp_path / "dict.ckpt")).hparams.options) is dict


class _HeldObject:
    """Something only an unrestricted unpickler rebuilds."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_a_stage_reads_pickled_objects_only_when_weights_only_is_false(make_trainer: Any,
                                                                         tmp_path: Any) -> None:
    """Lightning's ``weights_only`` on fit/validate/test/predict: a Lightning checkpoint whose hyperparameters
    are objects is refused by default (torch's safe loading) and evaluated with ``weights_only=False``."""
    from polytrain.core.errors import CheckpointError

    source = TinyModule()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)  # weights that differ from a fresh module's
    path = str(tmp_path / "lightning.ckpt")
    torch.save({"pytorch-lightning_version": "2.6.5", "state_dict": source.state_dict(),
                "hyper_parameters": {"held": _HeldObject("x")}}, path)
    fresh = TinyModule()
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        make_trainer().validate(fresh, ckpt_path=path, verbose=False)
    for stage in ("validate", "test"):
        module = TinyModule()
        getattr(make_trainer(), stage)(module, ckpt_path=path, verbose=False, weights_only=False)
        for mine, theirs in zip(module.parameters(), source.parameters()):
            assert torch.equal(mine.cpu(), theirs)
    module = TinyModule()
    make_trainer().predict(module, ckpt_path=path, weights_only=False)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(module.parameters(), source.parameters()))
    # the trust ends with the call that gave it
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        make_trainer().test(TinyModule(), ckpt_path=path, verbose=False)


def test_load_from_checkpoint_drops_keywords_init_does_not_take_with_a_warning(make_trainer: Any,
                                                                             tmp_path: Any) -> None:
    trainer = make_trainer(max_epochs=1, limit_train_batches=1)
    trainer.fit(TinyModule())
    path = str(tmp_path / "m.ckpt")
    trainer.save_checkpoint(path)
    with pytest.warns(UserWarning, match=r"\['typo'\] ignored: not arguments of TinyModule.__init__ "
                                         r"\(batch_size"):
        loaded = TinyModule.load_from_checkpoint(path, typo=1, lr=0.5)
    assert loaded.lr == 0.5 and not hasattr(loaded, "typo")
    with pytest.raises(ValueError, match="Primitives"):
        _FromNamespace(3.5)


# --------------------------------------------------------------------------- Lightning's warnings


def test_the_warnings_lightning_users_rely_on(make_trainer: Any, monkeypatch: Any) -> None:
    import polytrain.trainer.loops.data_connector as connector

    monkeypatch.setattr(connector.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    module = TinyModule(n=8)
    module.net.eval()
    from polytrain.callbacks import CSVLogger

    trainer = make_trainer(max_epochs=1, log_every_n_steps=50, logger=CSVLogger(make_trainer().run_dir))
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module)
    said = [str(w.message) for w in caught]
    assert any("'train_dataloader' does not have many workers" in m and "num_workers=7" in m for m in said)
    assert any("number of training batches (2) is smaller than the logging interval" in m for m in said)
    assert any("1 module(s) in eval mode at the start of training (net)" in m for m in said)


def test_lightning_worded_config_errors(make_trainer: Any) -> None:
    with pytest.raises(MisconfigurationException, match="passed invalid value"):
        make_trainer(limit_val_batches=1.2)
    with pytest.raises(MisconfigurationException, match="should be >= 0"):
        make_trainer(fast_dev_run=-1)
    with pytest.raises(MisconfigurationException, match="should be an int >= 0"):
        make_trainer(reload_dataloaders_every_n_epochs=-1)
    # a value of the wrong type gets the same words, with what was given
    with pytest.raises(MisconfigurationException, match=r"reload_dataloaders_every_n_epochs should be an int "
                                                         r">= 0, got 'test' \(str; expected int\)"):
        make_trainer(reload_dataloaders_every_n_epochs="test")
    with pytest.raises(MisconfigurationException, match=r"min_steps should be an int >= 0 or null, got 1.5"):
        make_trainer(min_steps=1.5)


# --------------------------------------------------------------------------- the trainer's surface


class _TwoBackwardsPerBatch(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=8, batch_size=4, val_n=None)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        for half in (x[:2], x[2:]):
            self.manual_backward(torch.nn.functional.mse_loss(self(half), y[: len(half)]))
        optimizer.step()


def test_the_strategy_exists_before_the_first_stage_and_its_backward_runs_each_manual_backward(
        make_trainer: Any) -> None:
    """As Lightning: ``trainer.strategy`` is there once the Trainer is built (code wraps its ``backward``
    before ``fit``), importable as ``polytrain.strategies.Strategy``; every ``manual_backward`` goes
    through ``Strategy.backward``; the process group is not started until a stage starts."""
    from unittest import mock

    import torch.distributed as dist

    from polytrain.strategies import SingleDeviceStrategy, Strategy

    trainer = make_trainer(max_epochs=1)
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert trainer.global_rank == 0 and trainer.world_size == 1
    assert not dist.is_initialized()
    built = trainer.strategy
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(_TwoBackwardsPerBatch())
    assert backward.call_count == 2 * 2  # two batches, two backward passes each
    assert trainer.strategy is built and trainer.global_step == 2
    # under plan: true the planner needs the model: no strategy until a stage starts
    planned = make_trainer(strategy={"name": "parallel", "plan": True})
    assert planned.strategy is None


def test_metrics_are_tensors_and_reduce_fx_takes_lightnings_spellings(make_trainer: Any) -> None:
    class Spelled(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.log("top", float(batch_idx), on_epoch=True, on_step=False, reduce_fx=torch.max,
                     prog_bar=True)
            self.log("total", 1.0, on_epoch=True, on_step=False, reduce_fx="SUM")
            self.log("avg", float(batch_idx), on_epoch=True, on_step=False, reduce_fx="avg")
            return loss

    trainer = make_trainer(max_epochs=1, logger=True)
    trainer.fit(Spelled(n=16))
    logged, shown = trainer.logged_metrics, trainer.progress_bar_metrics
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in logged.values())
    assert all(isinstance(v, float) for v in shown.values()) and shown["top"] == 3.0  # as Lightning
    assert (float(logged["top"]), float(logged["total"]), float(logged["avg"])) == (3.0, 4.0, 1.5)
    assert trainer.progress_bar_callback is None or "top" in trainer.progress_bar_callback.get_metrics(
        trainer, trainer.lightning_module)
    only = r"only `self.log\(..., reduce_fx=\{min,max,mean,sum\}\)` are supported"
    with pytest.raises(MisconfigurationException, match=only):
        make_trainer(max_epochs=1).fit(_LogsWith(reduce_fx=torch.median))


class _LogsWith(TinyModule):
    def __init__(self, **log_kwargs: Any) -> None:
        super().__init__()
        self.log_kwargs = log_kwargs

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("x", 1.0, **self.log_kwargs)
        return super().training_step(batch, batch_idx)


def test_gradients_left_before_a_stage_are_cleared_when_it_starts(make_trainer: Any) -> None:
    seen: list[bool] = []

    class Leftover(TinyModule):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                seen.append(self.net.weight.grad is None)

    module = Leftover()
    module.net.weight.grad = torch.ones_like(module.net.weight)  # from the user's own code before fit
    make_trainer(max_epochs=1, limit_train_batches=1).fit(module)
    assert seen == [True]


def test_a_mid_epoch_resume_does_not_start_that_epoch_again(make_trainer: Any, tmp_path: Any) -> None:
    """As Lightning: the resumed epoch had begun (its on_train_epoch_start ran before the checkpoint);
    the fit-end checkpoint is written before on_train_end runs."""
    starts: list[int] = []
    order: list[str] = []

    class Epochs(Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            starts.append(trainer.current_epoch)

        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
            order.append("save")

        def on_train_end(self, trainer: Any, module: Any) -> None:
            order.append("on_train_end")

    saver = ModelCheckpoint(dirpath=str(tmp_path), every_n_epochs=0)
    first = make_trainer(max_steps=3, callbacks=[saver, Epochs()], enable_checkpointing=True)
    first.fit(TinyModule(n=16))
    assert order == ["save", "on_train_end"] and starts == [0]
    starts.clear()
    make_trainer(max_epochs=2, callbacks=[Epochs()]).fit(TinyModule(n=16), ckpt_path=saver.last_model_path)
    assert starts == [1]  # epoch 0 resumed at batch 3 without its start hook; epoch 1 starts


def test_a_manual_step_hands_the_closure_and_keywords_to_the_optimizer(make_trainer: Any) -> None:
    received: list[tuple[bool, dict[str, Any]]] = []

    class Recording(torch.optim.LBFGS):
        def step(self, closure: Any = None, **kwargs: Any) -> Any:
            received.append((closure is not None, kwargs))
            return super().step(closure)

    class Manual(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self) -> Any:
            return Recording(self.parameters(), lr=0.1, max_iter=2)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
                self.manual_backward(loss)
                return loss

            opt.step(closure=closure, hint="kept")

    make_trainer(max_epochs=1, limit_train_batches=2).fit(Manual())
    assert received == [(True, {"hint": "kept"})] * 2


def test_the_trainer_names_each_stages_loaders_and_batches(make_trainer: Any) -> None:
    module, trainer = _SeveralLoaders(), make_trainer(num_sanity_val_steps=1)
    assert trainer.test_dataloaders is None and trainer.num_test_batches == []
    trainer.test(module, verbose=False)
    assert len(trainer.test_dataloaders) == 2 and trainer.num_test_batches == [2, 2]
    trainer.predict(module)
    assert len(trainer.predict_dataloaders) == 2 and trainer.num_predict_batches == [2, 2]
    trainer.validate(module, verbose=False)
    assert trainer.num_sanity_val_batches == []  # a fit's count: a Trainer that only validated has none
    trainer.fit(module)
    assert trainer.num_sanity_val_batches == [1, 1]


# --------------------------------------------------------------------------- options, loggers, DataModules


def test_deterministic_warn_turns_errors_into_warnings(make_trainer: Any) -> None:
    try:
        make_trainer(max_epochs=1, limit_train_batches=1, deterministic="warn").fit(TinyModule())
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(MisconfigurationException, match="use true, false or 'warn'"):
        make_trainer(deterministic="sometimes")


def test_csv_logger_names_and_hyperparameters_yaml_cannot_hold(tmp_path: Any) -> None:
    from polytrain.loggers import CSVLogger
    from polytrain.loggers.csv_logs import ExperimentWriter

    assert (ExperimentWriter.NAME_METRICS_FILE, ExperimentWriter.NAME_HPARAMS_FILE) == ("metrics.csv",
                                                                                         "hparams.yaml")
    logger = CSVLogger(str(tmp_path), name=None)
    assert logger.log_dir == os.path.join(str(tmp_path), "version_0")
    with pytest.warns(UserWarning, match="Skipping 'layer' parameter"):
        logger.log_hyperparams({"lr": 0.1, "layer": torch.nn.BatchNorm1d(3)})
    logger.log_hyperparams()
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert yaml.safe_load(f) == {"lr": 0.1}


def test_from_datasets_builds_the_datamodule_with_its_own_arguments() -> None:
    from polytrain import LightningDataModule

    class Known(LightningDataModule):
        def __init__(self, other: int, batch_size: int = 1) -> None:
            super().__init__()
            self.other, self.batch_size = other, batch_size

    dataset = TinyModule(n=8).train_ds
    dm = Known.from_datasets(dataset, batch_size=4, num_workers=0, other=5)
    assert (dm.other, dm.batch_size) == (5, 4) and dm.train_dataloader().batch_size == 4
    with pytest.raises(TypeError, match="other"):
        Known.from_datasets(dataset, batch_size=4)


def test_progress_bar_batch_totals(make_trainer: Any) -> None:
    from polytrain.callbacks import TQDMProgressBar

    totals: list[Any] = []

    class Reader(Callback):
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            bar = trainer.progress_bar_callback
            totals.append((bar.total_train_batches, bar.total_val_batches))

    bar = TQDMProgressBar(refresh_rate=0)
    make_trainer(max_epochs=4, limit_val_batches=2, check_val_every_n_epoch=2, enable_progress_bar=True,
                 callbacks=[bar, Reader()]).fit(TinyModule(n=16))
    assert totals == [(4, 0), (4, 2), (4, 0), (4, 2)]


def test_learning_rate_monitor_checks_names_and_momentum(make_trainer: Any) -> None:
    class Named(TinyModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([{"params": [self.net.weight], "name": "same"},
                                    {"params": [self.net.bias], "name": "same"}], lr=0.1)

    with pytest.raises(MisconfigurationException, match="identical `name` values"):
        make_trainer(max_epochs=1, callbacks=[LearningRateMonitor()]).fit(Named())

    class Adagrad(TinyModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

    with pytest.warns(RuntimeWarning, match="do not have momentum \\(Adagrad\\)"):
        make_trainer(max_epochs=1, limit_train_batches=1,
                     callbacks=[LearningRateMonitor(log_momentum=True)]).fit(Adagrad())


def test_an_iterable_dataset_empty_for_an_epoch_ends_that_epoch(make_trainer: Any) -> None:
    from torch.utils.data import IterableDataset

    class FirstEpochOnly(TinyModule):
        def train_dataloader(self) -> DataLoader:
            module = self

            class Stream(IterableDataset):
                def __iter__(self) -> Any:
                    return iter(list(module.train_ds)[:3] if module.current_epoch == 0 else [])

            return DataLoader(Stream(), batch_size=2)

    trainer = make_trainer(max_epochs=2, limit_val_batches=0)
    with pytest.warns(UserWarning, match="yielded no batch in epoch 1 .* the epoch ends without a step"):
        trainer.fit(FirstEpochOnly())
    assert (trainer.global_step, trainer.current_epoch) == (2, 2)


def test_without_validation_step_checkpoints_and_early_stopping_work_on_training_metrics(
        make_trainer: Any, tmp_path: Any) -> None:
    class NoValidation(TinyModule):
        validation_step = None

        def on_train_epoch_end(self) -> None:
            self.log("score", 1.0)  # never improves

    saver = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", filename="{epoch}")
    stopper = EarlyStopping("score", patience=1, verbose=False)
    trainer = make_trainer(max_epochs=5, callbacks=[saver, stopper], enable_checkpointing=True)
    trainer.fit(NoValidation())
    assert trainer.num_val_batches == [] and stopper.stopping_reason == EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert os.path.basename(saver.best_model_path) == "epoch=0.ckpt" and trainer.current_epoch == 2


def test_logging_nothing_is_refused_and_a_long_interval_without_validation_is_fine(make_trainer: Any) -> None:
    with pytest.raises(MisconfigurationException, match=r"on_step=False, on_epoch=False\) is not useful"):
        make_trainer(max_epochs=1).fit(_LogsWith(on_step=False, on_epoch=False))
    trainer = make_trainer(max_epochs=1, val_check_interval=10, limit_val_batches=0)
    trainer.fit(TinyModule(n=16))  # 4 batches an epoch: the interval would be refused were there validation
    assert trainer.global_step == 4


def test_schedulers_under_manual_optimization_and_a_custom_scheduler(make_trainer: Any) -> None:
    class Stepless:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer, self.calls = optimizer, 0

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

    class ByHand(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self(batch[0]), batch[1]))
            opt.step()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return [opt], [{"scheduler": plateau, "monitor": "train_loss", "interval": "step"}]

    trainer = make_trainer(max_epochs=1)
    with pytest.warns(RuntimeWarning, match=r"\['monitor'\], but the keys will be ignored"):
        trainer.fit(ByHand())  # the module steps its own schedulers: no metric needed by the loop
    assert trainer.lr_scheduler_configs[0].interval == "step"

    class Custom(TinyModule):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [Stepless(opt)]

    with pytest.raises(ValueError, match=r"`Stepless` doesn't follow PyTorch's LRScheduler API .* override "
                                         r"the `Custom.lr_scheduler_step` hook"):
        make_trainer(max_epochs=1).fit(Custom())

    class Told(Custom):
        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            scheduler.calls += 1

    told = Told()
    trainer = make_trainer(max_epochs=1)
    trainer.fit(told)
    assert trainer.lr_scheduler_configs[0].scheduler.calls == 1  # once, at the epoch's end


def test_minus_one_from_on_train_batch_start_skips_the_rest_of_the_epoch(make_trainer: Any) -> None:
    seen: list[tuple[int, int]] = []

    class Skips(TinyModule):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            seen.append((self.current_epoch, batch_idx))
            return -1 if batch_idx == 2 else None

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)]

    trainer = make_trainer(max_epochs=3)
    trainer.fit(Skips(n=40, batch_size=4, val_n=None))
    # each epoch: batches 0 and 1 step, batch 2 ends it; the next epoch starts at its first batch
    assert seen == [(e, b) for e in range(3) for b in range(3)] and trainer.global_step == 6
    assert trainer.current_epoch == 3
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**3)  # stepped every epoch


def test_clip_gradients_takes_the_trainers_values_and_refuses_contradicting_them(make_trainer: Any) -> None:
    norms: list[float] = []

    class ClipsItself(TinyModule):
        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            self.clip_gradients(optimizer)  # the Trainer's value and algorithm
            norms.append(float(torch.cat([p.grad.flatten() for p in self.parameters()]).norm()))

    make_trainer(max_epochs=1, gradient_clip_val=1e-3).fit(ClipsItself(val_n=None))
    assert norms and max(norms) <= 1e-3 * 1.0001

    class Contradicts(TinyModule):
        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            self.clip_gradients(optimizer, gradient_clip_val=1e-2)

    with pytest.raises(ValueError, match=r"`Trainer\(gradient_clip_val=0.0001\)` and have passed "
                                         r"`clip_gradients\(gradient_clip_val=0.01\)`"):
        make_trainer(max_epochs=1, gradient_clip_val=1e-4).fit(Contradicts(val_n=None))


# --------------------------------------------------------------------------- the optimizers a module sees


class _DecayedSGD(TinyModule):
    """SGD (no momentum: its state stays empty) with an epoch StepLR; from ``freeze_from`` on, each batch
    sets the learning rate to 0 through ``self.optimizers()``, as a hand-written warmup does."""

    def __init__(self, freeze_from: int | None = None) -> None:
        super().__init__(n=8, batch_size=4)
        self.freeze_from = freeze_from

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.freeze_from is not None and self.current_epoch >= self.freeze_from:
            for group in self.optimizers().param_groups:
                group["lr"] = 0.0


def test_the_optimizers_a_module_sees_stay_the_ones_stepping_across_checkpoints_and_resumes(
        make_trainer: Any, run_dir: str) -> None:
    # A checkpoint of an optimizer without state (plain SGD) and a resume both rebuild the optimizer's
    # param_groups; the optimizer a module and the Trainer hand out must show and change the live ones.
    trainer = make_trainer(max_epochs=3, enable_checkpointing=True, val_check_interval=None)
    trainer.fit(_DecayedSGD())
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == pytest.approx([0.1 * 0.1 ** 3])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 ** 3)

    module = _DecayedSGD(freeze_from=3)
    resumed = make_trainer(max_epochs=4, enable_checkpointing=False)
    resumed.fit(module, ckpt_path=trainer.checkpoint_callback.best_model_path or "last")
    saved = torch.load(trainer.checkpoint_callback.last_model_path, weights_only=False)["state_dict"]
    # the learning rate set to 0 through self.optimizers() reached the update: epoch 3 moved nothing
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


class _LogsItself(Callback):
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.log("from_callback", 2.0 * (trainer.current_epoch + 1))
        self.log_dict({"a": 1.0, "b": 3.0})

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.log("val_from_callback", 7.0)


class _OwnLog(Callback):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, line: str) -> None:  # a callback's own method of that name stays its own
        self.lines.append(line)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.log(f"epoch {trainer.current_epoch}")


def test_a_callback_logs_with_self_log_as_in_lightning(make_trainer: Any) -> None:
    own = _OwnLog()
    trainer = make_trainer(max_epochs=2, callbacks=[_LogsItself(), own])
    trainer.fit(TinyModule())
    metrics = trainer.callback_metrics
    assert {k: float(metrics[k]) for k in ("from_callback", "a", "b", "val_from_callback")} == {
        "from_callback": 4.0, "a": 1.0, "b": 3.0, "val_from_callback": 7.0}
    assert own.lines == ["epoch 0", "epoch 1"]
    trainer.validate(TinyModule())
    assert float(trainer.callback_metrics["val_from_callback"]) == 7.0


def test_a_module_attached_to_a_trainer_scripts_and_computes_the_same(make_trainer: Any) -> None:
    # torch.jit.script compiles properties too: the Trainer's (trainer, hparams, device, ...) stay out
    module = TinyModule()
    module.trainer = make_trainer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated, not gone
        scripted = torch.jit.script(module)
    x = torch.randn(3, 4)
    torch.testing.assert_close(scripted(x), module(x), rtol=0, atol=0)


class _SchedulerOnTheWrapper(TinyModule):
    """Manual optimisation whose scheduler is built on ``self.optimizers()`` once training starts."""

    def __init__(self) -> None:
        super().__init__(n=8, batch_size=4)
        self.automatic_optimization = False

    def on_train_start(self) -> None:
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizers(), step_size=1, gamma=0.5)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()
        self.scheduler.step()


def test_a_scheduler_built_on_the_wrapped_optimizer_steps_it(make_trainer: Any) -> None:
    # The scheduler wraps the optimizer's step to see it called; on the wrapper, not on the raw optimizer
    # the update steps (which would call back into the wrapper without end).
    module = _SchedulerOnTheWrapper()
    trainer = make_trainer(max_epochs=2)
    trainer.fit(module)
    assert trainer.global_step == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)


def test_a_step_taking_the_iterator_is_refused_in_words(make_trainer: Any) -> None:
    """Lightning's experimental ``validation_step(dataloader_iter)`` is not offered: said in words (it was a
    bare TypeError about positional arguments)."""
    from polytrain.core.errors import ConfigError

    class Iterating(TinyModule):
        def validation_step(self, dataloader_iter: Any) -> Any:
            return next(dataloader_iter)

        def training_step(self, dataloader_iter: Any) -> Any:
            return super().training_step(next(dataloader_iter), 0)

    for run in (lambda t: t.validate(Iterating(), verbose=False), lambda t: t.fit(Iterating())):
        with pytest.raises(ConfigError, match=r"Iterating\.\w+_step\(dataloader_iter\): a step that draws "
                                              r"its batches from the iterator .* is not offered"):
            run(make_trainer(max_epochs=1, num_sanity_val_steps=0))
