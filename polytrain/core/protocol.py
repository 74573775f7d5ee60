"""The little a strategy needs to know about the user's module, without importing ``TrainModule``.

- ``extract_loss``: what ``training_step`` returned, as the loss tensor to backpropagate.
- ``muted_logs`` / ``captured_logs`` / ``recorded_logs``: route ``self.log`` calls made inside a block.
  A padding batch (sharded evaluation) must count in no metric; a pipeline's last stage records what the
  user's step logged so the other stages can log the same values. ``TrainModule.log`` reads the
  tap named ``LOG_TAP`` from the module's ``__dict__``; nothing here touches the Trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

LOG_TAP = "_polytrain_log_tap"
MUTED = object()  # the tap value that drops every logged value


def extract_loss(output: Any) -> torch.Tensor | None:
    """``training_step``'s result as the loss: a tensor, ``{"loss": tensor, ...}``, or None (skip)."""
    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise ValueError("training_step returned a dict without a 'loss' key; "
                             "return {'loss': tensor, ...}")
        return output["loss"]
    raise TypeError(f"training_step must return a loss tensor, a dict with 'loss', or None; "
                    f"got {type(output).__name__}")


@contextlib.contextmanager
def _tapped(module: nn.Module, tap: Any) -> Iterator[None]:
    previous = module.__dict__.get(LOG_TAP)
    module.__dict__[LOG_TAP] = tap
    try:
        yield
    finally:
        if previous is None:
            module.__dict__.pop(LOG_TAP, None)
        else:
            module.__dict__[LOG_TAP] = previous


def muted_logs(module: nn.Module) -> contextlib.AbstractContextManager:
    """``self.log`` calls inside are dropped (a padding batch must never count in a metric)."""
    return _tapped(module, MUTED)


def captured_logs(module: nn.Module, records: list[tuple[str, torch.Tensor, dict[str, Any]]]
                  ) -> contextlib.AbstractContextManager:
    """``self.log`` calls inside are logged as usual and also appended to ``records`` as
    ``(name, detached scalar tensor, keyword arguments)``."""
    return _tapped(module, records)


class SilentRecords(list):
    """A tap that records ``self.log`` calls and logs nothing (``TrainModule.log`` stops after
    appending to a tap whose ``silent`` is True)."""

    silent = True


def recorded_logs(module: nn.Module, records: SilentRecords) -> contextlib.AbstractContextManager:
    """``self.log`` calls inside are only appended to ``records`` (a pipeline's last stage runs the
    user's step once per micro-batch and logs the micro-batches' mean once, on every stage)."""
    return _tapped(module, records)
