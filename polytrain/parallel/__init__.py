"""Parallelisms as plain functions over a model: the degrees and meshes (``dims.ParallelDims``), and
tensor parallel, activation checkpointing, compile and FSDP/DDP applied in one stated order (``apply``);
pipeline splitting and stages; context parallel."""
