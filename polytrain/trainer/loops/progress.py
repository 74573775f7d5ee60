"""Loop state in one place: where a fit stands (``FitProgress``, saved in every checkpoint as ``loop``),
what a resume left for the next epoch to pick up (``Resumed``), whether the loop is to stop
(``Stopping``) and the fit's loaders (``EpochData``). The fit loop owns them and is the only writer:
each changes through its own methods, which the loop calls (or hands on: manual optimisation counts
its steps through ``FitProgress.count_optimizer_step``). The Trainer reads them through Lightning's
names (``current_epoch``, ``global_step``, ...); ``should_stop`` is the one request it passes on
(``Stopping.request``), for callbacks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class FitProgress:
    """The fit's position. ``batch_in_epoch`` counts the batches consumed in the current epoch;
    ``total_batches`` those of every epoch (``val_check_interval`` across epochs counts them: epochs
    may differ in length, and an iterable's have none); ``batches_stepped`` the batches after which an
    optimizer stepped (the logging cadence);
    ``validation_due`` is True between a batch and the validation that follows it, so a checkpoint
    taken in between resumes with that validation, and one taken after it resumes without."""

    epoch: int = 0
    global_step: int = 0
    batch_in_epoch: int = 0
    total_batches: int = 0
    batches_stepped: int = 0
    validation_due: bool | None = False  # None: a file from before this was recorded (the loop decides)
    # While a complete epoch's on_train_epoch_end runs: a save resumes at the next epoch.
    at_epoch_end: bool = False
    # The data position (for a resume at another data-parallel size), fixed when the fit starts.
    world_size: int = 1
    dp_size: int = 1
    train_batch_size: int | None = None
    sample_base: tuple[int, int] = (0, 0)  # (samples, batches) already consumed when a resume
    # re-split the epoch
    # batch_in_epoch when the newest optimizer step (manual optimisation: training_step) completed
    batch_at_last_step: int = 0
    # the index of the newest batch taken in this or (once it ended) the last epoch; -1: none yet
    # (Lightning's fit_loop.batch_idx)
    batch_index: int = -1
    is_last_batch: bool = False  # that batch ends its epoch (the loader's last, or the epoch skipped there)
    # a file from before total_batches was recorded: the fit computes it from its epoch length
    total_unknown: bool = False

    # ------------------------------------------------------------------ the loop's moves
    def start_fit(self, world_size: int, dp_size: int) -> None:
        self.world_size, self.dp_size = world_size, dp_size

    def start_epoch(self, sample_base: tuple[int, int], train_batch_size: int | None) -> None:
        """The epoch's iterator is made: what a resume at this data-parallel size had consumed."""
        self.sample_base, self.train_batch_size = sample_base, train_batch_size
        self.batch_index = self.batch_in_epoch - 1
        self.is_last_batch = False

    def settle_total(self, num_batches: int | None) -> None:
        """A file from before ``total_batches`` was recorded: as many as its epochs of ``num_batches``."""
        if self.total_unknown:
            self.total_batches = self.epoch * (num_batches or 0) + self.batch_in_epoch
            self.total_unknown = False

    def take_batch(self, batch_idx: int, last: bool) -> None:
        self.batch_in_epoch = batch_idx + 1
        self.batch_index = batch_idx
        self.is_last_batch = last
        self.total_batches += 1

    def skip_rest_of_epoch(self) -> None:
        """``on_train_batch_start`` returned -1: the batch just taken ends its epoch, and no validation
        follows it."""
        self.is_last_batch = True
        self.validation_due = False

    def count_optimizer_step(self) -> None:
        self.global_step += 1

    def count_stepped_batch(self, log_every_n_steps: int) -> bool:
        """A batch after which an optimizer stepped; True when it is a logging step."""
        self.batches_stepped += 1
        self.batch_at_last_step = self.batch_in_epoch
        return self.batches_stepped % log_every_n_steps == 0

    def expect_validation(self, due: bool | None) -> None:
        """Whether a validation follows the batch just run (False once it ran)."""
        self.validation_due = due

    @contextlib.contextmanager
    def ending_epoch(self, complete: bool) -> Iterator[None]:
        """While ``on_train_epoch_end`` runs: a checkpoint taken then resumes at the next epoch when this
        one is complete."""
        self.at_epoch_end = complete
        try:
            yield
        finally:
            self.at_epoch_end = False

    def finish_epoch(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = self.batch_at_last_step = 0

    def rewind_to_last_step(self) -> None:
        """The fit raised inside a batch: a checkpoint saved now (``save_on_exception``) resumes with the
        first batch after the newest optimizer step, the one that raised run again (its partial work, and
        any micro-batch gradients since that step, are not in the checkpoint)."""
        if not self.at_epoch_end and self.batch_in_epoch != self.batch_at_last_step:
            self.total_batches -= self.batch_in_epoch - self.batch_at_last_step
            self.batch_in_epoch = self.batch_at_last_step
            self.validation_due = False  # the validation after the batch that raised had not begun

    def sample_offset(self) -> int | None:
        """Global sample positions of this epoch's permutation already consumed (None: unknown batch
        size)."""
        if self.at_epoch_end or self.batch_in_epoch == 0:
            return 0
        if not self.train_batch_size:
            return None
        base_offset, base_batch = self.sample_base
        return base_offset + (self.batch_in_epoch - base_batch) * self.train_batch_size * self.dp_size

    def state_dict(self) -> dict[str, Any]:
        done = self.at_epoch_end
        return {
            "epoch": self.epoch + (1 if done else 0),
            "global_step": self.global_step,
            "batch_in_epoch": 0 if done else self.batch_in_epoch,
            "total_batches": self.total_batches,
            "batches_stepped": self.batches_stepped,
            "validation_due": False if done else bool(self.validation_due),
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "sample_offset": self.sample_offset(),
        }

    def load_state_dict(self, loop: dict[str, Any]) -> None:
        self.epoch = int(loop["epoch"])
        self.global_step = int(loop["global_step"])
        self.batch_in_epoch = self.batch_at_last_step = int(loop["batch_in_epoch"])
        self.batches_stepped = int(loop.get("batches_stepped", self.global_step))
        self.total_batches = int(loop.get("total_batches", 0))
        self.total_unknown = "total_batches" not in loop
        # Files from before this entry did not record it: the loop then decides as it always did.
        due = loop.get("validation_due")
        self.validation_due = None if due is None else bool(due)
        self.at_epoch_end = False


@dataclass
class Resumed:
    """What a checkpoint left for the first epoch after a resume: the saved position (its ``sample_offset``
    and ``dp_size`` re-split the epoch when the data-parallel size changed), this rank's RNG state and
    the state of stateful training data (``data.stateful.select_rank_state``)."""

    loop: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    mid_epoch: bool = False
    data: dict[str, Any] | None = None

    def take_loop(self) -> dict[str, Any] | None:
        loop, self.loop = self.loop, None
        return loop


@dataclass
class Stopping:
    """``trainer.should_stop`` and what the ranks last agreed on. A request waits until ``min_epochs`` and
    ``min_steps`` are met; under several ranks the loop acts on ``agreed`` (set at points every rank
    reaches together: logging steps, after a validation, at the epoch's end), so a request made on one
    rank cannot split them."""

    requested: bool = False
    agreed: bool = False
    out_of_time: bool = False
    told_min: bool = False

    def reset(self) -> None:
        self.requested = False
        self.agreed = False
        self.out_of_time = False

    def request(self, stop: bool) -> None:
        """``trainer.should_stop = stop`` (a callback's request, or a time limit on this rank)."""
        self.requested = stop

    def agree(self, stop: bool) -> None:
        """What the ranks agreed on (reduced across them): the request is now theirs."""
        self.requested = self.agreed = stop

    def time_up(self) -> None:
        """``max_time`` reached, agreed by every rank: the fit stops and saves."""
        self.requested = self.out_of_time = True

    def first_wait_for_min(self) -> bool:
        """True the first time a request waits for ``min_epochs``/``min_steps`` (it is said once)."""
        first, self.told_min = not self.told_min, True
        return first


@dataclass
class EvalProgress:
    """Evaluation batches run per entry point (fit's validation, validate, test): the step axis of
    per-step evaluation values, as each of Lightning's loops counts its own."""

    batches: dict[str, int] = field(default_factory=dict)
    # the loaders the newest test and predict passes read, and the batches each ran of them
    # (trainer.test_dataloaders, num_test_batches; the fit's validation loaders are in EpochData)
    loaders: dict[str, list[Any]] = field(default_factory=dict)
    limits: dict[str, list[int | None]] = field(default_factory=dict)

    def next_step(self, stage: str) -> int:
        step = self.batches.get(stage, 0)
        self.batches[stage] = step + 1
        return step


@dataclass
class EpochData:
    """The loaders a fit runs and how many batches of each; the iterator's RNG state (checkpointed:
    a mid-epoch resume recreates the epoch's iterator and replays it through the workers)."""

    train_loader: Any = None
    # the validation loaders (several when val_dataloader returns a list or dict) and the batches a
    # validation runs of each (None: a loader without length, run until it ends)
    val_loaders: list[Any] = field(default_factory=list)
    val_batches: list[int | None] = field(default_factory=list)
    num_training_batches: int | None = None
    loader_rng: torch.Tensor | None = None
    stream: Any = None  # the epoch's AgreedBatches (iterable-style data): its snapshot of stateful data
    # estimated_stepping_batches asked for the train loader before the fit did.
    requested_early: bool = False
    # validation will run, and its loaders are asked for when the first validation starts (as Lightning,
    # when the fit's first epoch does not validate)
    val_pending: bool = False

    def has_val(self) -> bool:
        """A validation loader with batches to run (None: a loader without length, run until it ends), or
        loaders still to be asked for."""
        return self.val_pending or any(n != 0 for n in self.val_batches)

    def use_val(self, loaders: list[Any], num_batches: list[int | None]) -> None:
        self.val_loaders, self.val_batches, self.val_pending = list(loaders), list(num_batches), False

    def defer_val(self) -> None:
        self.val_loaders, self.val_batches, self.val_pending = [], [], True
