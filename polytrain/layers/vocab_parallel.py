"""A Megatron-style embedding split over the vocabulary across tensor-parallel ranks.

Each rank of the tensor-parallel group keeps a contiguous slice of the embedding rows. A lookup
zeroes the ids that fall outside the rank's slice, looks the others up locally, and sums the
partial results over the group, so every rank ends with the full embedding of every id. The
weight is a ``DTensor`` sharded on dim 0, so its state-dict entry keeps the full shape and name of
an ``nn.Embedding`` weight and sharded checkpoints load into either layer.

Build it like ``nn.Embedding``; it holds the whole table until it is sharded by the
``VocabParallel()`` style in a tensor-parallel plan (or ``layer.shard_(tp_mesh)``). Unsharded it is
exactly ``nn.Embedding``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of the rows rank ``rank`` holds: ``torch.chunk`` sizes, as ``Shard(0)`` uses."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


class _SumOverGroup(torch.autograd.Function):
    """Forward: sum the partial embeddings over the group. Backward: the identity.

    Every rank of the group computes the same loss from the same summed output, so each rank's
    gradient with respect to its partial sum is exactly the incoming gradient.
    """

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx={padding_idx} must be in [0, {num_embeddings}) (num_embeddings="
                             f"{num_embeddings})")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.vocab_start, self.vocab_end = 0, num_embeddings
        self.group: Any = None  # the tensor-parallel process group once sharded
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s initialisation: N(0, 1), the padding row zero."""
        if isinstance(self.weight, DTensor):
            raise RuntimeError("reset_parameters() on a sharded VocabParallelEmbedding; "
                               "initialise before shard_()")
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def shard_(self, tp_mesh: Any, src_data_rank: int | None = 0) -> VocabParallelEmbedding:
        """Keep only this rank's rows of the table (rank ``src_data_rank``'s values are the truth)."""
        if isinstance(self.weight, DTensor):
            raise RuntimeError("VocabParallelEmbedding is already sharded; shard_() it once")
        if tp_mesh.ndim != 1:
            raise ValueError(f"shard_() needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim} dims "
                             f"{tp_mesh.mesh_dim_names}; pass mesh['tp']")
        weight = distribute_tensor(self.weight.detach(), tp_mesh, [Shard(0)], src_data_rank=src_data_rank)
        self.weight = nn.Parameter(weight, requires_grad=self.weight.requires_grad)
        self.vocab_start, self.vocab_end = vocab_range(self.num_embeddings, tp_mesh.get_local_rank(),
                                                       tp_mesh.size())
        rows = weight.to_local().shape[0]
        if rows != self.vocab_end - self.vocab_start:
            raise RuntimeError(f"local shard has {rows} rows but vocab_range gives [{self.vocab_start}, "
                               f"{self.vocab_end}) of {self.num_embeddings}; torch changed Shard(0) sizes")
        self.group = tp_mesh.get_group()
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if self.group is None:
            return F.embedding(ids, weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        padding = self.padding_idx
        holds_padding = padding is not None and self.vocab_start <= padding < self.vocab_end
        local_padding = padding - self.vocab_start if holds_padding else None
        if weight.shape[0] == 0:  # more ranks than rows: this rank holds none of the vocabulary
            partial = weight.sum() * 0 + weight.new_zeros(*ids.shape, self.embedding_dim)
        else:
            partial = F.embedding(local_ids, weight, local_padding)
            # Out-of-slice ids looked up row 0; zeroing them (out of place) also zeroes their gradient.
            partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        return _SumOverGroup.apply(partial, self.group)

    def extra_repr(self) -> str:
        sharded = f", rows [{self.vocab_start}, {self.vocab_end})" if self.group is not None else ""
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}{sharded}"


class VocabParallel(ParallelStyle):
    """Plan entry for a ``VocabParallelEmbedding``: ``{"embed": VocabParallel()}``."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, VocabParallelEmbedding):
            raise TypeError(f"VocabParallel() applies to polytrain.layers.VocabParallelEmbedding, not "
                            f"{type(module).__name__}; build the layer as VocabParallelEmbedding(num, dim) "
                            f"(for an nn.Embedding use RowwiseParallel())")
        return module.shard_(device_mesh, self.src_data_rank)
