"""``polytrain.utilities.rank_zero``: where Lightning keeps the ``rank_zero_*`` helpers."""

from polytrain.core.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]
