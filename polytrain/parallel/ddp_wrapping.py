"""DistributedDataParallel's keyword arguments from polytrain's option names.

DDP replicates a plain module (no DTensor parameters): the data-parallel step of a layout with only
``dp_replicate`` (the ``ddp`` preset). It wraps the step's router, so the user's ``training_step``
runs as DDP's forward and DDP sees every gradient it must all-reduce.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

DEFAULTS: dict[str, Any] = {"find_unused_parameters": False, "static_graph": False, "bucket_cap_mb": 25.0,
                            "gradient_as_bucket_view": False, "broadcast_buffers": True}


def ddp_kwargs(options: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``DistributedDataParallel(module, **ddp_kwargs(...))`` for ``options`` (``DEFAULTS``' keys)."""
    o = {**DEFAULTS, **options}
    kwargs = dict(
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=o["find_unused_parameters"],
        static_graph=o["static_graph"],
        bucket_cap_mb=o["bucket_cap_mb"],
        gradient_as_bucket_view=o["gradient_as_bucket_view"],
    )
    # torch 2.14 renamed broadcast_buffers; older releases only know the old name.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = o["broadcast_buffers"]
    else:
        kwargs["broadcast_buffers"] = o["broadcast_buffers"]
    return kwargs


def prepare_manual_backward(ddp: DistributedDataParallel, loss: torch.Tensor) -> None:
    """Before each ``manual_backward`` of a step whose forward ran through DDP with gradient sync held
    back (several backward passes after one forward: a GAN's two losses)."""
    if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
        return  # inside no_backward_sync (accumulating): gradients stay local
    # With find_unused_parameters the reducer walks the graph from this loss to the parameters it
    # uses; the others are marked ready at once, so this backward's all-reduce completes.
    used = list(_find_tensors(loss)) if ddp.find_unused_parameters and not ddp.static_graph else []
    ddp.reducer.prepare_for_backward(used)


_UNUSED = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def naming_unused_parameters(step: Callable[..., Any], ddp: DistributedDataParallel) -> Callable[..., Any]:
    """``step`` (a training step through DDP), with DDP's error for parameters no loss used (raised in the
    next step's forward: "Expected to have finished reduction in the prior iteration ...", parameters by
    index) replaced by one naming them and the fix."""

    def step_naming_unused(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except RuntimeError as err:
            found = _UNUSED.search(str(err))
            if "Expected to have finished reduction in the prior iteration" not in str(err) or found is None:
                raise
            rank, indices = int(found.group(1)), found.group(2).split()
            raise RuntimeError(unused_parameters_message(ddp, rank, indices)) from err

    return step_naming_unused


def unused_parameters_message(ddp: DistributedDataParallel, rank: int, indices: list[str]) -> str:
    # DDP's parameter indices: named_parameters' order, trainable ones, those it was told to ignore left out.
    names = [name.removeprefix("module.") for name, p in ddp.module.named_parameters()
             if p.requires_grad and name not in ddp.parameters_to_ignore]
    unused = [names[int(i)] if int(i) < len(names) else f"#{i}" for i in indices]
    return (f"training_step's loss did not use every parameter: on rank {rank}, {', '.join(unused)} got no "
            f"gradient in the last step, so DDP could not finish reducing the gradients. If that is intended "
            f"(parameters used in some steps only, or not at all), use "
            f"strategy='ddp_find_unused_parameters_true' (in a config: strategy: {{name: ddp, "
            f"find_unused_parameters: true}}); if not, make the loss use them, or freeze them "
            f"(requires_grad=False)")


def sync_buffers_for_evaluation(ddp: DistributedDataParallel) -> None:
    """Before an evaluation pass, on every rank: what DDP's first forward of it would do. Evaluation runs
    the step beside DDP, not through it, yet DDP (as Lightning runs it) broadcasts rank 0's buffers (the
    BatchNorm running statistics) in the first forward after a training forward, or in its very first
    one, and no more until training forwards again. Doing it here, before the batches, keeps a rank with
    fewer evaluation batches (none, even) from leaving the others in that broadcast."""
    if ddp.will_sync_module_buffers():
        ddp._sync_buffers()
        ddp.require_forward_param_sync = False  # as DDP's forward under no_grad leaves it


@contextlib.contextmanager
def forward_without_reducer(ddp: DistributedDataParallel) -> Iterator[None]:
    """A manual-optimisation step through DDP. Its backward passes run inside ``training_step`` (a GAN's
    two losses), each after ``prepare_manual_backward`` readied the reducer; once the step returns,
    DDP's forward must not ready the reducer again for a backward that never comes. So the sync flag
    goes off from the router's return (its ``after_method``) until DDP's forward is done."""
    router, sync = ddp.module, ddp.require_backward_grad_sync

    def stop_sync() -> None:
        ddp.require_backward_grad_sync = False

    router.__dict__["after_method"] = stop_sync
    try:
        yield
    finally:
        router.__dict__["after_method"] = None
        ddp.require_backward_grad_sync = sync
