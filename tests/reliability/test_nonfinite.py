"""Requirement 5: a non-finite loss or gradient norm on ANY rank (injected on rank 1 only) is
agreed by all ranks before it can do harm.

Two real gloo ranks of DDP run five scenarios back to back (one spawn), each with a checkpoint
every optimizer step:

- ``nan_policy: error``, NaN loss on rank 1 at step 3: every rank stops with an error naming step
  3 and rank 1; the newest checkpoint is step 3's, its parameters finite (``error`` mode checks on
  logging steps, before every checkpoint and at the end: no per-step host sync).
- ``nan_policy: skip``, NaN loss on rank 1 at step 3: both ranks skip that step together, their
  parameters unchanged by it and equal to each other throughout.
- NaN *gradient* from a finite loss on rank 1, with clipping by norm (the norm is then known and
  fed to the guard): ``skip`` skips it on both ranks; ``error`` stops naming the step.
- The same NaN gradient without clipping under ``error``: only the loss is checked per step, so the
  damage is caught as non-finite parameters at the next check -- before the checkpoint that would
  hold them is written: the newest checkpoint is still finite.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from distributed import run_distributed

from .helpers import figure, quiet, rel_module

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]

SCENARIOS = {  # name: (fault, nan_policy, gradient_clip_val)
    "error_loss": ("nan_loss:1:3", "error", None),
    "skip_loss": ("nan_loss:1:3", "skip", None),
    "skip_grad_clipped": ("nan_grad:1:3", "skip", 1.0),
    "error_grad_clipped": ("nan_grad:1:3", "error", 1.0),
    "error_grad_unclipped": ("nan_grad:1:3", "error", None),
}


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from polytrain import Trainer
    from polytrain.callbacks.base import Callback
    from polytrain.callbacks.model_checkpoint import ModelCheckpoint
    from polytrain.checkpoint.layout import find_resumable
    from polytrain.checkpoint.reading import read_checkpoint
    from polytrain.trainer.loops.guards import NonFiniteError

    class Recorder(Callback):
        def __init__(self) -> None:
            self.history: list[tuple[int, int, torch.Tensor]] = []  # (batch, global_step, params after it)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.history.append((batch_idx, trainer.global_step, _flat(module)))

    out = {}
    for name, (fault, policy, clip) in SCENARIOS.items():
        os.environ["POLYTRAIN_REL_FAULT"] = fault
        run_dir = os.path.join(root, name)
        recorder = Recorder()
        module = rel_module().RelModule(n=32, batch_size=4, optimizer="sgd")
        trainer = Trainer(**quiet(run_dir, max_epochs=2, nan_policy=policy, gradient_clip_val=clip,
                                  log_every_n_steps=50),
                          callbacks=[recorder, ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)])
        error = None
        try:
            trainer.fit(module)
        except NonFiniteError as err:
            error = str(err)
        newest = find_resumable(os.path.join(run_dir, "version_0", "checkpoints"))
        payload = read_checkpoint(newest) if newest else {}
        out[name] = {
            "error": error, "skipped": trainer.guard.skipped_steps, "global_step": trainer.global_step,
            "history": recorder.history,
            "newest_step": int(payload["loop"]["global_step"]) if payload else None,
            "newest_finite": all(torch.isfinite(v).all() for v in payload.get("model", {}).values()),
            "final": _flat(module),
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("nonfinite")), timeout=400.0)


def _skip_figure(runs: list[dict[str, Any]], name: str) -> tuple[bool, str]:
    """Both ranks skipped exactly one step, with parameters unchanged by it and equal across ranks."""
    r0, r1 = runs[0][name], runs[1][name]
    skipped_batches = []
    ok = r0["skipped"] == r1["skipped"] == 1 and r0["error"] is None and r1["error"] is None
    for rank_run in (r0, r1):
        hist = rank_run["history"]
        for (_, s_prev, p_prev), (b, s, p) in zip(hist, hist[1:]):
            if s == s_prev:  # no step taken for batch b
                skipped_batches.append(b)
                ok &= torch.equal(p, p_prev)
    ok &= skipped_batches == [3, 3]  # the same batch on both ranks
    ok &= all(torch.equal(a[2], b[2]) for a, b in zip(r0["history"], r1["history"]))
    ok &= torch.isfinite(r0["final"]).all() and torch.equal(r0["final"], r1["final"])
    ok &= r0["global_step"] == r1["global_step"] == 7
    return bool(ok), (f"skipped together on batch(es) {skipped_batches}, "
                      "params unchanged and equal on both ranks")


@pytest.mark.timeout(600)
def test_nan_loss_on_rank1_errors_on_every_rank(runs: list[dict[str, Any]]) -> None:
    errors = [r["error_loss"]["error"] for r in runs]
    expected = "non-finite loss at step 3 on rank(s) [1]"
    ok = all(e is not None and expected in e for e in errors)
    newest = [(r["error_loss"]["newest_step"], r["error_loss"]["newest_finite"]) for r in runs]
    figure("NaN loss on rank 1, nan_policy=error",
           f"stopped on {sum(e is not None for e in errors)}/2 ranks naming "
           f"step 3 and rank 1; newest checkpoint (step, finite) = {newest[0]}")
    assert ok, errors
    assert newest == [(3, True), (3, True)]


@pytest.mark.timeout(600)
def test_nan_loss_on_rank1_is_skipped_on_every_rank(runs: list[dict[str, Any]]) -> None:
    ok, text = _skip_figure(runs, "skip_loss")
    figure("NaN loss on rank 1, nan_policy=skip", text)
    assert ok


@pytest.mark.timeout(600)
def test_nan_gradient_with_clipping_is_skipped_on_every_rank(runs: list[dict[str, Any]]) -> None:
    ok, text = _skip_figure(runs, "skip_grad_clipped")
    figure("NaN gradient (finite loss) on rank 1, clipping by norm, nan_policy=skip", text)
    assert ok


@pytest.mark.timeout(600)
def test_nan_gradient_with_clipping_errors_naming_the_step(runs: list[dict[str, Any]]) -> None:
    errors = [r["error_grad_clipped"]["error"] for r in runs]
    # Gradients are all-reduced before the norm is taken, so every rank sees the NaN norm.
    ok = all(e is not None and "non-finite gradient norm at step 3 on rank(s) [0, 1]" in e for e in errors)
    newest = [(r["error_grad_clipped"]["newest_step"], r["error_grad_clipped"]["newest_finite"])
              for r in runs]
    figure("NaN gradient (finite loss) on rank 1, clipping by norm, nan_policy=error",
           f"stopped on every rank naming step 3: {ok}; newest checkpoint (step, finite) = {newest[0]}")
    assert ok, errors
    assert newest == [(3, True), (3, True)]


@pytest.mark.timeout(600)
def test_nan_gradient_without_clipping_never_reaches_a_checkpoint(runs: list[dict[str, Any]]) -> None:
    errors = [r["error_grad_unclipped"]["error"] for r in runs]
    ok = all(e is not None and "non-finite parameters on rank(s) [0, 1] after step 4" in e for e in errors)
    newest = [(r["error_grad_unclipped"]["newest_step"], r["error_grad_unclipped"]["newest_finite"])
              for r in runs]
    figure("NaN gradient (finite loss) on rank 1, no clipping, nan_policy=error",
           f"caught as non-finite parameters before the step-4 checkpoint: {ok}; "
           f"newest checkpoint (step, finite) = {newest[0]}")
    assert ok, errors
    assert newest == [(3, True), (3, True)]
