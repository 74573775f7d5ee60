"""``val_check_interval`` as a duration (Lightning 2.6: ``"DD:HH:MM:SS"``, a ``timedelta``, or a mapping
of units): a validation once that much time has passed since the last one ended (or since the fit
started), in the epochs ``check_val_every_n_epoch`` lets validate; global rank 0's clock decides for
every rank."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from conftest import TinyModule
from distributed import run_distributed

from polytrain import Trainer
from polytrain.core.errors import ConfigError
from polytrain.utilities.exceptions import MisconfigurationException

pytestmark = pytest.mark.own_logic


class _Clocked(TinyModule):
    """Each training batch takes one second of a fake clock; records after which batch (counted across
    the fit) each validation ran."""

    def __init__(self, clock: list[float] | None = None, seconds_per_batch: float = 1.0) -> None:
        super().__init__(n=16, batch_size=4, val_n=4)
        self.clock = clock
        self.seconds_per_batch = seconds_per_batch
        self.validated_after: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.clock is not None:
            self.clock[0] += self.seconds_per_batch
        else:
            time.sleep(self.seconds_per_batch)
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_after.append(self.trainer.fit_loop.total_batch_idx + 1)


def _fake_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    from polytrain.callbacks import time_trigger

    clock = [0.0]
    monkeypatch.setattr(time_trigger.time, "monotonic", lambda: clock[0])
    return clock


@pytest.mark.parametrize("interval", ["00:00:00:03", {"seconds": 3}, timedelta(seconds=3)])
def test_validation_runs_when_the_duration_has_passed_since_the_last_one(
        make_trainer: Any, monkeypatch: pytest.MonkeyPatch, interval: Any) -> None:
    clock = _fake_clock(monkeypatch)
    module = _Clocked(clock)
    make_trainer(max_epochs=3, val_check_interval=interval, num_sanity_val_steps=0).fit(module)
    # epochs of 4 batches, one second each: every 3 s, counted across epochs, and no validation forced at
    # an epoch's end (as Lightning's duration)
    assert module.validated_after == [3, 6, 9, 12]


def test_a_duration_validates_only_in_the_epochs_that_validate(make_trainer: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _fake_clock(monkeypatch)
    module = _Clocked(clock)
    make_trainer(max_epochs=4, val_check_interval="00:00:00:03", check_val_every_n_epoch=2,
                 num_sanity_val_steps=0).fit(module)
    # epoch 0 (batches 1-4) does not validate: its first batch in epoch 1 finds 5 s passed; then 3 s later
    assert module.validated_after == [5, 8, 13, 16]


def _by_time_worker(rank: int, world: int, root: str) -> list[int]:
    # Rank 1's batches take three times as long: its own clock would call for other validations than
    # rank 0's; rank 0 decides for both, so they validate together (and nobody waits for a peer).
    module = _Clocked(seconds_per_batch=0.02 if rank == 0 else 0.06)
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=world, max_epochs=5, run_dir=root,
                      val_check_interval={"seconds": 0.15}, num_sanity_val_steps=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module.train_ds = type(module.train_ds)(*(t.repeat(4, 1) for t in module.train_ds.tensors))
    trainer.fit(module)
    return module.validated_after


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_duration_is_decided_by_one_clock_for_every_rank(tmp_path: Any) -> None:
    seen = run_distributed(_by_time_worker, 2, str(tmp_path), timeout=240)
    assert seen[0] == seen[1] and len(seen[0]) >= 2, seen


def test_a_duration_is_checked_in_words(make_trainer: Any) -> None:
    with pytest.raises(MisconfigurationException, match=r"`val_check_interval` should be an integer or a "
                                                        r"time-based duration \(str 'DD:HH:MM:SS', "
                                                        r"datetime.timedelta, or dict kwargs for timedelta\) "
                                                        r"when `check_val_every_n_epoch=None`"):
        make_trainer(val_check_interval=0.5, check_val_every_n_epoch=None)
    with pytest.raises(ConfigError, match=r"val_check_interval='00:00:00:00' is a duration of 0 s; give a "
                                          r"positive one"):
        make_trainer(val_check_interval="00:00:00:00")
    with pytest.raises(ConfigError, match=r"val_check_interval='5 minutes'; write it as DD:HH:MM:SS"):
        make_trainer(val_check_interval="5 minutes")
    with pytest.raises(ConfigError, match=r"val_check_interval has unknown unit\(s\) \['mins'\]"):
        make_trainer(val_check_interval={"mins": 5})
    # a duration with check_val_every_n_epoch=None is valid: it counts time, not batches of an epoch
    make_trainer(val_check_interval="00:00:05:00", check_val_every_n_epoch=None)
