"""Strategies: one small class per parallelism, plus launch and cluster-environment code."""
