"""Lightning's module path ``loggers.tensorboard``."""

from polytrain.callbacks.tensorboard_logger import TensorBoardLogger

__all__ = ["TensorBoardLogger"]
