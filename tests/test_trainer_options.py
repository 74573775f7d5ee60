"""Every Lightning ``Trainer`` option, with Lightning's meaning (notes/lightning-spec.md §g).

The expected numbers are Lightning 2.6.6's, measured with the same shape of job: 9 training batches
and 4 validation batches per epoch (36 and 16 samples, batches of 4). Each test checks what the option
does (which batches ran, when validation ran, what was written), not only that it is accepted.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer, TrainModule
from polytrain.callbacks import CSVLogger, EarlyStopping, ModelCheckpoint
from polytrain.core import process_group
from polytrain.core.errors import ConfigError
from polytrain.strategies.launcher import plan_launch
from polytrain.trainer.configuration.config import parse_duration, validate_trainer_config

pytestmark = pytest.mark.own_logic

QUIET = dict(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Recorder(TrainModule):
    """9 training and 4 validation batches; records what ran, when, and the weights after each epoch."""

    def __init__(self, n_train: int = 36, n_val: int = 16, shuffle: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.train_ds, self.val_ds = _data(n_train, 0), _data(n_val, 1)
        self.shuffle = shuffle
        self.events: list[tuple] = []
        self.epoch_weights: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.events.append(("train", self.current_epoch, batch_idx))
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.events.append(("val", self.current_epoch, batch_idx, self.trainer.sanity_checking))
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.events.append(("test", batch_idx))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.events.append(("predict", batch_idx))
        return self.net(batch[0])

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            trained = [e for e in self.events if e[0] == "train"]
            # (epoch, index of the training batch it follows, global step)
            self.events.append(("valrun", self.current_epoch, trained[-1][2] if trained else None,
                                self.global_step))

    def on_train_epoch_end(self) -> None:
        self.epoch_weights.append(self.net.weight.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        self.events.append(("train_dataloader", self.current_epoch))
        return DataLoader(self.train_ds, batch_size=4, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        self.events.append(("val_dataloader", self.current_epoch))
        return DataLoader(self.val_ds, batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=4)

    # ------------------------------------------------------------------ views of the record
    def of(self, kind: str) -> list[tuple]:
        return [e for e in self.events if e[0] == kind]

    def trained(self) -> list[tuple[int, int]]:
        return [e[1:] for e in self.of("train")]

    def sanity_batches(self) -> int:
        return sum(1 for e in self.of("val") if e[3])

    def val_batches(self) -> int:
        return sum(1 for e in self.of("val") if not e[3])

    def val_runs(self) -> list[tuple]:
        return [e[1:] for e in self.of("valrun")]

    def loaders(self) -> list[tuple]:
        return [e for e in self.events if e[0].endswith("_dataloader")]


def files_under(root: Any) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def fit(tmp_path: Any, module: TrainModule | None = None, **kwargs: Any) -> tuple[Trainer, Recorder]:
    module = module if module is not None else Recorder()
    options = dict(default_root_dir=str(tmp_path / "root"), logger=False, enable_checkpointing=False,
                   max_epochs=1)
    trainer = Trainer(**{**QUIET, **options, **kwargs})
    trainer.fit(module)
    return trainer, module


# --------------------------------------------------------------------------- default_root_dir


def test_default_root_dir_holds_every_file_the_run_writes(tmp_path: Any, monkeypatch: Any) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    root = tmp_path / "root"
    trainer = Trainer(default_root_dir=str(root), max_epochs=2, **QUIET)  # default loggers and checkpointing
    trainer.fit(Recorder())
    assert trainer.default_root_dir == str(root) and trainer.log_dir == str(root / "version_0")
    written = files_under(root)
    # polytrain's layout (docs/migrating-from-lightning.md): <root>/version_N, no lightning_logs level.
    assert "version_0/checkpoints/epoch=1-step=18.ckpt" in written and "version_0/metrics.csv" in written
    assert any(f.startswith("version_0/events.out.tfevents") for f in written)
    assert files_under(cwd) == []  # nothing lands in the working directory
    # With logger=False checkpoints still go to the run's own directory (Lightning: <root>/checkpoints).
    root2 = tmp_path / "root2"
    Trainer(default_root_dir=str(root2), max_epochs=1, logger=False, **QUIET).fit(Recorder())
    assert ([f for f in files_under(root2) if f.endswith(".ckpt")]
            == ["version_0/checkpoints/epoch=0-step=9.ckpt", "version_0/checkpoints/last.ckpt"])


# --------------------------------------------------------------------------- fast_dev_run


@pytest.mark.parametrize("value", [True, 3])
def test_fast_dev_run_runs_n_batches_of_each_loop_once_and_writes_nothing(tmp_path: Any, value: Any) -> None:
    n = 1 if value is True else value
    root = tmp_path / "root"
    # Loggers and a ModelCheckpoint given explicitly write nothing either (Lightning's DummyLogger).
    trainer = Trainer(default_root_dir=str(root), fast_dev_run=value, max_epochs=5,
                      logger=CSVLogger(str(root)),
                      callbacks=[ModelCheckpoint(save_last=True, dirpath=str(root / "ck")),
                                 EarlyStopping("val_loss", patience=0)],
                      **QUIET)
    module = Recorder()
    trainer.fit(module)
    assert module.trained() == [(0, i) for i in range(n)]  # one epoch, whatever max_epochs says
    assert module.sanity_batches() == 0  # no sanity check
    assert module.val_batches() == n
    assert (trainer.global_step, trainer.current_epoch) == (n, 1)
    # as Lightning: a stand-in logger takes every call and writes nothing; the options say what ran
    assert type(trainer.logger).__name__ == "DummyLogger" and trainer.logger.experiment.add_image("x") is None
    assert (trainer.limit_train_batches, trainer.max_epochs, trainer.num_sanity_val_steps) == (n, 1, 0)
    assert not root.exists() or files_under(root) == []
    module.events.clear()
    trainer.test(module)
    trainer.predict(module)
    assert [e for e in module.events if e[0] in ("test", "predict")] == (
        [("test", i) for i in range(n)] + [("predict", i) for i in range(n)])


# --------------------------------------------------------------------------- num_sanity_val_steps


@pytest.mark.parametrize(("options", "sanity", "train_loader_first"), [
    ({}, 2, False),  # default: 2 batches, the val loader requested inside the sanity check
    ({"num_sanity_val_steps": 0}, 0, True),  # none: the val loader is requested after the train loader
    ({"num_sanity_val_steps": -1}, 4, False),  # all the val batches
    ({"num_sanity_val_steps": -1, "limit_val_batches": 3}, 3, False),  # capped by limit_val_batches
])
def test_num_sanity_val_steps(tmp_path: Any, options: dict, sanity: int, train_loader_first: bool) -> None:
    _, module = fit(tmp_path, **options)
    assert module.sanity_batches() == sanity
    assert all(e[1] == 0 for e in module.of("val") if e[3])
    assert module.val_batches() == options.get("limit_val_batches", 4)
    names = [e[0] for e in module.loaders()]
    assert names == (["train_dataloader", "val_dataloader"] if train_loader_first else
                     ["val_dataloader", "train_dataloader"])


# --------------------------------------------------------------------------- limit_*_batches


def test_fractional_limits_take_int_of_the_fraction(tmp_path: Any) -> None:
    trainer, module = fit(tmp_path, limit_train_batches=0.25, limit_val_batches=0.5)
    assert module.trained() == [(0, 0), (0, 1)]  # int(0.25 * 9) = 2
    assert (module.sanity_batches(), module.val_batches()) == (2, 2)  # int(0.5 * 4) = 2
    _, module = fit(tmp_path, limit_train_batches=0.5)
    assert len(module.trained()) == 4  # int(0.5 * 9) = 4
    module.events.clear()
    test_trainer = Trainer(**QUIET, logger=False, limit_test_batches=0.5, limit_predict_batches=0.25,
                           default_root_dir=str(tmp_path / "eval"))
    test_trainer.test(module)
    test_trainer.predict(module)
    assert module.of("test") == [("test", 0), ("test", 1)] and module.of("predict") == [("predict", 0)]
    _, module = fit(tmp_path, limit_train_batches=50, limit_val_batches=1.0)  # an int above the length: all
    assert (len(module.trained()), module.val_batches()) == (9, 4)


@pytest.mark.parametrize(("option", "at_least"), [("limit_train_batches", "0.1111"),
                                                  ("limit_val_batches", "0.25")])
def test_a_fraction_giving_zero_batches_is_an_error(tmp_path: Any, option: str, at_least: str) -> None:
    with pytest.raises(ConfigError, match=rf"{option}=0.01 x \d+ \w+ batches = 0 batches; "
                                          rf"use at least {at_least}"):
        fit(tmp_path, **{option: 0.01})


def test_limit_zero_disables_that_loop(tmp_path: Any) -> None:
    trainer, module = fit(tmp_path, limit_train_batches=0)
    assert module.trained() == [] and trainer.global_step == 0 and trainer.current_epoch == 0
    assert module.sanity_batches() == 2  # as Lightning: the fit is its sanity check
    assert [e[0] for e in module.loaders()] == ["val_dataloader"]  # the train loader is never requested
    trainer, module = fit(tmp_path, limit_val_batches=0)
    assert len(module.trained()) == 9 and module.of("val") == []
    assert [e[0] for e in module.loaders()] == ["train_dataloader"]  # nor is the val loader


# --------------------------------------------------------------------------- val_check_interval


@pytest.mark.parametrize(("options", "runs"), [
    # (epoch, training batch it follows, global step), as Lightning runs them with 9 batches per epoch
    ({"val_check_interval": 0.25}, [(0, 1, 2), (0, 3, 4), (0, 5, 6), (0, 7, 8)]),  # no extra run at batch 9
    ({"val_check_interval": 0.5}, [(0, 3, 4), (0, 7, 8)]),
    ({"val_check_interval": 4, "max_epochs": 2},
     [(0, 3, 4), (0, 7, 8), (1, 3, 13), (1, 7, 17)]),  # within epochs
    ({"val_check_interval": 4, "max_epochs": 2, "check_val_every_n_epoch": None},
     [(0, 3, 4), (0, 7, 8), (1, 2, 12), (1, 6, 16)]),  # across epochs
    ({"val_check_interval": 12, "max_epochs": 3, "check_val_every_n_epoch": None}, [(1, 2, 12), (2, 5, 24)]),
    ({"check_val_every_n_epoch": 2, "max_epochs": 4}, [(1, 8, 18), (3, 8, 36)]),
])
def test_val_check_interval(tmp_path: Any, options: dict, runs: list) -> None:
    _, module = fit(tmp_path, **options)
    assert module.val_runs() == runs


def test_val_check_interval_longer_than_an_epoch_needs_check_val_every_n_epoch_none(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="check_val_every_n_epoch=null"):
        fit(tmp_path, val_check_interval=12, max_epochs=3)


def test_a_fraction_of_an_epoch_cannot_count_across_epochs() -> None:
    from polytrain import Trainer

    with pytest.raises(ConfigError, match=r"should be an integer or a time-based duration .* when "
                                          r"`check_val_every_n_epoch=None`"):
        Trainer(val_check_interval=0.5, check_val_every_n_epoch=None)


# --------------------------------------------------------------------------- min_epochs / min_steps


class StopsAtEpochEnd(Recorder):
    def on_train_epoch_end(self) -> None:
        self.trainer.should_stop = True


class StopsAtBatch3(Recorder):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.current_epoch == 0 and batch_idx == 3:
            self.trainer.should_stop = True


class Worsening(Recorder):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", float(self.current_epoch))  # never improves: EarlyStopping(patience=1) stops


@pytest.mark.parametrize(("cls", "options", "steps", "epochs", "runs"), [
    # A stop request at every epoch end waits for min_epochs ...
    (StopsAtEpochEnd, {"min_epochs": 3}, 27, 3, [(0, 8, 9), (1, 8, 18), (2, 8, 27)]),
    # ... and for min_steps, then ends the epoch at once (validating first), mid-epoch as Lightning does.
    (StopsAtEpochEnd, {"min_steps": 20}, 20, 3, [(0, 8, 9), (1, 8, 18), (2, 1, 20)]),
    (StopsAtEpochEnd, {"min_steps": 100, "max_epochs": 2}, 18, 2,
     [(0, 8, 9), (1, 8, 18)]),  # never past max_epochs
    # A request mid-epoch ends the epoch after that batch, with a validation run; once made, it stays pending.
    (StopsAtBatch3, {}, 4, 1, [(0, 3, 4)]),
    (StopsAtBatch3, {"min_epochs": 2}, 18, 2, [(0, 8, 9), (1, 8, 18)]),
])
def test_stop_requests_wait_for_min_epochs_and_min_steps(tmp_path: Any, cls: type, options: dict, steps: int,
                                                         epochs: int, runs: list, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="polytrain"):
        trainer, module = fit(tmp_path, cls(), **{"max_epochs": 10, **options})
    assert (trainer.global_step, trainer.current_epoch, module.val_runs()) == (steps, epochs, runs)
    if options.get("min_epochs") or options.get("min_steps"):
        assert "training continues" in caplog.text


@pytest.mark.parametrize(("min_epochs", "epochs"), [(None, 2), (4, 4)])
def test_early_stopping_waits_for_min_epochs(tmp_path: Any, min_epochs: int | None, epochs: int) -> None:
    # With the default sanity check: EarlyStopping must not judge the sanity check's (dropped) metrics.
    stopper = EarlyStopping("val_loss", patience=1, verbose=False)
    trainer, _ = fit(tmp_path, Worsening(), max_epochs=10, min_epochs=min_epochs, callbacks=[stopper])
    assert trainer.current_epoch == epochs and trainer.global_step == 9 * epochs


# --------------------------------------------------------------------------- max_time


def test_max_time_formats() -> None:
    assert parse_duration("01:02:03:04") == ((1 * 24 + 2) * 60 + 3) * 60 + 4
    assert parse_duration({"hours": 1, "seconds": 2}) == 3602
    assert validate_trainer_config({"max_time": datetime.timedelta(minutes=2)}).max_time == {"seconds": 120.0}
    with pytest.raises(ConfigError, match="DD:HH:MM:SS"):
        validate_trainer_config({"max_time": "00:00:02"})  # exactly 4 fields, as Lightning
    with pytest.raises(ConfigError, match="max_time"):
        validate_trainer_config({"max_time": 5})
    with pytest.raises(ConfigError, match="unknown unit"):
        validate_trainer_config({"max_time": {"secs": 5}})


class Slow(Callback):
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        time.sleep(0.12)


class EndHooks(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.calls.append("on_train_end")

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self.calls.append("on_fit_end")

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        self.calls.append("teardown")


@pytest.mark.parametrize("max_time", ["00:00:00:01", {"seconds": 1}, datetime.timedelta(seconds=1)])
def test_max_time_stops_cleanly_and_a_resubmitted_job_continues_exactly(tmp_path: Any, max_time: Any) -> None:
    root = str(tmp_path / "root")
    options = dict(default_root_dir=root, max_epochs=2, logger=False, log_every_n_steps=1, **QUIET)
    torch.manual_seed(0)
    ends = EndHooks()
    first = Trainer(max_time=max_time, callbacks=[Slow(), ends], **options)
    first.fit(Recorder())
    stopped_at = first.global_step
    assert 0 < stopped_at < 18  # 18 batches at >= 0.12 s each cannot fit in one second
    assert ends.calls == ["on_train_end", "on_fit_end", "teardown"]
    assert torch.load(os.path.join(root, "version_0", "checkpoints", "last.ckpt"),
                      weights_only=True)["global_step"] == stopped_at

    # The resubmitted job (same config, no time pressure this time) resumes from the fit-end checkpoint ...
    torch.manual_seed(123)  # a different fresh-process state: the checkpoint's RNG states must win
    resumed = Recorder()
    Trainer(**options).fit(resumed, ckpt_path="last")
    assert resumed.trained()[0] == divmod(stopped_at, 9)  # the next batch, not the start of an epoch
    # ... and ends where one uninterrupted run ends, bitwise (shuffled data, same order).
    torch.manual_seed(0)
    reference = Recorder()
    Trainer(**{**options, "default_root_dir": str(tmp_path / "ref")}).fit(reference)
    assert (torch.equal(resumed.net.weight, reference.net.weight)
            and torch.equal(resumed.net.bias, reference.net.bias))


# --------------------------------------------------------------------------- overfit_batches


def test_overfit_batches_repeats_the_first_batches_in_order(tmp_path: Any) -> None:
    seen: list[torch.Tensor] = []

    class Overfit(Recorder):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append(batch[0])
            return super().training_step(batch, batch_idx)

    with pytest.warns(UserWarning, match="shuffling off"):
        trainer, module = fit(tmp_path, Overfit(shuffle=True), overfit_batches=2, max_epochs=2)
    assert module.trained() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    x = module.train_ds.tensors[0]
    assert all(torch.equal(b, x[4 * (i % 2): 4 * (i % 2) + 4])
               for i, b in enumerate(seen))  # first 2, each epoch
    # Validation runs on 2 batches of the *val* loader; the sanity check as usual.
    assert (module.sanity_batches(), module.val_batches()) == (2, 4)
    _, module = fit(tmp_path, Recorder(shuffle=False), overfit_batches=0.25)  # a fraction of each loader
    assert (len(module.trained()), module.sanity_batches(), module.val_batches()) == (2, 1, 1)


# -------------------------------------------------------------------------- reload_dataloaders_every_n_epochs


@pytest.mark.parametrize(("every", "sanity_steps", "loaders"), [
    (1, 0, [("train_dataloader", 0), ("val_dataloader", 0), ("train_dataloader", 1), ("val_dataloader", 1),
            ("train_dataloader", 2), ("val_dataloader", 2)]),
    (2, 2, [("val_dataloader", 0), ("train_dataloader", 0), ("train_dataloader", 2), ("val_dataloader", 2)]),
])
def test_reload_dataloaders_every_n_epochs(tmp_path: Any, every: int, sanity_steps: int,
                                           loaders: list) -> None:
    _, module = fit(tmp_path, max_epochs=3, reload_dataloaders_every_n_epochs=every,
                    num_sanity_val_steps=sanity_steps)
    assert module.loaders() == loaders
    assert len(module.trained()) == 27 and module.val_batches() == 12


@pytest.mark.parametrize(("sanity_steps", "loaders"), [
    (0, [("train_dataloader", 0), ("val_dataloader", 2), ("train_dataloader", 4)]),
    (2, [("val_dataloader", 0), ("train_dataloader", 0), ("val_dataloader", 2), ("train_dataloader", 4)]),
])
def test_validation_every_few_epochs_asks_for_its_loader_at_its_first_validation(tmp_path: Any,
                                                                                sanity_steps: int,
                                                                                loaders: list) -> None:
    """As Lightning: a fit whose first epoch does not validate asks for the val loader when its first
    validation starts (epoch 2 here), and counts the reload interval from there, not from the sanity
    check; 5 - 2 < 4, so epoch 5 validates with the same loader."""
    _, module = fit(tmp_path, max_epochs=6, reload_dataloaders_every_n_epochs=4, check_val_every_n_epoch=3,
                    num_sanity_val_steps=sanity_steps)
    assert module.loaders() == loaders
    assert module.val_batches() == 8  # two validations of the 4-batch loader


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("devices", [[0, 1], [0]])
def test_a_device_list_on_cpu_is_a_clear_error(tmp_path: Any, devices: list) -> None:
    trainer = Trainer(**{**QUIET, "devices": devices}, default_root_dir=str(tmp_path), logger=False)
    assert trainer.config.devices == devices  # accepted as config (it is valid on a GPU machine) ...
    with pytest.raises(ConfigError, match=re.escape(f"devices={devices} is a list of GPU indices")
                                          + f".*devices={len(devices)}"):
        trainer.fit(Recorder())  # ... and refused where it cannot mean anything


def test_a_device_list_on_cuda_plans_one_process_per_listed_gpu() -> None:
    try:
        with (mock.patch.object(torch.cuda, "is_available", return_value=True),
              mock.patch.object(torch.cuda, "device_count", return_value=4)):
            plan = plan_launch(validate_trainer_config(dict(devices=[1, 3], accelerator="gpu",
                                                            strategy="ddp")))
            assert ((plan.accelerator, plan.devices, plan.processes_per_node, plan.world_size)
                    == ("cuda", 2, 2, 2))
            assert [process_group.cuda_index(r) for r in (0, 1)] == [1, 3]  # local rank r -> cuda:devices[r]
            plan = plan_launch(validate_trainer_config(dict(devices=[2], accelerator="auto")))
            assert (plan.strategy_name, plan.method, process_group.cuda_index(0)) == ("single", "here", 2)
            for bad in ([0, 4], [1, 1]):
                with pytest.raises(ConfigError, match="distinct GPU indices below 4"):
                    plan_launch(validate_trainer_config(dict(devices=bad, accelerator="cuda")))
            plan_launch(validate_trainer_config(dict(devices=2, accelerator="cuda")))
            assert process_group.cuda_index(1) == 1  # an int: local rank r -> cuda:r
    finally:
        process_group.select_cuda_devices(None)
    with pytest.raises(ConfigError, match="devices"):
        validate_trainer_config({"devices": [-1]})


def test_cuda_without_a_gpu_says_there_is_none_and_how_to_train_on_the_cpu() -> None:
    with mock.patch.object(torch.cuda, "device_count", return_value=0):
        for devices in (1, 2, "auto"):
            with pytest.raises(ConfigError, match=r"trainer.accelerator=cuda but torch sees no GPU here .*; "
                                                  r"set trainer.accelerator=cpu \(or auto\)"):
                plan_launch(validate_trainer_config(dict(devices=devices, accelerator="cuda")))


# --------------------------------------------------------------------------- ckpt_path


class Scored(Recorder):
    SCORES = (3.0, 1.0, 2.0)  # epoch 1 is the best

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.events.append(("val_weight", self.net.weight.detach().clone()))
        self.log("score", self.SCORES[min(self.current_epoch, 2)])


def _weights_validated(module: Scored) -> torch.Tensor:
    return [e[1] for e in module.events if e[0] == "val_weight"][0]


def test_ckpt_path_best_and_last(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(save_last=True, monitor="score", mode="min", save_top_k=1)
    trainer, module = fit(tmp_path, Scored(), max_epochs=3, callbacks=[checkpoint], num_sanity_val_steps=0)
    assert os.path.basename(checkpoint.best_model_path) == "epoch=1-step=18.ckpt"
    for stage in ("validate", "test"):
        module.events.clear()
        if stage == "validate":
            trainer.validate(ckpt_path="best")
            assert torch.equal(_weights_validated(module), module.epoch_weights[1])  # the monitored best
        else:
            module.test_step = module.validation_step  # type: ignore[method-assign]
            trainer.test(module, ckpt_path="best")
            assert torch.equal(_weights_validated(module), module.epoch_weights[1])
    module.events.clear()
    trainer.validate(module, ckpt_path="last")
    assert torch.equal(_weights_validated(module), module.epoch_weights[2])  # last.ckpt: the final weights


def test_ckpt_path_best_without_a_checkpoint_is_a_clear_error(tmp_path: Any) -> None:
    trainer, module = fit(tmp_path, Scored())  # enable_checkpointing=False
    with pytest.raises(ConfigError, match="ckpt_path='best' loads the best checkpoint a ModelCheckpoint "
                                          "recorded, and no run under .* recorded one"):
        trainer.validate(module, ckpt_path="best")
    # Without a monitor (Lightning's meaning): "best" is the newest checkpoint the callback kept.
    trainer, module = fit(tmp_path, Scored(), max_epochs=2, enable_checkpointing=True)
    module.events.clear()
    trainer.validate(module, ckpt_path="best")
    assert torch.equal(_weights_validated(module), module.epoch_weights[1])


def test_fit_ckpt_path_last(tmp_path: Any, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="polytrain"):  # nothing to resume: warn and start fresh
        trainer = Trainer(**QUIET, default_root_dir=str(tmp_path / "root"), logger=False, max_epochs=1)
        module = Recorder()
        trainer.fit(module, ckpt_path="last")
    assert "holds no checkpoint; starting from scratch" in caplog.text
    assert module.trained()[0] == (0, 0) and trainer.global_step == 9
    resumed = Recorder()
    Trainer(**QUIET, default_root_dir=str(tmp_path / "root"), logger=False, max_epochs=2).fit(resumed,
                                                                                               ckpt_path="last")
    assert resumed.trained()[0] == (1, 0) and len(resumed.trained()) == 9


# --------------------------------------------------------------------------- keywords, profiler


def test_entry_points_take_lightnings_keyword_names(tmp_path: Any) -> None:
    trainer = Trainer(**QUIET, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                      max_epochs=1, num_sanity_val_steps=0)
    module = Recorder()
    trainer.fit(model=module)
    assert trainer.global_step == 9
    assert trainer.validate(model=module, verbose=False)[0].keys() == {"val_loss"}
    trainer.test(model=module, verbose=False)
    assert len(trainer.predict(model=module, return_predictions=True)) == 4


@pytest.mark.parametrize("profiler", ["simple", "torch"])
def test_profiler_is_accepted(tmp_path: Any, profiler: str) -> None:
    trainer, module = fit(tmp_path, profiler=profiler)
    assert trainer.global_step == 9
    with pytest.raises(ConfigError, match="trainer.profiler"):
        Trainer(profiler="nonsense")


@pytest.mark.parametrize("value", [True, False])
def test_benchmark_sets_cudnn_benchmark(tmp_path: Any, value: bool) -> None:
    saved = torch.backends.cudnn.benchmark
    try:
        fit(tmp_path, benchmark=value, limit_train_batches=1)
        assert torch.backends.cudnn.benchmark is value
    finally:
        torch.backends.cudnn.benchmark = saved


def test_a_lightning_scripts_top_level_names(monkeypatch: Any) -> None:
    import polytrain as pl

    for name in ("PL_GLOBAL_SEED", "POLYTRAIN_SEED"):
        monkeypatch.setenv(name, "0")  # restored afterwards

    assert pl.callbacks.ModelCheckpoint is ModelCheckpoint  # `pl.callbacks.X` without importing
    # the subpackage
    assert pl.seed_everything(42, workers=True) == 42 and os.environ["PL_GLOBAL_SEED"] == "42"
    first = torch.rand(3)
    assert pl.seed_everything() == 42  # None: PL_GLOBAL_SEED, as Lightning
    assert torch.equal(torch.rand(3), first)


class OneCycle(Recorder):
    def configure_optimizers(self) -> Any:
        total = self.trainer.estimated_stepping_batches
        self.events.append(("estimated", total))
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                                         total_steps=int(total)),
                        "interval": "step"}]

    def on_train_start(self) -> None:
        self.events.append(("estimated", self.trainer.estimated_stepping_batches))


@pytest.mark.parametrize(("options", "steps"), [
    ({"max_epochs": 3}, 27), ({"max_epochs": 3, "accumulate_grad_batches": 2}, 15),  # ceil(9 / 2) per epoch
    ({"max_epochs": 5, "max_steps": 7}, 7), ({"max_epochs": 2, "limit_train_batches": 0.5}, 8),
])
def test_estimated_stepping_batches_in_configure_optimizers(tmp_path: Any, options: dict, steps: int) -> None:
    trainer, module = fit(tmp_path, OneCycle(), **options)
    assert trainer.global_step == steps  # OneCycleLR would raise past its total_steps
    # As Lightning: asking in configure_optimizers requests the training loader then, once for the fit.
    assert [e for e in module.events if e[0] in ("estimated", "train_dataloader", "val_dataloader")] == [
        ("train_dataloader", 0), ("estimated", steps), ("val_dataloader", 0), ("estimated", steps)]


def test_detect_anomaly_wraps_the_fit_loop(tmp_path: Any) -> None:
    seen: list[bool] = []

    class Watch(Recorder):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append(torch.is_anomaly_enabled())
            return super().training_step(batch, batch_idx)

    fit(tmp_path, Watch(), detect_anomaly=True, limit_train_batches=2)
    fit(tmp_path, Watch(), limit_train_batches=1)
    assert seen == [True, True, False] and not torch.is_anomaly_enabled()


def _sync_bn_worker(rank: int, world_size: int, root: str) -> list[str]:
    class WithBN(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return F.mse_loss(self.net(self.bn(batch[0])), batch[1])

    module = WithBN()
    Trainer(**{**QUIET, "devices": world_size}, strategy="ddp", sync_batchnorm=True, default_root_dir=root,
            logger=False, enable_checkpointing=False, max_epochs=1, limit_train_batches=1).fit(module)
    return [type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__]


@pytest.mark.distributed
def test_sync_batchnorm_reaches_the_strategy(tmp_path: Any) -> None:
    from distributed import run_distributed

    for names in run_distributed(_sync_bn_worker, 2, str(tmp_path), timeout=120.0):
        assert names == ["CrossProcessBatchNorm"]  # polytrain's SyncBatchNorm, not the BatchNorm1d built


def test_lightning_module_extras(tmp_path: Any) -> None:
    """toggled_optimizer, dtype, example_input_array and strict_loading, as LightningModule has them."""
    flags: list[tuple[bool, bool]] = []

    class TwoNets(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.other = torch.nn.Linear(4, 1)
            self.example_input_array = torch.zeros(2, 4)

        def configure_optimizers(self) -> Any:
            return (torch.optim.SGD(self.net.parameters(), lr=0.1),
                    torch.optim.SGD(self.other.parameters(), lr=0.1))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_net, _ = self.optimizers()
            with self.toggled_optimizer(opt_net):
                flags.append((self.net.weight.requires_grad, self.other.weight.requires_grad))
                loss = F.mse_loss(self.net(batch[0]) + self.other(batch[0]), batch[1])
                opt_net.zero_grad()
                self.manual_backward(loss)
                opt_net.step()
            flags.append((self.net.weight.requires_grad, self.other.weight.requires_grad))

    module = TwoNets()
    assert module.dtype == torch.float32 and module.example_input_array.shape == (2, 4)
    fit(tmp_path, module, limit_train_batches=1, limit_val_batches=0)
    assert flags == [(True, False), (True, True)]
    assert module.to(torch.float64).dtype == torch.float64

    root = tmp_path / "strict"
    trainer = Trainer(**QUIET, default_root_dir=str(root), logger=False, max_epochs=1, limit_train_batches=1)
    trainer.fit(Recorder())

    class Bigger(Recorder):
        strict_loading = False  # extra layers the checkpoint lacks are left as initialised

        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

    loaded = Bigger.load_from_checkpoint(str(root / "version_0" / "checkpoints" / "last.ckpt"))
    assert torch.equal(loaded.net.weight, trainer.lightning_module.net.weight)
    with pytest.raises(RuntimeError, match="Missing key"):
        Bigger.load_from_checkpoint(str(root / "version_0" / "checkpoints" / "last.ckpt"), strict=True)


def test_lightnings_precision_spellings() -> None:
    for given, meant in (("32-true", "32"), (32, "32"), ("16", "16-mixed"), (16, "16-mixed"),
                         ("bf16", "bf16-mixed")):
        assert validate_trainer_config({"precision": given}).precision == meant


def _stop_worker(rank: int, world_size: int, root: str, where: str) -> tuple[int, int]:
    class Stops(Recorder):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if where == "one rank" and self.global_rank == 1 and batch_idx == 0:
                self.trainer.should_stop = True  # on rank 1 only: the ranks must still stop together

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", -float(self.global_step))  # falls: EarlyStopping(mode="max") stops at
            # its 2nd check

    callbacks = ([EarlyStopping("val_loss", patience=0, mode="max", verbose=False)]
                 if where == "early stopping" else [])
    trainer = Trainer(**{**QUIET, "devices": world_size}, strategy="ddp", default_root_dir=root, logger=False,
                      enable_checkpointing=False, max_epochs=3, log_every_n_steps=2, num_sanity_val_steps=0,
                      val_check_interval=2 if where == "early stopping" else None, callbacks=callbacks)
    trainer.fit(Stops(n_train=40))  # 5 batches per rank per epoch
    return trainer.global_step, trainer.current_epoch


@pytest.mark.distributed
@pytest.mark.parametrize(("where", "step"), [
    ("one rank", 2),  # set after batch 0 on rank 1: agreed at the next logging step (batch 1),
    # both stop there
    ("early stopping", 4),  # the validation after batch 3 (the 2nd) did not improve: both stop
    # after that batch
])
def test_a_stop_request_under_ddp_ends_the_epoch_on_every_rank_together(tmp_path: Any, where: str,
                                                                        step: int) -> None:
    from distributed import run_distributed

    results = run_distributed(_stop_worker, 2, str(tmp_path), where, timeout=120.0)
    assert results == [(step, 1), (step, 1)]
