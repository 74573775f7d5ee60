"""``polytrain checkpoint consolidate SRC DST``: one plain ``state_dict`` file for export.

``SRC`` is a sharded (DCP) checkpoint directory or a replicated ``.ckpt`` file; ``DST`` receives the
model's weights only, full tensors on CPU, keyed as the unwrapped model names them, so a plain
``model.load_state_dict(torch.load(DST))`` works without polytrain. No process group is needed:
the shards are read in this one process (it needs memory for the whole model).
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.checkpoint.reading import read_checkpoint
from polytrain.checkpoint.replicated import atomic_save
from polytrain.core.errors import CheckpointError


def consolidate(source: str, output: str) -> dict[str, torch.Tensor]:
    """Write ``source``'s model weights to ``output`` (atomically) and return them."""
    payload: dict[str, Any] = read_checkpoint(source)  # safe: weights-only / allow-listed metadata
    state = payload.get("model")
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{source} holds no model weights (keys: {sorted(payload)}); is it a polytrain "
                              f"checkpoint?")
    state = {k: v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    atomic_save(state, output)
    return state
