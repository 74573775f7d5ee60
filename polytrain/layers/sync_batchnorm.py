"""Cross-process batch norm that also works on CPU/gloo.

``torch.nn.SyncBatchNorm`` refuses CPU tensors, so CPU runs of DDP would otherwise normalise every
rank's batch on its own. ``CrossProcessBatchNorm`` normalises with the statistics of the global batch
(the concatenation of every rank's local batch) using one all-reduce in forward and one in backward.

Gradient convention: input gradients equal the single-process gradient of ``sum over ranks of each
rank's loss`` on the global batch, while weight/bias gradients stay local (each rank's share of that
sum), exactly like ``SyncBatchNorm``. DDP then *averages* parameter gradients over ranks, so training
equals single-process training on the concatenated batch when each rank's loss is a mean over its local
batch and all local batches have the same size (the global mean loss is then the average of the local
mean losses).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["CrossProcessBatchNorm", "convert_sync_batchnorm"]

# Per-channel sums travel and are combined in float64: the variance comes from E[x^2] - E[x]^2, which
# cancels catastrophically in float32 when |mean| >> std (torch's CPU kernel accumulates in double too).
_STATS_DTYPE = torch.float64


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 lose too much precision in the normalisation itself; float64 stays float64.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class _GlobalBatchNormFn(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with mean/invstd of the global batch.

    ``mean``/``invstd`` come in detached; backward accounts for their dependence on x by all-reducing
    the per-channel sums of grad_output and grad_output * x_hat.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        mean: Tensor,
        invstd: Tensor,
        count: float,
        group: Any,
    ) -> Tensor:
        cdt = _compute_dtype(x.dtype)
        shape = [1, -1] + [1] * (x.dim() - 2)
        x_hat = (x.to(cdt) - mean.to(cdt).view(shape)) * invstd.to(cdt).view(shape)
        y = x_hat if weight is None else x_hat * weight.to(cdt).view(shape)
        if bias is not None:
            y = y + bias.to(cdt).view(shape)
        # Keep x rather than x_hat: for half inputs that halves the memory held until backward.
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.group = max(count, 1.0), group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        cdt = _compute_dtype(x.dtype)
        shape = [1, -1] + [1] * (x.dim() - 2)
        dims = [0] + list(range(2, x.dim()))
        g = grad_out.to(cdt)
        x_hat = (x.to(cdt) - mean.to(cdt).view(shape)) * invstd.to(cdt).view(shape)
        sum_g = g.sum(dims, dtype=_STATS_DTYPE)
        sum_gx = (g * x_hat).sum(dims, dtype=_STATS_DTYPE)

        grad_x = grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_gx.to(weight.dtype)  # local share; DDP reduces it across ranks
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = sum_g.to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            # The only collective of backward: global sums, so x's gradient matches the global batch.
            packed = torch.cat([sum_g, sum_gx])
            dist.all_reduce(packed, group=ctx.group)
            mean_g, mean_gx = (packed / ctx.count).to(cdt).view(2, *shape)
            scale = invstd.to(cdt) if weight is None else invstd.to(cdt) * weight.to(cdt)
            grad_x = ((g - mean_g - x_hat * mean_gx) * scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class CrossProcessBatchNorm(_BatchNorm):
    """Batch norm over (N, C, *) inputs whose training statistics span every rank of ``process_group``.

    Same constructor and state as ``nn.SyncBatchNorm``, but it works on any device/backend that
    ``all_reduce`` supports (notably CPU + gloo). Without an initialised process group, or with a group of
    one, it is plain batch norm. Eval mode never communicates: it uses the running stats (or, like
    ``SyncBatchNorm``, the local batch when running stats are not tracked).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training or _group_size(self.process_group) <= 1:
            # Eval mode or nothing to sync with: exactly torch's batch norm, no collective.
            return super().forward(input)

        # Same bookkeeping as _BatchNorm.forward, so running stats evolve identically.
        factor = 0.0 if self.momentum is None else self.momentum
        update = self.track_running_stats and self.running_mean is not None
        if update and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)

        with torch.no_grad():
            mean, var, count = self._global_stats(input)
            invstd = torch.rsqrt(var + self.eps)
            if update and count > 0:  # torch leaves the running stats alone on an empty batch
                unbiased = var * (count / (count - 1))
                # Same formula as torch's kernel: (1 - momentum) * running + momentum * batch.
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

        return _GlobalBatchNormFn.apply(
            input, self.weight, self.bias, mean, invstd, count, self.process_group
        )

    def _global_stats(self, input: Tensor) -> tuple[Tensor, Tensor, float]:
        """Biased mean/var per channel of the global batch and its per-channel count (one all-reduce)."""
        dims = [0] + list(range(2, input.dim()))
        x = input.to(_compute_dtype(input.dtype))
        local_count = input.numel() // max(input.size(1), 1)
        packed = torch.cat(
            [
                x.sum(dims, dtype=_STATS_DTYPE),
                (x * x).sum(dims, dtype=_STATS_DTYPE),
                torch.tensor([float(local_count)], dtype=_STATS_DTYPE, device=input.device),
            ]
        )
        dist.all_reduce(packed, group=self.process_group)
        channels = input.size(1)
        count = float(packed[-1].item())
        if count == 1:
            # Every rank sees the same global count, so every rank raises: no rank is left waiting.
            raise ValueError(
                "Expected more than 1 value per channel when training, got input size "
                f"{list(input.size())} locally and 1 value per channel over the process group"
            )
        total = max(count, 1.0)  # an all-empty global batch: zeros instead of NaN, nothing to normalise
        mean = packed[:channels] / total
        var = (packed[channels : 2 * channels] / total - mean * mean).clamp_(min=0.0)
        return mean, var, count


def _lives_on_cuda(module: nn.Module) -> bool:
    tensors = chain(module.parameters(recurse=False), module.buffers(recurse=False))
    return any(t.is_cuda for t in tensors)


def convert_sync_batchnorm(module: nn.Module, process_group: Any | None = None) -> nn.Module:
    """Replace every ``BatchNorm*d`` in ``module`` with a cross-process batch norm; return the result.

    CUDA batch norms become ``nn.SyncBatchNorm`` (torch's converter semantics, NCCL-optimised kernels);
    everything else becomes ``CrossProcessBatchNorm``, because ``nn.SyncBatchNorm`` raises on CPU
    tensors. Parameters and buffers are shared, not cloned, as in torch's converter, so optimisers and
    references built before the conversion keep working; requires_grad therefore carries over as is.
    Layers that already synchronise are left alone. Like torch's converter, a top-level batch norm is
    replaced by a new module, which is returned.
    """
    output = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, CrossProcessBatchNorm)):
        cls = nn.SyncBatchNorm if _lives_on_cuda(module) else CrossProcessBatchNorm
        output = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():
                output.weight = module.weight
                output.bias = module.bias  # may be None (bias=False): the new layer drops it too
        output.running_mean = module.running_mean
        output.running_var = module.running_var
        output.num_batches_tracked = module.num_batches_tracked
        output.training = module.training
        if hasattr(module, "qconfig"):
            output.qconfig = module.qconfig
    for name, child in module.named_children():
        output.add_module(name, convert_sync_batchnorm(child, process_group))
    return output
