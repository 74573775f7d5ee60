"""``polytrain.connect()`` joins the job's process group whatever the strategy.

With ``model_parallel`` in tensor mode, ``connect()`` returned a strategy whose collectives were the
identity: the process group was left for ``setup_module`` (which ``connect`` never calls), so
``all_reduce`` handed back the local value on every rank and nothing said so. Reference: plain
``torch.distributed`` on the group the strategy joined, and the ``ddp`` strategy's answer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from polytrain import connect

pytestmark = pytest.mark.torch_api


def _worker(rank: int, world_size: int, spec: Any) -> dict[str, Any]:
    strategy = connect(spec, accelerator="cpu", timeout=30)
    try:
        joined = dist.is_available() and dist.is_initialized()
        mine = torch.tensor([float(rank + 1)])
        total = strategy.all_reduce(mine.clone(), "sum")
        reference = None
        if joined:
            reference = mine.clone()
            dist.all_reduce(reference)  # plain torch.distributed
        gathered = strategy.all_gather(mine.clone())
        return {"joined": joined, "world": dist.get_world_size() if joined else None,
                "total": total.tolist(), "reference": reference.tolist() if reference is not None else None,
                "gathered": gathered.flatten().tolist(), "dp": (strategy.dp_rank, strategy.dp_size)}
    finally:
        strategy.teardown()


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [{"name": "model_parallel", "mode": "tensor", "tp": 2}, "ddp"],
                         ids=["model_parallel-tensor", "ddp"])
def test_connect_joins_the_process_group(spec: Any) -> None:
    runs = run_distributed(_worker, 2, spec, timeout=50.0)
    for rank, run in enumerate(runs):
        assert run["joined"] and run["world"] == 2, f"rank {rank} did not join the process group: {run}"
        assert run["total"] == run["reference"] == [3.0], f"rank {rank}: all_reduce gave {run['total']}"
        assert run["gathered"] == [1.0, 2.0], run
    expected_dp = [(0, 1), (0, 1)] if isinstance(spec, dict) else [(0, 2), (1, 2)]
    assert [r["dp"] for r in runs] == expected_dp
