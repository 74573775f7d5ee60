"""Callbacks: progress bar, loggers, checkpointing, early stopping, monitors."""

from __future__ import annotations

from polytrain.core.exports import lazy_exports

_EXPORTS = {
    "Callback": "polytrain.callbacks.base",
    "ProgressBar": "polytrain.callbacks.progress_bar",
    "TQDMProgressBar": "polytrain.callbacks.progress_bar",
    "TensorBoardLogger": "polytrain.callbacks.tensorboard_logger",
    "CSVLogger": "polytrain.callbacks.csv_logger",
    "Logger": "polytrain.callbacks.loggers",
    "MLFlowLogger": "polytrain.callbacks.experiment_loggers",
    "WandbLogger": "polytrain.callbacks.experiment_loggers",
    "ModelCheckpoint": "polytrain.callbacks.model_checkpoint",
    "OnExceptionCheckpoint": "polytrain.callbacks.on_exception_checkpoint",
    "EarlyStopping": "polytrain.callbacks.early_stopping",
    "LearningRateMonitor": "polytrain.callbacks.monitors",
    "ThroughputMonitor": "polytrain.callbacks.monitors",
    "ModelSummary": "polytrain.callbacks.summary",
    "BasePredictionWriter": "polytrain.callbacks.prediction_writer",
    "CompileTime": "polytrain.callbacks.compile_time",
    "BaseFinetuning": "polytrain.callbacks.finetuning",
    "BackboneFinetuning": "polytrain.callbacks.finetuning",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
