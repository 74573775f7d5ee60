"""Lightning's module path ``loggers.logger`` (a custom logger subclasses ``Logger``)."""

from polytrain.callbacks.loggers import DummyExperiment, Logger, rank_zero_experiment

__all__ = ["DummyExperiment", "Logger", "rank_zero_experiment"]
