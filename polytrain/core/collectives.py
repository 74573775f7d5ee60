"""Collectives as plain functions over an optional process group.

Every function is a no-op (or the identity) when no process group is initialised, so the same
code runs on one process. Every rank in ``group`` must call the same function in the same order:
these are never to be called from a rank-dependent branch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from polytrain.core.divergence import check_in

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def active(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size(group: Any = None) -> int:
    """Processes in ``group`` (the default group: all of them; 1 without a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def default_device() -> torch.device:
    """Where the default group's small control tensors live: the current GPU under NCCL, else the CPU."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _op(name: str) -> dist.ReduceOp:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"unknown reduce op '{name}'; valid: {', '.join(_OPS)}") from None


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In place, like ``torch.distributed.all_reduce``; also returns the tensor."""
    if active(group):
        check_in("all_reduce", group)
        dist.all_reduce(tensor, op=_op(op), group=group)
        if op == "mean":
            tensor.div_(dist.get_world_size(group))
    return tensor


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In place; only rank ``dst`` holds the result afterwards (global rank numbering)."""
    if active(group):
        check_in("reduce", group)
        dist.reduce(tensor, dst=dst, op=_op(op), group=group)
        if op == "mean" and dist.get_rank() == dst:
            tensor.div_(dist.get_world_size(group))
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None) -> torch.Tensor:
    if active(group):
        check_in("broadcast", group)
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    if not active(group):
        return obj
    check_in("broadcast_object", group)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Stacks every rank's tensor (same shape on every rank) along a new first dimension."""
    if not active(group):
        return tensor.unsqueeze(0)
    check_in("all_gather", group)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return torch.stack(out)


def all_gather_object(obj: Any, group: Any = None, background: bool = False) -> list[Any]:
    """Every rank's ``obj`` (picklable). Plain CPU tensors inside dicts, lists and tuples travel as raw
    bytes: pickle would write a tensor's storage through ``torch.save`` and read it back through
    ``torch.load``, for a checkpoint's RNG states at every save. ``background``: called from a thread
    of its own over a group of its own (a checkpoint writer), so the divergence guard, which follows
    the training thread's collectives, does not count it."""
    if not active(group):
        return [obj]
    if not background:
        check_in("all_gather_object", group)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, _pack(obj), group=group)
    return [_unpack(item) for item in out]


# dtypes whose tensors numpy can hold, so ``.numpy().tobytes()`` and ``torch.frombuffer`` round-trip them.
_RAW_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
               torch.float64, torch.bool}


class _RawTensor(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _pack(obj: Any) -> Any:
    kind = type(obj)
    if kind is torch.Tensor:
        if (obj.device.type != "cpu" or obj.layout != torch.strided or obj.requires_grad
                or obj.dtype not in _RAW_DTYPES):
            return obj
        return _RawTensor(str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                          obj.contiguous().numpy().tobytes())
    if kind is dict:
        return {k: _pack(v) for k, v in obj.items()}
    if kind is list or kind is tuple:
        return kind(_pack(v) for v in obj)
    return obj


def _unpack(obj: Any) -> Any:
    kind = type(obj)
    if kind is _RawTensor:
        dtype = getattr(torch, obj.dtype)
        if not obj.data:
            return torch.empty(obj.shape, dtype=dtype)
        return torch.frombuffer(bytearray(obj.data), dtype=dtype).reshape(obj.shape)
    if kind is dict:
        return {k: _unpack(v) for k, v in obj.items()}
    if kind is list or kind is tuple:
        return kind(_unpack(v) for v in obj)
    return obj


def gather(tensor: torch.Tensor, dst: int = 0, group: Any = None) -> list[torch.Tensor] | None:
    """Rank ``dst`` receives the list of every rank's tensor; the others get ``None``."""
    if not active(group):
        return [tensor]
    check_in("gather", group)
    is_dst = dist.get_rank() == dst
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] if is_dst else None
    dist.gather(tensor.contiguous(), gather_list=out, dst=dst, group=group)
    return out


def scatter(tensor: torch.Tensor, chunks: list[torch.Tensor] | None, src: int = 0,
            group: Any = None) -> torch.Tensor:
    """Rank ``src`` passes one chunk per rank; every rank receives its chunk into ``tensor``."""
    if not active(group):
        if chunks:
            tensor.copy_(chunks[0])
        return tensor
    check_in("scatter", group)
    dist.scatter(tensor, scatter_list=chunks if dist.get_rank() == src else None, src=src, group=group)
    return tensor


def send(tensor: torch.Tensor, dst: int, group: Any = None) -> None:
    dist.send(tensor.contiguous(), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None) -> int:
    """Blocks until a tensor arrives; returns the sender's rank."""
    return dist.recv(tensor, src=src, group=group)


def isend(tensor: torch.Tensor, dst: int, group: Any = None) -> Any:
    """Non-blocking send: returns a request; call ``.wait()`` before changing ``tensor``."""
    return dist.isend(tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None) -> Any:
    """Non-blocking receive: returns a request; ``tensor`` holds the data only after ``.wait()``."""
    return dist.irecv(tensor, src=src, group=group)


def barrier(group: Any = None) -> None:
    if active(group):
        check_in("barrier", group)
        dist.barrier(group=group)


def any_rank(flag: bool, device: torch.device, group: Any = None) -> bool:
    """True on every rank if ``flag`` is true on any rank: how control-flow decisions are agreed."""
    if not active(group):
        return bool(flag)
    check_in("any_rank", group)
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
