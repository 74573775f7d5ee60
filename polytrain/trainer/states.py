"""``polytrain.trainer.states``: where Lightning code imports ``TrainerFn``, ``RunningStage``,
``TrainerStatus`` and ``TrainerState`` from (defined in ``core/states.py``, which callbacks also read)."""

from polytrain.core.states import RunningStage, TrainerFn, TrainerState, TrainerStatus

__all__ = ["RunningStage", "TrainerFn", "TrainerState", "TrainerStatus"]
