"""Precision plugins on CPU: 16-mixed (autocast fp16 + GradScaler), bf16-mixed, bf16-true, and
16-mixed under DDP. The hooks observe what the strategy hands them at each point of the step."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.torch_api


def _dataset(n: int = 128) -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x[:, :2].sum(1, keepdim=True) - x[:, 3:4]).tanh())


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]


def _norm(grads: list[torch.Tensor]) -> float:
    return float(torch.cat([g.float().flatten() for g in grads]).norm())


class Probe(TrainModule):
    """Records dtypes, losses, gradients before/after the optimizer-step preparation, and the scale."""

    def __init__(self, batch_size: int = 16, inf_grad_at_step: int | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.inf_grad_at_step = inf_grad_at_step
        self.losses: list[float] = []
        self.out_dtypes: set[torch.dtype] = set()
        self.input_dtypes: set[torch.dtype] = set()
        self.param_dtypes: set[torch.dtype] = set()
        self.after_backward: list[tuple[list[torch.Tensor], float]] = []  # (grads, loss scale)
        self.before_step: list[list[torch.Tensor]] = []
        self.after_clip: list[list[torch.Tensor]] = []
        self.around_step: list[dict[str, Any]] = []

    def configure_model(self) -> None:
        if hasattr(self, "net"):  # idempotent: called again by validate/test
            return
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def _scaler(self) -> Any:
        return self.trainer.strategy.precision.scaler

    def _scale(self) -> float:
        scaler = self._scaler()
        return float(scaler.get_scale()) if scaler is not None else 1.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.input_dtypes.add(x.dtype)
        self.out_dtypes.add(out.dtype)
        self.param_dtypes |= {p.dtype for p in self.parameters()}
        loss = F.mse_loss(out.float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def on_after_backward(self) -> None:
        if self.global_step == self.inf_grad_at_step:
            with torch.no_grad():
                self.net[0].weight.grad[0, 0] = math.inf  # loss stays finite: only the scaler sees it
        self.after_backward.append((_grads(self), self._scale()))
        self.around_step.append({"params": [p.detach().clone() for p in self.parameters()],
                                 "scale": self._scale()})

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.before_step.append(_grads(self))  # unscaled, not yet clipped (Lightning's order)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.after_clip.append(_grads(self))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.around_step[-1].update(params_after=[p.detach().clone() for p in self.parameters()],
                                    scale_after=self._scale())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Adam: a skipped step must leave parameters unchanged, which zeroed gradients would not.
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=self.batch_size, shuffle=True)


def _fit(tmp_path: Any, precision: str, steps: int = 30, module: Probe | None = None, **kwargs: Any) -> Probe:
    module = module or Probe()
    trainer = Trainer(accelerator="cpu", strategy="single", devices=1, precision=precision, max_steps=steps,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      run_dir=str(tmp_path), **kwargs)
    trainer.fit(module)
    assert trainer.global_step == steps
    return module


def _assert_trains(module: Probe) -> None:
    assert all(math.isfinite(v) for v in module.losses)
    first, last = module.losses[:5], module.losses[-5:]
    assert sum(last) / 5 < 0.7 * sum(first) / 5, module.losses


@pytest.mark.timeout(60)
def test_16_mixed_trains_and_hooks_see_unscaled_gradients(tmp_path: Any) -> None:
    # Clip threshold far above the true gradient norm but far below the scaled one: had the
    # scaler not unscaled before clipping, the hook would see scaled gradients clipped to 1000.
    module = _fit(tmp_path, "16-mixed", gradient_clip_val=1000.0)
    assert module.out_dtypes == {torch.float16}  # autocast was active inside training_step
    assert module.param_dtypes == {torch.float32}  # mixed: master weights stay fp32
    _assert_trains(module)
    assert len(module.before_step) == 30
    for (scaled, scale), seen in zip(module.after_backward, module.before_step):
        assert scale > 1.0
        assert _norm(scaled) > 1000.0
        assert _norm(seen) < 1000.0
        for g_scaled, g_seen in zip(scaled, seen):
            assert_close(g_seen, g_scaled / scale, rtol=1e-6, atol=0.0)


@pytest.mark.timeout(60)
def test_16_mixed_clips_the_unscaled_gradients(tmp_path: Any) -> None:
    clip = 0.01
    module = _fit(tmp_path, "16-mixed", steps=10, gradient_clip_val=clip)
    assert len(module.after_clip) == 10
    for (scaled, scale), seen in zip(module.after_backward, module.after_clip):
        assert _norm(scaled) / scale > clip  # the true gradient was over the threshold...
        assert _norm(seen) == pytest.approx(clip, rel=1e-4)  # ...and the hook sees it clipped to it
        # Clipping rescales the true gradient: same direction as scaled / scale.
        factor = clip / (_norm(scaled) / scale)
        for g_scaled, g_seen in zip(scaled, seen):
            assert_close(g_seen, g_scaled / scale * factor, rtol=1e-4, atol=1e-9)


@pytest.mark.timeout(60)
def test_16_mixed_skips_step_with_inf_gradients_and_lowers_scale(tmp_path: Any) -> None:
    module = _fit(tmp_path, "16-mixed", steps=6, module=Probe(inf_grad_at_step=3))
    records = module.around_step
    assert len(records) == 6
    for step, rec in enumerate(records):
        unchanged = all(torch.equal(a, b) for a, b in zip(rec["params"], rec["params_after"]))
        if step == 3:
            assert unchanged, "the optimizer step with inf gradients was not skipped"
            assert rec["scale_after"] == rec["scale"] * 0.5
        else:
            assert not unchanged, f"step {step} should have updated the parameters"
            assert rec["scale_after"] == rec["scale"]
    assert all(math.isfinite(v) for v in module.losses)
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.timeout(60)
def test_bf16_mixed_runs_under_autocast(tmp_path: Any) -> None:
    module = _fit(tmp_path, "bf16-mixed")
    assert module.out_dtypes == {torch.bfloat16}
    assert module.param_dtypes == {torch.float32}
    assert module.trainer.strategy.precision.scaler is None  # bf16 needs no loss scaling
    _assert_trains(module)


@pytest.mark.timeout(60)
def test_bf16_true_holds_bf16_parameters(tmp_path: Any) -> None:
    module = _fit(tmp_path, "bf16-true", steps=10)
    assert module.param_dtypes == {torch.bfloat16}
    assert module.input_dtypes == {torch.bfloat16}  # float inputs are cast to match the weights
    assert module.out_dtypes == {torch.bfloat16}
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert all(math.isfinite(v) for v in module.losses)
    first = module.around_step[0]["params"]
    assert not all(torch.equal(a, b) for a, b in zip(first, module.parameters()))  # it trained


# --------------------------------------------------------------------------- DDP


def _ddp_worker(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    module = Probe(batch_size=8)
    trainer = Trainer(accelerator="cpu", strategy="ddp", devices=world_size, precision="16-mixed",
                      max_steps=30, gradient_clip_val=1.0, enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, run_dir=run_dir)
    trainer.fit(module)
    steps = [{"grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
              "updated": not all(torch.equal(a, b) for a, b in zip(rec["params"], rec["params_after"])),
              "scale": rec["scale"], "scale_after": rec["scale_after"]}
             for grads, rec in zip(module.before_step, module.around_step)]
    return {"losses": module.losses, "out_dtypes": module.out_dtypes, "steps": steps,
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "scale": trainer.strategy.precision.scaler.get_scale()}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ddp_16_mixed_stays_finite(tmp_path: Any) -> None:
    ranks = run_distributed(_ddp_worker, 2, str(tmp_path), timeout=100.0)
    for out in ranks:
        assert out["out_dtypes"] == {torch.float16}
        assert len(out["steps"]) == 30
        # GradScaler starts at 2**16 and may overflow fp16 on the first step(s): such a step must be
        # skipped (weights untouched, scale halved) and be rare; every other step is finite and applied.
        overflowed = [s for s in out["steps"] if not s["grads_finite"]]
        assert len(overflowed) <= 2
        for step in out["steps"]:
            if step["grads_finite"]:
                assert step["updated"] and step["scale_after"] == step["scale"]
            else:
                assert not step["updated"] and step["scale_after"] == step["scale"] * 0.5
        assert all(math.isfinite(v) for v in out["losses"])
        assert sum(out["losses"][-5:]) < 0.7 * sum(out["losses"][:5])
        assert all(torch.isfinite(v).all() for v in out["state"].values() if v.is_floating_point())
    # Replicas stay identical (the scaler decided the same on both ranks) and keep the same scale.
    assert ranks[0]["scale"] == ranks[1]["scale"]
    for key, value in ranks[0]["state"].items():
        assert torch.equal(ranks[1]["state"][key], value), key
