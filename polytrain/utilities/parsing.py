"""``polytrain.utilities.parsing``: where Lightning keeps ``AttributeDict`` and ``is_picklable``."""

import pickle
from typing import Any

from polytrain.trainer.api.hparams import AttributeDict

__all__ = ["AttributeDict", "is_picklable"]


def is_picklable(obj: Any) -> bool:
    """Whether ``pickle`` can write ``obj`` (what a checkpoint's hyperparameters must be)."""
    try:
        pickle.dumps(obj)
    except (pickle.PickleError, AttributeError, RecursionError, TypeError):
        return False
    return True
