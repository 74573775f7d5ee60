"""What ``TrainModule.log`` records, and how it is reduced across ranks without extra syncs.

Per-step values stay on the device until a logging step asks for them. Per-epoch values are kept
as (weighted sum, sample count) pairs so that ranks with different numbers of samples reduce to
exactly the single-process mean; one all-reduce per epoch carries all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polytrain.core import collectives as C


@dataclass
class _Meta:
    prog_bar: bool
    logger: bool
    sync_dist: bool


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.float32 and value.dim() == 0:
            return value  # what reshape(()).float() gives, without two dispatches per logged value
        if value.numel() != 1:
            raise ValueError(f"self.log needs a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.reshape(()).float()
    if isinstance(value, (int, float, bool)):
        return torch.tensor(float(value), device=device)
    raise TypeError(f"self.log needs a number or a scalar tensor, got {type(value).__name__}")


class MetricCollector:
    def __init__(self) -> None:
        self.stage = "train"
        self.device = torch.device("cpu")
        self.batch_size = 1
        self.step_values: dict[str, torch.Tensor] = {}
        # stage -> name -> [weighted sum, count]; validation inside a training epoch keeps its own.
        self.epoch_sums: dict[str, dict[str, list[torch.Tensor]]] = {}
        self.meta: dict[str, _Meta] = {}

    def log(self, name: str, value: Any, *, prog_bar: bool, sync_dist: bool, on_step: bool | None,
            on_epoch: bool | None, batch_size: int | None, logger: bool) -> None:
        training = self.stage == "train"
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        tensor = _as_tensor(value, self.device)
        meta = self.meta.get(name)
        if meta is None or meta.prog_bar != prog_bar or meta.logger != logger or meta.sync_dist != sync_dist:
            self.meta[name] = _Meta(prog_bar, logger, sync_dist)
        if on_step:
            self.step_values[name] = tensor
        if on_epoch:
            weight = float(batch_size if batch_size is not None else self.batch_size)
            sums = self.epoch_sums.setdefault(self.stage, {})
            entry = sums.get(name)
            if entry is None:
                sums[name] = [tensor * weight, torch.tensor(weight, device=tensor.device)]
            else:
                entry[0] = entry[0] + tensor * weight
                entry[1] = entry[1] + weight

    def start_stage(self, stage: str) -> None:
        self.stage = stage

    def pop_step_values(self, dp_group: Any = None) -> dict[str, torch.Tensor]:
        """The latest per-step values; those logged with ``sync_dist`` are averaged over ranks.

        Every rank calls this on the same (logging) steps, so the all-reduce is matched.
        """
        values = dict(self.step_values)
        # Popped, not peeked: a value logged once must not be re-emitted at every later logging step.
        self.step_values.clear()
        synced = sorted(k for k, v in values.items() if self.meta[k].sync_dist)
        if synced and C.active(dp_group):
            packed = C.all_reduce(torch.stack([values[k].float() for k in synced]), "mean", dp_group)
            values.update(zip(synced, packed.unbind(0)))
        return values

    def reduce_epoch(self, stage: str, dp_group: Any = None) -> dict[str, torch.Tensor]:
        """Sample-weighted means over every data-parallel rank; called by all ranks at epoch end."""
        epoch_sums = self.epoch_sums.pop(stage, {})
        local = sorted(epoch_sums)
        # Ranks can differ in which names they logged (a rank with no batches logged none), so
        # agree on the union first; a missing name contributes (0, 0).
        names = sorted(set().union(*map(set, C.all_gather_object(local, dp_group)))) if C.active(dp_group) else local
        if not names:
            return {}
        device = self.device
        zero = torch.zeros((), device=device)
        sums = torch.stack([epoch_sums.get(n, [zero, zero])[0].to(device) for n in names]
                           + [epoch_sums.get(n, [zero, zero])[1].to(device) for n in names])
        sums = C.all_reduce(sums, "sum", dp_group)
        totals, counts = sums[: len(names)], sums[len(names):]
        return {n: totals[i] / counts[i].clamp_min(1e-12) for i, n in enumerate(names) if counts[i] > 0}

    def reset_epoch(self, stage: str) -> None:
        self.epoch_sums.pop(stage, None)

    def names_for(self, values: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in values.items() if getattr(self.meta.get(k, _Meta(False, True, False)), kind)}
