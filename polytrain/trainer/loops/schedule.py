"""When a fit validates: every ``val_check_interval`` training batches (a fraction of the epoch, or a
count, within the epoch or across epochs with ``check_val_every_n_epoch=null``) or once that much time
has passed since the last validation (a duration), every ``check_val_every_n_epoch`` epochs, and at an
epoch's end."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from polytrain.callbacks.time_trigger import TimeTrigger
from polytrain.core.errors import ConfigError
from polytrain.trainer.configuration.config_file import val_check_seconds


def val_check_batches(config: Any, num_batches: int | None) -> int:
    """Validate every this many training batches (the epoch length: at its end; 0: an epoch of unknown
    length, validated at its end only, or validations by time)."""
    interval = config.val_check_interval
    if val_check_seconds(interval) is not None:
        return 0
    if interval is None or (isinstance(interval, float) and interval == 1.0):
        return num_batches if num_batches is not None else 0
    if isinstance(interval, float):
        if num_batches is None:
            raise ConfigError(f"trainer.val_check_interval={interval} is a fraction of an epoch, but the "
                              f"training loader has no length; give a number of batches")
        return max(1, int(num_batches * interval))
    validates = config.limit_val_batches != 0  # as Lightning: no validation, nothing to check against
    if (validates and config.check_val_every_n_epoch is not None and num_batches is not None
            and interval > num_batches):
        raise ConfigError(f"trainer.val_check_interval={interval} must be less than or equal to the number "
                          f"of the training batches of an epoch ({num_batches}); lower it, or set "
                          f"check_val_every_n_epoch=null to count across epochs")
    return int(interval)


class ValidationSchedule:
    """The fit's validation points for an epoch of ``num_batches`` training batches (None: unknown)."""

    def __init__(self, config: Any, num_batches: int | None) -> None:
        self.num_batches = num_batches
        self.every_n_epochs: int | None = config.check_val_every_n_epoch
        self.every = val_check_batches(config, num_batches)
        seconds = val_check_seconds(config.val_check_interval)
        # A duration: global rank 0's clock decides, told to every rank at a few agreed batches (as
        # ModelCheckpoint's train_time_interval); counted in the batches taken, across epochs.
        self.clock = TimeTrigger(timedelta(seconds=seconds)) if seconds is not None else None
        # Whether any validation can fall inside an epoch (not at its end): fixed, so the common batch
        # tests one flag.
        self.inside = self.clock is not None or (bool(self.every) and (
            num_batches is None or self.every < num_batches or self.every_n_epochs is None))

    def start(self, total_batches: int) -> None:
        """The fit starts (after any resume): a duration runs from now, as Lightning's from the start."""
        if self.clock is not None:
            self.clock.start(total_batches)

    def time_is_up(self, epoch: int, total: int, strategy: Any) -> bool:
        """With a duration, on every rank after every batch of an epoch that validates: whether it has
        passed since the last validation ended (the same answer everywhere). False otherwise."""
        if self.clock is None or not self.epoch_validates(epoch):
            return False
        return self.clock.due(total, strategy)

    def validated(self) -> None:
        """A validation ended: a duration counts from now, as Lightning's."""
        if self.clock is not None:
            self.clock.restart()

    def due_after(self, epoch: int, batch_idx: int, total: int, last: bool, has_val: bool,
                  stopping: bool = False, time_up: bool = False) -> bool:
        """The loop's one question, "does a validation follow this batch?" (``batch_idx`` in its epoch,
        ``total`` batches taken in the fit's epochs so far, this one included): after an epoch's last
        batch when the epoch-end schedule says so; inside the epoch every ``val_check_interval`` batches;
        where the fit stops early (``stopping``), when this epoch validates at all, as Lightning. With a
        duration, where ``time_up`` (``time_is_up``), and at the end of an epoch of unknown length. Never
        without validation data (``has_val``)."""
        if not has_val:
            return False
        if stopping:
            return self.epoch_validates(epoch)
        if self.clock is not None:
            return time_up or (last and self.num_batches is None and self.epoch_validates(epoch))
        if last:
            return self.at_epoch_end(epoch, total)
        return self.inside and self.after_batch(epoch, batch_idx, total)

    def epoch_validates(self, epoch: int) -> bool:
        return self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0

    def after_batch(self, epoch: int, batch_idx: int, total: int) -> bool:
        """A validation right after batch ``batch_idx`` inside the epoch (not at its end)."""
        if self.every_n_epochs is None:  # an interval counted across epochs
            return total % self.every == 0
        if (epoch + 1) % self.every_n_epochs:
            return False
        return (batch_idx + 1) % self.every == 0

    def at_epoch_end(self, epoch: int, total: int) -> bool:
        n = self.num_batches
        if self.every_n_epochs is None:  # counted across epochs
            return bool(self.every) and total % self.every == 0
        if n is None:  # an epoch of unknown length: validation at its end, or by count
            return self.every == 0 and (epoch + 1) % self.every_n_epochs == 0
        return (epoch + 1) % self.every_n_epochs == 0 and n % self.every == 0
