"""The user's step on one pipeline stage: the pipelined Sequential is replaced by a stand-in while
``training_step`` (or an evaluation step) runs, so the step sees the stage's output where it called the
Sequential, or, on the first stage, so the runner learns the Sequential's input and stops the step
there (``Captured``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Captured(Exception):
    """Raised by the input stand-in: the step got as far as calling the Sequential."""


class StandIn(nn.Module):
    """Takes the pipelined Sequential's place while a user's step runs: returns ``output`` (the stage
    output of this micro-batch), or, with ``output`` None, records its input and stops the step."""

    def __init__(self, output: Any, seq_name: str) -> None:
        super().__init__()
        self.output, self.seq_name, self.calls, self.input = output, seq_name, 0, None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.output is None:
            if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
                raise TypeError(f"self.{self.seq_name} must be called with one tensor under pipeline "
                                f"parallelism (it flows between stages); got {len(args)} argument(s) and "
                                f"{sorted(kwargs)}")
            self.input = args[0]
            raise Captured
        if self.calls > 1:
            raise RuntimeError(f"the step called self.{self.seq_name} {self.calls} times; under pipeline "
                               f"parallelism the Sequential runs once per batch "
                               f"(per micro-batch in training)")
        return self.output
