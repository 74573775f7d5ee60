"""Layers for model-parallel training: vocabulary-parallel embeddings and multi-device Sequentials."""

from polytrain.layers.placement import PlacedSequential, PlacementError
from polytrain.layers.vocab_parallel import VocabParallel, VocabParallelEmbedding, vocab_range

__all__ = ["PlacedSequential", "PlacementError", "VocabParallel", "VocabParallelEmbedding", "vocab_range"]
