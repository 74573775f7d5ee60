"""Layers for model-parallel training: vocabulary-parallel embeddings, multi-device Sequentials, and
``sharded_rng`` for random ops inside tensor-parallel sharded regions."""

from polytrain.core.rng import sharded_rng
from polytrain.layers.placement import PlacedSequential, PlacementError
from polytrain.layers.vocab_parallel import VocabParallel, VocabParallelEmbedding, vocab_range

__all__ = ["PlacedSequential", "PlacementError", "VocabParallel", "VocabParallelEmbedding", "sharded_rng",
           "vocab_range"]
