"""Every error polytrain raises on purpose. Each message names what happened and the fix.

Kept in the bottom layer so that any module may raise them without importing the one that
usually does (a strategy raising ``ConfigError`` must not depend on the config loader).
"""

from __future__ import annotations


class MisconfigurationException(Exception):
    """Lightning's name for a wrong setting (``polytrain.utilities.exceptions``); every ``ConfigError`` is
    one, so code written for Lightning catches polytrain's."""


class ConfigError(MisconfigurationException, ValueError):
    """A configuration value is unknown, mistyped or missing; the message names the fix."""


class StageInterrupted(SystemExit):
    """Ctrl-C during ``fit``/``validate``/``test``/``predict``: the callbacks have seen it (``on_exception``)
    and the program ends with exit status 130 and no traceback, as Lightning ends its (with 1)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (every rank raises the same one)."""


class SamplerError(ValueError):
    """A DataLoader's sampling cannot be split over the data-parallel ranks, or re-split on resume."""


class EmptyDataError(ValueError):
    """A loader yields no batches on some rank, or too few samples for the ranks."""


class NonFiniteError(FloatingPointError):
    """A loss, gradient norm or parameter became NaN/inf (``trainer.nan_policy: error``)."""


class DivergenceError(RuntimeError):
    """Ranks reached different collectives (``trainer.detect_divergence``)."""


class RankUnresponsiveError(RuntimeError):
    """A collective failed because one or more ranks stopped making progress."""


class RankFailedError(Exception):
    """Another rank raised in a step every rank takes together (``prepare_data``); the message carries that
    rank's traceback, so whichever rank's error a launcher reports first shows the real one. Not a
    ``RuntimeError``: the text of the original error must never pass for a failed collective."""


def first_few(names: list[str], shown: int = 3) -> str:
    """``names`` for a message: the first ``shown``, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
