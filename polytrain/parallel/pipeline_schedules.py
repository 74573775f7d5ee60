"""The ``torch.distributed.pipelining`` side of pipeline parallelism: schedules by name, the stage
class polytrain runs (with the fixes it needs across torch releases), and the plain point-to-point
transfer evaluation uses (one whole batch through the stages, no schedule).

``torch.distributed.pipelining`` costs a second to import: it loads through ``polytrain.core.lazy``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from polytrain.core import lazy
from polytrain.parallel.choices import SCHEDULES

# The pipeline strategy refuses a module whose training_step drives its optimizers; the planner does not
# rank a pipeline for one, in the same words.
MANUAL_OPTIMISATION_REFUSED = ("manual optimisation (training_step driving the optimizers) is not supported "
                               "under pipeline parallelism: the schedule owns forward and backward; use "
                               "automatic optimisation")


def schedule_class(name: str) -> type | None:
    """The torch class for ``name``, or None where this torch build lacks it."""
    return getattr(lazy.pipelining().schedules, SCHEDULES[name][0], None)


def stage_owners(pp: int, n_stages: int, schedule: str) -> dict[int, int]:
    """Stage index -> the pp rank that runs it (a loop, or zbv's V)."""
    return lazy.pipelining()._utils.generate_stage_to_rank_mapping(pp, n_stages, SCHEDULES[schedule][2])


_STAGE_CLASS: Any = None


def stage_class() -> type:
    """``PipelineStage`` with two adjustments, each dead where torch does not need it.

    - torch < 2.12 sends one dummy tensor between neighbouring stages before the first step
      (``_get_init_p2p_neighbors_ops``). When two neighbouring stages live on one rank (zbv puts
      stages 1 and 2 on rank 1 of 2) that is a send to itself, which gloo cannot do ("Pair is not
      connected"). A rank needs no channel to itself: those ops are dropped, both directions.
    - torch infers the shapes sent between stages with a probe: the stage's module runs once on
      placeholders (``_shape_inference`` before 2.14, ``_forward_metadata_inference`` after), and from
      2.15 the loss function too (``_backward_metadata_inference``). ``probing`` is True meanwhile (on
      the stage, and on its module where it has the attribute), so a loss function or a stage that runs
      user code can answer without running it; and the probe leaves no trace: the random generators and
      the stage's buffers (BatchNorm's running statistics) are as they were before it.
    """
    global _STAGE_CLASS
    if _STAGE_CLASS is None:
        base = lazy.pipelining().PipelineStage

        class _Stage(base):
            probing = False

            def _get_init_p2p_neighbors_ops(self) -> list[Any]:
                ops = super()._get_init_p2p_neighbors_ops()
                return [op for op in ops if getattr(op, "group_peer", None) != self.group_rank]

            def _probe(self, method: Any, *args: Any, **kwargs: Any) -> Any:
                submod = self.submod
                buffers = [(b, b.detach().clone()) for b in submod.buffers()]
                cpu_rng = torch.get_rng_state()
                cuda = self.device.type == "cuda"
                device_rng = torch.cuda.get_rng_state(self.device) if cuda else None
                self.probing = True
                if hasattr(submod, "probing"):
                    submod.probing = True
                try:
                    return method(*args, **kwargs)
                finally:
                    self.probing = False
                    if hasattr(submod, "probing"):
                        submod.probing = False
                    with torch.no_grad():
                        for buffer, saved in buffers:
                            buffer.copy_(saved)
                    torch.set_rng_state(cpu_rng)
                    if cuda:
                        torch.cuda.set_rng_state(device_rng, self.device)

        for name in ("_shape_inference", "_forward_metadata_inference", "_backward_metadata_inference"):
            if hasattr(base, name):
                setattr(_Stage, name, _probing(name))
        _STAGE_CLASS = _Stage
    return _STAGE_CLASS


def _probing(name: str) -> Any:
    def probe(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._probe(getattr(super(type(self), self), name), *args, **kwargs)

    probe.__name__ = name
    return probe


# --------------------------------------------------------------------------- evaluation transfers

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_HEADER = 10  # dtype, ndim, up to 8 sizes


def send_tensor(x: torch.Tensor, dst: int, group: Any, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim > _HEADER - 2:
        raise TypeError(f"pipeline stages must pass one tensor of at most {_HEADER - 2} dims to the next "
                        f"stage; got {type(x).__name__}"
                        f"{'' if not isinstance(x, torch.Tensor) else f' of {x.ndim} dims'}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(x.dtype), x.ndim
    header[2:2 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    dist.send(header.to(device), dst=dst, group=group)
    dist.send(x.contiguous(), dst=dst, group=group)


def recv_tensor(src: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    x = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, src=src, group=group)
    return x
