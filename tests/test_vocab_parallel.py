"""``VocabParallelEmbedding`` equals ``nn.Embedding``: outputs, and gradients of each rank's rows.

Two gloo ranks share one spawn and check an even vocabulary (10 rows, 5 each), an uneven one
(11 rows: 6 and 5, the ``Shard(0)`` sizes) with a padding row, and ids that all fall on one
rank (the other rank contributes only zeros and gets a zero gradient).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close

from polytrain.layers import VocabParallel, VocabParallelEmbedding, vocab_range

pytestmark = pytest.mark.torch_api

CASES = [  # (vocab size, padding_idx, ids)
    (10, None, torch.tensor([[0, 3, 9, 5], [4, 5, 6, 1]])),
    (11, 7, torch.tensor([[10, 7, 0, 6], [5, 6, 7, 3]])),
    (12, None, torch.tensor([[0, 1, 2], [3, 4, 5]])),  # every id on rank 0
]
DIM = 4


def _reference(vocab: int, padding_idx: int | None,
               ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, DIM, padding_idx=padding_idx)
    out = emb(ids)
    upstream = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / out.numel()
    (out * upstream).sum().backward()
    return out.detach(), emb.weight.grad, upstream


def _worker(rank: int, world_size: int) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = []
    for vocab, padding_idx, ids in CASES:
        torch.manual_seed(0)
        layer = VocabParallelEmbedding(vocab, DIM, padding_idx=padding_idx)
        holder = nn.ModuleDict({"embed": layer})
        parallelize_module(holder, mesh, {"embed": VocabParallel()})  # the plan entry the strategy applies
        out = layer(ids)
        _, _, upstream = _reference(vocab, padding_idx, ids)
        (out * upstream).sum().backward()
        state = layer.state_dict()["weight"]
        results.append({
            "out": out.detach(),
            "rows": (layer.vocab_start, layer.vocab_end),
            "grad": layer.weight.grad.to_local().clone(),
            "grad_is_dtensor": isinstance(layer.weight.grad, DTensor),
            "state_shape": tuple(state.shape),
            "full_weight": state.full_tensor(),
        })
    return results


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_vocab_parallel_embedding_matches_nn_embedding_on_two_ranks() -> None:
    ranks = run_distributed(_worker, 2, timeout=100.0)
    for case, (vocab, padding_idx, ids) in enumerate(CASES):
        out, grad, _ = _reference(vocab, padding_idx, ids)
        torch.manual_seed(0)
        full_init = nn.Embedding(vocab, DIM, padding_idx=padding_idx).weight.detach()
        for rank, results in enumerate(ranks):
            got = results[case]
            start, end = vocab_range(vocab, rank, 2)
            assert got["rows"] == (start, end)
            assert_close(got["out"], out, rtol=0, atol=1e-6)  # every rank holds the whole output
            assert got["grad_is_dtensor"]
            assert_close(got["grad"], grad[start:end], rtol=0, atol=1e-6)  # this rank's rows only
            # The checkpoint entry has nn.Embedding's name and full shape (and rank 0's initial values).
            assert got["state_shape"] == (vocab, DIM)
            assert_close(got["full_weight"], full_init, rtol=0, atol=0)
    assert ranks[1][1]["rows"] == (6, 11) and ranks[0][1]["rows"] == (0, 6)
    assert torch.count_nonzero(ranks[1][2]["grad"]) == 0  # no id of the last case is in rank 1's rows


def test_unsharded_layer_is_nn_embedding() -> None:
    ids = torch.tensor([[1, 2, 0], [2, 2, 3]])
    torch.manual_seed(0)
    ref = nn.Embedding(5, DIM, padding_idx=2)
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(5, DIM, padding_idx=2)
    assert_close(layer.weight, ref.weight, rtol=0, atol=0)
    F.mse_loss(layer(ids), torch.ones(2, 3, DIM)).backward()
    F.mse_loss(ref(ids), torch.ones(2, 3, DIM)).backward()
    assert_close(layer.weight.grad, ref.weight.grad, rtol=0, atol=0)
    assert torch.count_nonzero(layer.weight.grad[2]) == 0  # the padding row gets no gradient


def test_vocab_range_matches_torch_chunk_and_errors_are_clear() -> None:
    for vocab, world in [(10, 2), (11, 2), (7, 3), (3, 4)]:
        sizes = [len(c) for c in torch.arange(vocab).chunk(world)]
        sizes += [0] * (world - len(sizes))
        assert [vocab_range(vocab, r, world)[1] - vocab_range(vocab, r, world)[0]
                for r in range(world)] == sizes
    with pytest.raises(TypeError, match="VocabParallel\\(\\) applies to "
                                        "polytrain.layers.VocabParallelEmbedding, not Embedding"):
        VocabParallel()._apply(nn.Embedding(4, 2), None)
    with pytest.raises(ValueError, match=r"padding_idx=9 must be in \[0, 4\)"):
        VocabParallelEmbedding(4, 2, padding_idx=9)
