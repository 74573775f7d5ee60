"""``single``: one process, one device. The default when one process is asked for.

A preset of ``parallel`` with every degree 1 and no process group.
"""

from __future__ import annotations

from typing import Any

from polytrain.parallel.apply import ParallelLayout
from polytrain.strategies.composed import ParallelStrategy
from polytrain.strategies.options import SingleOptions
from polytrain.strategies.registry import register


@register
class SingleDeviceStrategy(ParallelStrategy):
    name = "single"
    Options = SingleOptions

    @classmethod
    def compose(cls, options: Any, num_nodes: int) -> ParallelLayout:
        # dp_replicate=-1: started as several processes (a launcher's choice) it stays what it always was,
        # independent replicas that never communicate.
        return ParallelLayout(dp_replicate=-1, dp_shard=1, data_parallel="none", process_group=False,
                              device_index=options.device_index)
