"""What a Trainer is doing, in Lightning's words: ``trainer.state`` holds the entry point that runs
(``fn``), the loop inside it (``stage``) and whether it runs, finished or was interrupted (``status``).

The members are strings as well as enum members, so ``trainer.state.fn == "fit"`` holds, as in Lightning.
Kept in the bottom layer: callbacks read it as well as the loops that set it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class _NamedByValue(str, Enum):
    """An enum member equal to its value, compared without regard to case, as Lightning's enums."""

    def __eq__(self, other: object) -> bool:
        other = other.value if isinstance(other, Enum) else other
        return isinstance(other, str) and self.value.lower() == other.lower()

    def __hash__(self) -> int:
        return hash(self.value.lower())

    def __str__(self) -> str:
        return self.value


class TrainerStatus(_NamedByValue):
    INITIALIZING = "initializing"  # built, no entry point called yet
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"  # Ctrl-C (KeyboardInterrupt), or an error raised inside the stage

    @property
    def stopped(self) -> bool:
        return self in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED)


class TrainerFn(_NamedByValue):
    """The entry point that runs: ``trainer.fit``, ``validate``, ``test`` or ``predict``."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(_NamedByValue):
    """The loop that runs inside the entry point (a fit runs training, validation and the sanity check)."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str | None:
        """The ``<prefix>_dataloader`` method this stage reads."""
        if self in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING):
            return "val"
        return self.value


# the loop an entry point runs first
FIRST_STAGE = {TrainerFn.FITTING: RunningStage.TRAINING, TrainerFn.VALIDATING: RunningStage.VALIDATING,
               TrainerFn.TESTING: RunningStage.TESTING, TrainerFn.PREDICTING: RunningStage.PREDICTING}


@dataclass
class TrainerState:
    """``trainer.state``: written by the Trainer (``fn``, ``status``) and its loops (``stage``)."""

    status: TrainerStatus = TrainerStatus.INITIALIZING
    fn: TrainerFn | None = None
    stage: RunningStage | None = None

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status.stopped
