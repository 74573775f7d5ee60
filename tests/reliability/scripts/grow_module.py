"""``RelModule`` for the elastic grow test (tests/reliability/test_elastic_grow.py): a node that dies
and a node that joins, driven from the environment of each launcher.

- ``POLYTRAIN_GROW_KILL_AT=S``: on the first attempt, at world size 2, once ``global_step >= S``,
  SIGKILL this worker's launcher's process group (the elastic agent, its workers: the whole "node").
- ``POLYTRAIN_GROW_HOLD_AFTER=K``: at world size 1, after K steps trained in this process, wait in
  ``training_step`` (at most ``POLYTRAIN_GROW_HOLD_MAX`` seconds, default 240) until the agent
  restarts the group because a node is waiting to join. The test starts that node once it sees the
  ``holding`` event, so the survivor has checkpointed at world size 1 first.

Every record also names the worker group it came from (``MASTER_PORT``: one per rendezvous round),
the process and the elastic restart count, so a test can tell rolled-back steps from kept ones.
The initial weights go to ``init_state.pt`` for a plain-PyTorch replay.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from rel_module import RelModule


class GrowModule(RelModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps_here = 0

    def _write(self, name: str, record: dict[str, Any]) -> None:
        super()._write(name, {**record, "rank": self.rank, "pid": os.getpid(),
                              "group": os.environ.get("MASTER_PORT"),
                              "restart_count": self._attempt(), "world_size": self.trainer.world_size})

    def on_fit_start(self) -> None:
        super().on_fit_start()
        path = os.path.join(self.out_dir or ".", "init_state.pt")
        if self.trainer.global_step == 0 and self.rank == 0 and not os.path.exists(path):
            torch.save({k: v.detach().clone() for k, v in self.state_dict().items()}, path + ".tmp")
            os.replace(path + ".tmp", path)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        world, step = self.trainer.world_size, self.trainer.global_step
        kill_at = int(os.environ.get("POLYTRAIN_GROW_KILL_AT", "-1"))
        if world == 2 and 0 <= kill_at <= step and self._attempt() == 0:
            # The launcher leads its own process group (the test starts it in a new session): its agent, the
            # server its workers are forked from and this worker all go at once, as a node's power does.
            self._write("events", {"event": "node_kill", "step": step, "launcher_pid": os.getpgid(0)})
            os.killpg(os.getpgid(0), signal.SIGKILL)
        hold_after = int(os.environ.get("POLYTRAIN_GROW_HOLD_AFTER", "-1"))
        if world == 1 and 0 <= hold_after <= self.steps_here:
            self._write("events", {"event": "holding", "step": step})
            deadline = time.time() + float(os.environ.get("POLYTRAIN_GROW_HOLD_MAX", "240"))
            while time.time() < deadline:  # ended by the agent's restart (SIGTERM) when a node joins
                time.sleep(0.1)
        self.steps_here += 1
        return super().training_step(batch, batch_idx)
