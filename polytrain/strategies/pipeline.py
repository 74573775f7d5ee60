"""``pipeline``: the module's ``nn.Sequential`` cut into stages run by ``torch.distributed.pipelining``.

A preset of ``parallel`` (``strategies.pipeline_runner`` does the work): ``pp`` ranks form one pipeline,
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

from typing import Any

from polytrain.parallel.apply import ParallelLayout, PipelineSettings
from polytrain.parallel.choices import SCHEDULES
from polytrain.parallel.pipeline_schedules import schedule_class
from polytrain.strategies.composed import ParallelStrategy
from polytrain.strategies.options import PipelineOptions
from polytrain.strategies.registry import register

__all__ = ["SCHEDULES", "PipelineOptions", "PipelineStrategy", "schedule_class"]


@register
class PipelineStrategy(ParallelStrategy):
    name = "pipeline"
    Options = PipelineOptions

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> ParallelLayout:
        o = options
        pipeline = PipelineSettings(o.schedule, o.n_microbatches, o.stages_per_rank, o.split_points,
                                    o.sequential, step="pipeline_loss")
        return ParallelLayout(pp=o.pp if o.pp > 0 else -1, dp_replicate=-1 if o.pp > 0 else 1, dp_shard=1,
                              data_parallel="all_reduce", backend=o.backend, pipeline=pipeline)
