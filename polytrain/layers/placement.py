"""Layers of one ``nn.Sequential`` spread over several devices of one process, with optional
micro-batch pipelining (``split_size``) so the devices work at the same time.

``PlacedSequential`` keeps the children of the Sequential it replaces under their original names,
so ``state_dict`` keys do not change: a checkpoint written with layers on four GPUs loads into the
same model on one device, and back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from polytrain.core.errors import ConfigError


class PlacementError(ConfigError):
    """The layers cannot be placed as asked; the message names the numbers and the fix."""


def stage_bounds(split_points: Sequence[int], n_children: int, n_devices: int) -> list[int]:
    """``[0, *split_points, n_children]`` after checking every device gets at least one child."""
    if n_children < n_devices:
        raise PlacementError(
            f"cannot place an nn.Sequential of {n_children} children on {n_devices} devices: "
            f"{n_devices - n_children} device(s) would hold nothing. Lower devices_per_process to at most "
            f"{n_children}, or split the model into more children"
        )
    points = [int(p) for p in split_points]
    bounds = [0, *points, n_children]
    if len(points) != n_devices - 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise PlacementError(
            f"split_points={points} do not cut {n_children} children into {n_devices} non-empty groups; give "
            f"{n_devices - 1} strictly increasing child indices between 1 and {n_children - 1}"
        )
    return bounds


class PlacedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose children run on ``devices[i]`` for ``bounds[i] <= index < bounds[i+1]``.

    ``forward`` moves activations from one device to the next and returns the output on the device
    the input came from, so a ``training_step`` written for one device needs no device code. With
    ``split_size`` the batch is cut into micro-batches of that many samples and the stages are
    issued in a wavefront: while device ``s`` works on micro-batch ``m``, device ``s-1`` already
    starts micro-batch ``m+1`` (CUDA kernels are asynchronous, so the devices overlap). The result
    equals the unsplit forward for layers without batch statistics (BatchNorm sees micro-batches).
    """

    def __init__(self, layers: nn.Sequential, devices: Sequence[torch.device | str],
                 split_points: Sequence[int], split_size: int | None = None) -> None:
        super().__init__(OrderedDict(layers.named_children()))
        if split_size is not None and split_size < 1:
            raise PlacementError(f"split_size={split_size} must be a positive number of samples (or null)")
        self.devices = [torch.device(d) for d in devices]
        self.bounds = stage_bounds(split_points, len(self), len(self.devices))
        self.split_size = split_size
        for stage, device in enumerate(self.devices):
            for child in self._stage_children(stage):
                child.to(device)

    def __getitem__(self, idx: int | slice) -> nn.Module:
        if isinstance(idx, slice):  # nn.Sequential would build a PlacedSequential without placement
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def _stage_children(self, stage: int) -> list[nn.Module]:
        children = list(self._modules.values())
        return children[self.bounds[stage]:self.bounds[stage + 1]]

    def _run_stage(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.devices[stage], non_blocking=True)
        for child in self._stage_children(stage):
            x = child(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        home = x.device
        if self.split_size is None or x.shape[0] <= self.split_size:
            for stage in range(len(self.devices)):
                x = self._run_stage(stage, x)
            return x.to(home)
        return self._pipelined(x).to(home)

    def _pipelined(self, x: torch.Tensor) -> torch.Tensor:
        chunks = list(x.split(self.split_size))
        n_stages, n_chunks = len(self.devices), len(chunks)
        waiting: list[torch.Tensor | None] = [None] * n_stages  # the input stage s takes next
        outputs: list[torch.Tensor] = []
        for tick in range(n_chunks + n_stages - 1):
            # Later stages first: stage s consumes what stage s-1 produced on the previous tick
            # before stage s-1 overwrites it with the next micro-batch.
            for stage in reversed(range(n_stages)):
                index = tick - stage
                if not 0 <= index < n_chunks:
                    continue
                out = self._run_stage(stage, chunks[index] if stage == 0 else waiting[stage])
                if stage == n_stages - 1:
                    outputs.append(out)
                else:
                    waiting[stage + 1] = out
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise PlacementError("split_size needs the nn.Sequential to return one tensor per micro-batch; "
                                 "set split_size: null for layers that return other outputs")
        return torch.cat(outputs)

    def extra_repr(self) -> str:
        spans = [f"{self.bounds[i]}-{self.bounds[i + 1] - 1}@{d}" for i, d in enumerate(self.devices)]
        return f"stages=[{', '.join(spans)}], split_size={self.split_size}"
