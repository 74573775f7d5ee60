"""Checkpoint formats and state: single files and torch.distributed.checkpoint directories, the I/O
objects a strategy is given (``checkpoint_io``), model and optimizer state keyed as on one device
(``state``), reading any checkpoint into one process, and where a run's checkpoints live (``layout``)."""
