"""Lightning's module path ``loggers.mlflow``."""

from polytrain.callbacks.experiment_loggers import MLFlowLogger

__all__ = ["MLFlowLogger"]
