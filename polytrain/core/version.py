"""The library's version, recorded in every checkpoint."""

__version__ = "0.1.0"
