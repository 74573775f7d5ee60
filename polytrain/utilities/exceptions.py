"""``polytrain.utilities.exceptions``: Lightning's exception names. polytrain's ``ConfigError`` subclasses
``MisconfigurationException``, so ``except MisconfigurationException`` in Lightning code catches it."""

from polytrain.core.errors import ConfigError, MisconfigurationException

__all__ = ["ConfigError", "MisconfigurationException"]
