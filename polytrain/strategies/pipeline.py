"""``pipeline``: the module's ``nn.Sequential`` cut into stages run by ``torch.distributed.pipelining``.

A preset of ``parallel`` (``strategies.pipelined`` does the work): ``pp`` ranks form one pipeline,
``dp = world / pp`` pipelines train replicas on different data (gradients averaged over dp by one
flat all-reduce per optimizer step). Each rank keeps only its stages' children of the user's
Sequential, under their original names, so checkpoints match every other strategy's.

The preset keeps the contract it was published with: batches are ``(inputs, targets)``, the last
stage computes ``module.pipeline_loss`` per micro-batch, and ``train/loss`` is logged on every rank.
(``parallel`` with ``pp > 1`` runs the user's ``training_step`` per micro-batch instead.) Evaluation
runs the user's step on the last stage with the Sequential standing in as the pipeline's output;
what it logs is copied to the other stages. See docs/strategies/pipeline.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.core.errors import ConfigError
from polytrain.parallel.apply import Layout, PipelineSettings
from polytrain.parallel.pipeline_stage import SCHEDULES, check_schedule_options, schedule_class
from polytrain.strategies.parallel import ParallelStrategy
from polytrain.strategies.registry import register

__all__ = ["SCHEDULES", "PipelineOptions", "PipelineStrategy", "schedule_class"]


@dataclass
class PipelineOptions:
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv
    n_microbatches: int | None = None  # None: the number of stages (pp x stages_per_rank)
    pp: int = -1  # pipeline degree; -1: the whole world (dp = world / pp)
    stages_per_rank: int = 1  # > 1 for the interleaved / zero-bubble schedules (zbv: exactly 2)
    split_points: list[int] | None = None  # first child index of stages 1..n-1; None: balance by params
    sequential: str | None = None  # attribute holding the nn.Sequential; None: the only one
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        check_schedule_options(self.schedule, self.stages_per_rank, self.n_microbatches)
        if self.pp == 0 or self.pp < -1:
            raise ConfigError(f"pipeline pp={self.pp} must be a positive degree or -1 (the whole world)")


@register
class PipelineStrategy(ParallelStrategy):
    name = "pipeline"
    Options = PipelineOptions

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> Layout:
        o = options
        return Layout(pp=o.pp if o.pp > 0 else -1, dp_replicate=-1 if o.pp > 0 else 1, dp_shard=1,
                      data_parallel="all_reduce", backend=o.backend,
                      pipeline=PipelineSettings(o.schedule, o.n_microbatches, o.stages_per_rank, o.split_points,
                                                o.sequential, step="pipeline_loss"))
