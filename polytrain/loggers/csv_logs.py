"""Lightning's module path ``loggers.csv_logs``."""

from polytrain.callbacks.csv_logger import CSVLogger, ExperimentWriter

__all__ = ["CSVLogger", "ExperimentWriter"]
