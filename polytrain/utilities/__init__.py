"""Lightning's ``utilities`` names that projects import: ``rank_zero_only``, ``rank_zero_info``,
``rank_zero_warn``, ``rank_zero_debug``, ``seed_everything``
(``from polytrain.utilities import rank_zero_only``, or ``pl.utilities.rank_zero_only``)."""

from polytrain.core.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn
from polytrain.core.rng import seed_everything

__all__ = ["rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn", "seed_everything"]
