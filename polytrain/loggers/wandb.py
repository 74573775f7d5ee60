"""Lightning's module path ``loggers.wandb``."""

from polytrain.callbacks.experiment_loggers import WandbLogger

__all__ = ["WandbLogger"]
