"""``polytrain.core.collectives.all_gather_object`` over two real gloo ranks: plain CPU tensors travel as
raw bytes (pickling a tensor goes through torch.save/torch.load, ~0.5 ms per checkpoint's RNG states);
what arrives must be what was sent, bit for bit, with its dtype, shape and container types."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed

pytestmark = pytest.mark.torch_api


def _payload(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    return {
        "rng": torch.get_rng_state(),  # uint8, what a checkpoint gathers
        "ints": torch.randint(-2**40, 2**40, (7,), generator=g),
        "floats": [torch.randn(3, 4, generator=g).t(), torch.randn(2, generator=g, dtype=torch.float64)],
        "small": (torch.tensor(rank, dtype=torch.int16), torch.tensor(rank == 1),
                  torch.ones(2, dtype=torch.float16)),
        "empty": torch.zeros(0, 5),
        "bf16": torch.full((2,), rank + 0.5, dtype=torch.bfloat16),  # numpy cannot hold it: pickled as before
        "grad": torch.ones(2, requires_grad=True),  # likewise
        "other": {"rank": rank, "name": f"r{rank}", "nested": [1, (2.5, None)]},
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach()))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _gather_worker(rank: int, world_size: int) -> list[bool]:
    import torch.distributed as dist

    from polytrain.core import collectives as C

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    got = C.all_gather_object(_payload(rank))
    got[0]["ints"].add_(1)  # received tensors own their memory (writable, not views of a buffer)
    got[0]["ints"].sub_(1)
    return [_same(got[r], _payload(r)) for r in range(world_size)]


@pytest.mark.timeout(120)
def test_all_gather_object_delivers_tensors_bit_for_bit() -> None:
    assert run_distributed(_gather_worker, 2) == [[True, True], [True, True]]


def test_one_process_gets_its_own_object_back() -> None:
    from polytrain.core import collectives as C

    payload = _payload(0)
    assert C.all_gather_object(payload)[0] is payload


def test_plain_cpu_tensors_leave_as_bytes_and_the_rest_as_they_are() -> None:
    """The packing is on: what pickle would send through torch.save is bytes before the gather."""
    import pickle

    from polytrain.core import collectives as C

    payload = _payload(1)
    packed = C._pack(payload)
    tensors = [packed["rng"], packed["ints"], *packed["floats"], *packed["small"], packed["empty"]]
    assert not any(isinstance(t, torch.Tensor) for t in tensors)
    assert isinstance(packed["bf16"], torch.Tensor) and isinstance(packed["grad"], torch.Tensor)
    assert packed["other"] == payload["other"]
    assert _same(C._unpack(pickle.loads(pickle.dumps(packed))), payload)
