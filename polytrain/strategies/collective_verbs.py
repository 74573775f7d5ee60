"""The collective verbs every strategy answers (``reduce``, ``all_gather``, ``broadcast``, ``barrier``,
...), over the strategy's process group: a mixin of ``Strategy`` so ``base.py`` stays about the step."""

from __future__ import annotations

from typing import Any

import torch

from polytrain.core import collectives as C


class CollectiveVerbs:
    """Used by ``Strategy``; ``self`` is the strategy (``root_device`` is where its collectives run)."""

    root_device: torch.device

    def reduce(self, tensor: torch.Tensor, op: str = "mean", dst: int | None = None,
               group: Any = None) -> torch.Tensor:
        """``dst=None``: every rank gets the reduced value (a copy). ``dst=r``: ``dist.reduce`` to rank r."""
        tensor = tensor.detach().clone()
        if dst is None:
            return C.all_reduce(tensor, op, group)
        return C.reduce(tensor, dst, op, group)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
        return C.all_reduce(tensor, op, group)

    def all_gather(self, tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
        return C.all_gather(tensor, group)

    def all_gather_object(self, obj: Any, group: Any = None) -> list[Any]:
        return C.all_gather_object(obj, group)

    def broadcast(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        if isinstance(obj, torch.Tensor):
            return C.broadcast(obj, src, group)
        return C.broadcast_object(obj, src, group)

    def gather(self, tensor: torch.Tensor, dst: int = 0, group: Any = None) -> list[torch.Tensor] | None:
        return C.gather(tensor, dst, group)

    def scatter(self, tensor: torch.Tensor, chunks: list[torch.Tensor] | None, src: int = 0,
                group: Any = None) -> torch.Tensor:
        return C.scatter(tensor, chunks, src, group)

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None) -> None:
        C.send(tensor, dst, group)

    def recv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None) -> int:
        return C.recv(tensor, src, group)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None) -> Any:
        """Non-blocking ``send``; returns a request to ``wait()`` on."""
        return C.isend(tensor, dst, group)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None) -> Any:
        """Non-blocking ``recv``; ``tensor`` is filled once the returned request's ``wait()`` returns."""
        return C.irecv(tensor, src, group)

    def barrier(self, name: str | None = None) -> None:
        C.barrier()

    def reduce_boolean_decision(self, decision: bool) -> bool:
        """True on every rank if any rank decided so."""
        return C.any_rank(decision, self.collective_device)

    @property
    def collective_device(self) -> torch.device:
        return self.root_device
