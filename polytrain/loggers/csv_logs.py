"""Lightning's module path ``loggers.csv_logs``."""

from polytrain.callbacks.csv_logger import CSVLogger

__all__ = ["CSVLogger"]
