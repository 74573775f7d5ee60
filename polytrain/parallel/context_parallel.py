"""Context parallelism (``cp``): each rank of a ``cp`` group holds a slice of every sequence.

torch's ``context_parallel`` shards the batch's tensors along their sequence dimension in place and
routes ``scaled_dot_product_attention`` to a ring attention over the ``cp`` mesh. torch implements
that ring only for the flash and memory-efficient SDPA kernels, which exist on CUDA alone; on any
other device type (CPU/gloo) ``cp > 1`` is refused at config load, with the reason.

Parameters are replicated over ``cp`` and their gradients reduced over it together with
``dp_shard`` (FSDP shards over ``dp_shard x cp``: ``ParallelDims.get_mesh("fsdp")``). The module
says which tensors to shard with ``context_parallel_buffers(batch) -> [(tensor, seq_dim), ...]``;
by default every tensor of the batch with at least two dimensions, along dimension 1 (``(batch,
sequence, ...)``). Position ids computed inside the model from the local length (``arange(t)``) would
be wrong under ``cp``: pass positions in the batch so they are sharded with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from polytrain.core import lazy
from polytrain.core.errors import ConfigError
from polytrain.parallel.choices import check_context_parallel_device


def check_context_parallel(cp: int, device_type: str | None = None) -> None:
    """``cp > 1`` must be something torch can run here; raise ``ConfigError`` saying why not."""
    if cp < 1:
        raise ConfigError(f"parallel degree cp={cp} must be >= 1")
    if cp == 1:
        return
    if getattr(lazy.dtensor().experimental, "context_parallel", None) is None:
        raise ConfigError(f"cp={cp} needs torch.distributed.tensor.experimental.context_parallel, "
                          f"which torch {torch.__version__} lacks; use cp=1")
    if device_type is not None:
        check_context_parallel_device(cp, device_type)


def default_buffers(batch: Any) -> list[tuple[torch.Tensor, int]]:
    """Every tensor of the batch with at least two dimensions, sharded along dimension 1."""
    found: list[tuple[torch.Tensor, int]] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.ndim >= 2:
                found.append((x, 1))
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(batch)
    return found


@contextlib.contextmanager
def context_parallel_step(cp_mesh: Any, module: nn.Module, batch: Any) -> Iterator[None]:
    """Run the step inside torch's ``context_parallel`` with the batch's sequence tensors sharded."""
    hook = getattr(module, "context_parallel_buffers", None)
    pairs = hook(batch) if callable(hook) else default_buffers(batch)
    buffers = [t for t, _ in pairs]
    with lazy.dtensor().experimental.context_parallel(cp_mesh, buffers=buffers,
                                                      buffer_seq_dims=[d for _, d in pairs],
                                                      no_restore_buffers=set(buffers)):
        yield


def context_parallel_training_step(step: Callable[[Any, int], Any], cp_mesh: Any, module: nn.Module
                                   ) -> Callable[[Any, int], Any]:
    """``step`` (the user's training step, bound) run inside ``context_parallel_step`` for each batch."""

    def context_parallel(batch: Any, batch_idx: int) -> Any:
        with context_parallel_step(cp_mesh, module, batch):
            return step(batch, batch_idx)

    return context_parallel
