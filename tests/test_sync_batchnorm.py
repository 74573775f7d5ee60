"""CrossProcessBatchNorm on 2 gloo ranks must match one process normalising the concatenated batch."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close

from polytrain.layers.sync_batchnorm import CrossProcessBatchNorm, convert_sync_batchnorm

pytestmark = pytest.mark.torch_api

C = 3
TOL = {"rtol": 0.0, "atol": 1e-9}  # float64 end to end, so far tighter than the 1e-5 we need

distributed = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _reference_bn(kind: type[nn.Module], momentum: float | None, seed: int = 0) -> nn.Module:
    bn = kind(C, momentum=momentum, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial affine params so their gradients matter
        bn.weight.copy_(torch.rand(C, generator=gen, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=gen, dtype=torch.float64))
    return bn


def _no_collectives(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("eval mode must not communicate")


def _parity_worker(
    rank: int,
    world_size: int,
    kind: type[nn.Module],
    sizes: list[int],
    spatial: tuple,
    momentum: float | None,
) -> None:
    dist.init_process_group("gloo")
    ref = _reference_bn(kind, momentum)
    bn = convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(bn, CrossProcessBatchNorm)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    gen = torch.Generator().manual_seed(1)  # same stream on every rank: all ranks see the same global batch
    for _ in range(3):
        x_all = torch.randn(sum(sizes), C, *spatial, generator=gen, dtype=torch.float64) * 2 + 3
        # Sum-based loss with random weights: global loss = sum of the rank losses, and the input
        # gradient is not trivially ~0 the way it is for y.sum().
        r_all = torch.randn(x_all.shape, generator=gen, dtype=torch.float64)
        x_ref = x_all.clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * r_all).sum().backward()

        x = x_all[lo:hi].clone().requires_grad_()
        y = bn(x)
        (y * r_all[lo:hi]).sum().backward()

        assert_close(y, y_ref[lo:hi].detach(), **TOL)
        assert_close(x.grad, x_ref.grad[lo:hi], **TOL)
        with torch.no_grad():
            for p, p_ref in ((bn.weight, ref.weight), (bn.bias, ref.bias)):
                dist.all_reduce(p.grad)  # local grads are each rank's share: their sum is the global grad
                assert_close(p.grad, p_ref.grad, **TOL)
                p.sub_(0.1 * p.grad)  # keep training in lockstep so later steps test more than step 1
                p_ref.sub_(0.1 * p_ref.grad)
                p.grad = p_ref.grad = None
    assert_close(bn.running_mean, ref.running_mean, **TOL)
    assert_close(bn.running_var, ref.running_var, **TOL)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 3


@pytest.mark.parametrize(
    ("kind", "sizes", "spatial", "momentum"),
    [
        (nn.BatchNorm1d, [3, 5], (), 0.1),
        (nn.BatchNorm2d, [3, 5], (4, 5), None),  # momentum=None: cumulative average
        (nn.BatchNorm3d, [1, 2], (2, 2, 3), 0.3),  # a local batch of one is fine when the global is not
    ],
    ids=["bn1d-uneven", "bn2d-uneven-cumulative", "bn3d-uneven"],
)
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_match_single_process_on_global_batch(kind, sizes, spatial, momentum) -> None:
    run_distributed(_parity_worker, 2, kind, sizes, spatial, momentum)


def _ddp_worker(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # same model and global batch on every rank
    ref = nn.Sequential(nn.Linear(4, C), nn.BatchNorm1d(C), nn.ReLU(), nn.Linear(C, 1)).double()
    x_all, target = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    model = nn.parallel.DistributedDataParallel(convert_sync_batchnorm(copy.deepcopy(ref)))
    # The documented contract: equal local batches + local mean loss + DDP's gradient averaging
    # == one process with the mean loss over the concatenated batch.
    lo, hi = 4 * rank, 4 * rank + 4
    nn.functional.mse_loss(model(x_all[lo:hi]), target[lo:hi]).backward()
    nn.functional.mse_loss(ref(x_all), target).backward()
    for p, p_ref in zip(model.module.parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, p_ref.grad, **TOL)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ddp_with_mean_loss_matches_single_process_mean_loss() -> None:
    run_distributed(_ddp_worker, 2)


def _eval_and_dtype_worker(rank: int, world_size: int) -> list[list[float]]:
    dist.init_process_group("gloo")
    torch.manual_seed(rank)
    bn = CrossProcessBatchNorm(C)
    for _ in range(2):
        bn(torch.randn(4 + rank, C, 6) + rank).sum().backward()

    # Half-precision inputs: normalised in float32 with the global batch's statistics, returned in the
    # input dtype. Reference: plain BatchNorm over the whole batch (both ranks' halves, which differ),
    # in float32 on the same rounded inputs, so only the final rounding separates the two (<= 2^-9
    # relative for bf16, 2^-12 for fp16; a per-rank normalisation is off by ~1e-1).
    gen = torch.Generator().manual_seed(7)  # same global batch on every rank
    x_all = torch.randn(9, C, 4, generator=gen) * 3 + 1
    r_all = torch.randn(x_all.shape, generator=gen)  # random loss weights: sum(y^2) has a ~0 input gradient
    lo, hi = (0, 4) if rank == 0 else (4, 9)
    for dtype, rtol in ((torch.bfloat16, 2**-8), (torch.float16, 2**-11)):
        x_ref = x_all.to(dtype).float().requires_grad_()
        y_ref = nn.BatchNorm1d(C, track_running_stats=False)(x_ref)
        (y_ref * r_all).sum().backward()
        x = x_all[lo:hi].to(dtype).requires_grad_()
        y = CrossProcessBatchNorm(C, track_running_stats=False)(x)
        (y.float() * r_all[lo:hi]).sum().backward()  # the global loss is the sum of the ranks' losses
        assert y.dtype == x.grad.dtype == dtype
        assert_close(y.float(), y_ref[lo:hi].detach(), rtol=rtol, atol=1e-5)
        # The incoming gradient is rounded to the half dtype too; errors scale with the largest entry.
        assert_close(x.grad.float(), x_ref.grad[lo:hi], rtol=0.0,
                     atol=4 * rtol * float(x_ref.grad.abs().max()))

    # Eval mode: running stats only. With all_reduce booby-trapped, any collective fails loudly.
    bn.eval()
    x = torch.randn(3, C, 6)
    all_reduce, dist.all_reduce = dist.all_reduce, _no_collectives
    try:
        y_eval = bn(x)
    finally:
        dist.all_reduce = all_reduce
    dist.destroy_process_group()
    assert_close(bn(x), y_eval, rtol=0.0, atol=0.0)  # and no process group is needed at all
    plain = nn.BatchNorm1d(C).eval()
    plain.load_state_dict(bn.state_dict())
    assert_close(y_eval, plain(x), rtol=0.0, atol=0.0)
    # Plain lists: a tensor sent through the result queue shares memory with a process about to exit.
    return [bn.running_mean.tolist(), bn.running_var.tolist()]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_eval_mode_makes_no_collective_and_half_inputs_keep_their_dtype() -> None:
    stats = run_distributed(_eval_and_dtype_worker, 2)
    # Training synchronised the statistics, so both ranks hold identical running stats.
    assert stats[0] == stats[1]


def _global_count_worker(rank: int, world_size: int, local_sizes: list[int]) -> str:
    dist.init_process_group("gloo")
    bn = CrossProcessBatchNorm(C)
    try:
        bn(torch.randn(local_sizes[rank], C))
    except ValueError as err:
        return str(err)
    return "ok"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_global_count_of_one_raises_on_every_rank() -> None:
    messages = run_distributed(_global_count_worker, 2, [1, 0])
    assert all("Expected more than 1 value per channel when training" in m for m in messages), messages


def test_converter_shares_state_and_converts_nested_modules() -> None:
    inner = nn.BatchNorm1d(C, eps=1e-3, momentum=None, affine=True)
    model = nn.Sequential(
        nn.Conv2d(1, C, 1),
        nn.BatchNorm2d(C, momentum=0.2),
        nn.Sequential(nn.Flatten(), nn.Linear(C, C), inner),
        nn.BatchNorm2d(C, affine=False, track_running_stats=False),
        nn.SyncBatchNorm(C),  # already synchronising: left alone
    )
    with torch.no_grad():
        inner.weight.uniform_()
        inner.bias.normal_()
        inner.running_mean.normal_()
        inner.running_var.uniform_(1, 2)
        inner.num_batches_tracked.fill_(7)
    inner.bias.requires_grad_(False)
    inner.eval()
    expected = copy.deepcopy(inner.state_dict())

    converted = convert_sync_batchnorm(model, process_group=None)
    assert converted is model  # only the leaves are replaced, as in torch's converter
    new_inner = converted[2][2]
    assert isinstance(converted[1], CrossProcessBatchNorm) and converted[1].momentum == 0.2
    assert isinstance(new_inner, CrossProcessBatchNorm)
    assert isinstance(converted[3], CrossProcessBatchNorm)
    assert not converted[3].affine and not converted[3].track_running_stats
    assert converted[3].running_mean is None and converted[3].weight is None
    assert type(converted[4]) is nn.SyncBatchNorm
    assert (new_inner.eps, new_inner.momentum, new_inner.training) == (1e-3, None, False)
    assert new_inner.weight is inner.weight and new_inner.running_var is inner.running_var
    assert new_inner.weight.requires_grad and not new_inner.bias.requires_grad
    for key, value in new_inner.state_dict().items():
        assert torch.equal(value, expected[key]), key

    single = _batchnorm2d_without_bias(C)
    converted_single = convert_sync_batchnorm(single)
    assert isinstance(converted_single, CrossProcessBatchNorm) and converted_single is not single
    assert converted_single.bias is None and converted_single.weight is single.weight


def _batchnorm2d_without_bias(channels: int) -> nn.BatchNorm2d:
    """``BatchNorm2d(C, bias=False)``; torch before 2.12 has no ``bias`` argument, so the layer is built
    affine and its bias removed the way the newer constructor does it (``register_parameter(None)``)."""
    if "bias" in inspect.signature(nn.BatchNorm2d.__init__).parameters:
        return nn.BatchNorm2d(channels, bias=False)
    layer = nn.BatchNorm2d(channels)
    layer.register_parameter("bias", None)
    return layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_converter_uses_torch_sync_batchnorm_on_cuda() -> None:
    model = nn.Sequential(nn.BatchNorm2d(C).cuda(), nn.BatchNorm1d(C))
    converted = convert_sync_batchnorm(model)
    assert type(converted[0]) is nn.SyncBatchNorm and type(converted[1]) is CrossProcessBatchNorm


def _train_steps(bn: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(steps):
        x = (torch.randn(4, C, 3, 5, generator=gen) * 2 + 1).requires_grad_()
        y = bn(x)
        (y * torch.randn(y.shape, generator=gen)).sum().backward()
        seen += [y.detach(), x.grad, bn.weight.grad.clone(), bn.bias.grad.clone()]
    bn.eval()
    seen.append(bn(torch.randn(2, C, 3, 5, generator=gen)))
    return seen + list(bn.state_dict().values())


@pytest.mark.parametrize("with_group", [False, True], ids=["no-process-group", "group-of-one"])
def test_world_size_one_is_exactly_plain_batchnorm(with_group: bool, tmp_path) -> None:
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised")
    if with_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for momentum in (0.1, None):
            ours = _train_steps(CrossProcessBatchNorm(C, momentum=momentum))
            plain = _train_steps(nn.BatchNorm2d(C, momentum=momentum))
            for a, b in zip(ours, plain, strict=True):
                assert torch.equal(a, b)
    finally:
        if with_group:
            dist.destroy_process_group()


def test_single_value_per_channel_raises_like_torch_without_group() -> None:
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        CrossProcessBatchNorm(C)(torch.randn(1, C))


def test_sync_batchnorm_on_a_model_without_batchnorm_says_so(tmp_path, caplog, monkeypatch) -> None:
    """Asked for, and nothing to convert: one line on rank 0 instead of silence."""
    import logging

    from torch.utils.data import DataLoader, TensorDataset

    from polytrain import Trainer, TrainModule

    class NoNorm(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    trainer = Trainer(accelerator="cpu", devices=1, strategy={"name": "ddp", "sync_batchnorm": True},
                      max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      run_dir=str(tmp_path))
    try:
        with caplog.at_level(logging.INFO, logger="polytrain"):
            trainer.fit(NoNorm())
    finally:
        trainer.strategy.teardown()
    assert [r.getMessage() for r in caplog.records if "sync_batchnorm" in r.getMessage()] == [
        "sync_batchnorm: NoNorm has no BatchNorm layer: nothing to synchronise across processes"]
