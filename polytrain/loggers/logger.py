"""Lightning's module path ``loggers.logger`` (a custom logger subclasses ``Logger``)."""

from polytrain.callbacks.loggers import DummyExperiment, DummyLogger, Logger, rank_zero_experiment

__all__ = ["DummyExperiment", "DummyLogger", "Logger", "rank_zero_experiment"]
