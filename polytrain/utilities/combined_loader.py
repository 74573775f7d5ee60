"""``polytrain.utilities.combined_loader``: where Lightning keeps ``CombinedLoader``."""

from polytrain.data.combined_loader import CombinedLoader

__all__ = ["CombinedLoader"]
