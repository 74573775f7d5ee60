"""``strategy: {name: parallel, plan: true}`` and ``"auto"`` degrees: the planner picks the layout when a
stage starts (polytrain/trainer/launch/planned.py), every rank agrees, the checkpoint's config holds the
layout and a resume at the same world size reuses it (docs/strategies/planner.md)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from polytrain import Trainer
from polytrain.core.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "gpt"))

from distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.torch_api

SIZE = dict(d_model=32, n_head=2, n_layer=2, block_size=16, stride=16, batch_size=4)


def _module() -> Any:
    import torch
    from gpt_module import CharGPT

    torch.manual_seed(0)
    return CharGPT(**SIZE)


def _trainer(root: str, strategy: Any, steps: int) -> Trainer:
    return Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), strategy=strategy,
                   max_steps=steps, seed=0, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                   limit_val_batches=0, run_dir=root, timeout=60.0)


def _fit(rank: int, world: int, root: str, strategy: Any, steps: int, ckpt: str | None, save: str | None,
         forbid_planning: bool) -> dict:
    """Every rank: fit (resuming from ``ckpt``), stdout captured; what was chosen and built."""
    import torch

    from polytrain.trainer.launch import planned

    if forbid_planning:  # a resume must reuse the stored layout, not plan again
        planned._plan = lambda *a, **k: (_ for _ in ()).throw(AssertionError("planned again"))
    out = io.StringIO()
    trainer = _trainer(root, strategy, steps)
    with contextlib.redirect_stdout(out):
        trainer.fit(_module(), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    dims = trainer.strategy.dims
    stored = None
    if save is not None and trainer.is_global_zero:
        stored = torch.load(save, weights_only=True)["config"]["trainer"]["strategy"]["chosen"]
    return {"chosen": trainer.config.strategy["chosen"], "printed": out.getvalue(),
            "steps": trainer.global_step,
            "dims": {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp")},
            "stored": stored, "loss": float(trainer.callback_metrics["train/loss"])}


def _degrees(chosen: dict) -> dict:
    return {k: chosen[k] for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp")}


def test_plan_true_chooses_trains_stores_and_resumes(tmp_path: Any) -> None:
    root, ckpt = str(tmp_path / "run"), str(tmp_path / "planned.ckpt")
    spec = {"name": "parallel", "plan": True}
    first = run_distributed(_fit, 2, root, spec, 2, None, ckpt, False, timeout=120.0)
    chosen = first[0]["chosen"]
    assert all(r["chosen"] == chosen for r in first)  # every rank agrees
    assert all(r["dims"] == _degrees(chosen) for r in first)  # and built the strategy with it
    assert chosen["world_size"] == 2 and first[0]["steps"] == 2
    assert "polytrain plan: dp_replicate=" in first[0]["printed"] and "predicted step" in first[0]["printed"]
    assert "polytrain plan" not in first[1]["printed"]  # printed on global rank 0 only
    assert first[0]["stored"] == chosen  # the checkpoint's config holds the layout

    resumed = run_distributed(_fit, 2, root, spec, 4, ckpt, None, True, timeout=120.0)
    assert all(r["chosen"] == chosen and r["steps"] == 4 for r in resumed)
    assert "reusing the plan stored in" in resumed[0]["printed"] and resumed[1]["printed"] == ""


def _planned(trainer: Trainer, launch: Any, module: Any) -> bool:
    """``plan_layout`` as ``Trainer.fit`` calls it for ``module`` (a fresh fit, no checkpoint)."""
    from polytrain.trainer.launch.planned import plan_layout

    train = module.train_dataloader()
    return plan_layout(trainer.run_sources(), None, launch, module, train, None, "fit", None)


def _plan_for(strategy: dict, world: int) -> dict:
    """Plan as rank 0 of ``world`` CPU ranks would, without starting them (planning needs no process
    group)."""
    trainer = Trainer(accelerator="cpu", strategy=strategy, logger=False)
    launch = SimpleNamespace(world_size=world, num_nodes=1, accelerator="cpu",
                             env=SimpleNamespace(global_rank=1))
    module = _module()
    assert _planned(trainer, launch, module)
    return trainer.config.strategy


def test_pinned_degrees_are_kept_and_auto_ones_planned() -> None:
    free = _plan_for({"name": "parallel", "plan": True}, 4)["chosen"]
    pin_tp = 1 if free["tp"] > 1 else 2  # pin what the planner would not choose
    spec = _plan_for({"name": "parallel", "tp": pin_tp, "dp_shard": "auto"}, 4)
    assert spec["tp"] == pin_tp and spec["pp"] == 1 and spec["dp_replicate"] == 1  # given or default: kept
    assert spec["chosen"]["tp"] == pin_tp and spec["chosen"]["dp_shard"] == 4 // pin_tp
    again = Trainer(accelerator="cpu", strategy=spec, logger=False).config.strategy  # the stored form
    # re-validates
    assert again == spec


def test_the_planned_checkpointing_mode_is_the_one_that_runs(run_dir: str) -> None:
    """The config's ``activation_checkpointing`` mode pins the planner's (``op`` stays per-op), and a layout
    whose ``chosen`` says ``op`` builds per-op checkpointed blocks."""
    trainer = Trainer(accelerator="cpu", strategy={"name": "parallel", "plan": True}, logger=False,
                      activation_checkpointing={"mode": "op"})
    launch = SimpleNamespace(world_size=2, num_nodes=1, accelerator="cpu", env=SimpleNamespace(global_rank=1))
    module = _module()
    assert _planned(trainer, launch, module)
    assert trainer.config.strategy["chosen"]["activation_checkpointing"] == "op"
    planned = {}
    for every in (1, 2):  # every: n is costed as the strategy will run it: fewer blocks checkpointed
        trainer = Trainer(accelerator="cpu", strategy={"name": "parallel", "plan": True, "dp_replicate": 2},
                          logger=False, activation_checkpointing={"every": every})
        assert _planned(trainer, launch, module)
        planned[every] = trainer.config.strategy["chosen"]
    assert planned[1]["activation_checkpointing"] is True and planned[2]["activation_checkpointing"] is True
    assert planned[2]["memory_bytes"] > planned[1]["memory_bytes"]

    # In a process of its own: the fit's process group outlives it (the next Trainer of a job reuses it)
    assert run_distributed(_fit_chosen_op, 1, run_dir, timeout=120.0) == [[None, "op", "op", None, None]]


def _fit_chosen_op(rank: int, world: int, run_dir: str) -> list[str | None]:
    """The checkpointing mode of each child after a fit whose stored plan (``chosen``) says ``op``."""
    from polytrain.parallel.activation_checkpointing import checkpointing_mode

    chosen = {"world_size": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1,
              "n_microbatches": 1, "activation_checkpointing": "op"}
    trainer = _trainer(run_dir, {"name": "parallel", "plan": True, "chosen": chosen}, 1)
    module = _module()
    trainer.fit(module)
    return [checkpointing_mode(m) for m in module.net]  # the two blocks: op


def test_bad_values_name_what_is_valid() -> None:
    with pytest.raises(ConfigError, match=r"tp='autox' is not valid: a degree is an integer \(pinned\) "
                                          r"or 'auto'"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "tp": "autox"})
    with pytest.raises(ConfigError, match="plan='yes' is not valid: true"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "plan": "yes"})
    with pytest.raises(ConfigError, match="no option 'tpp'; valid: dp_replicate.*for the planner: plan, "
                                          "global_batch"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "plan": True, "tpp": 2})
    with pytest.raises(ConfigError, match="hardware='tpu' is not valid; choose one of: a100, cpu, h100"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "plan": True, "hardware": "tpu"})
    assert Trainer(accelerator="cpu").config.strategy == {"name": "auto"}  # strategy: auto is not the planner


def test_plan_true_profiles_the_attention_kernel_torch_runs(monkeypatch: Any) -> None:
    """On CPU (fp32 included) and on CUDA (bf16) torch runs SDPA's flash kernel, on CPU the math kernel under
    dropout: ``plan: true`` on CPU profiles with the ``cpu`` kernel (flash, math under dropout), not the math
    kernel's ``s x s`` matrix throughout (15-30 % more activations, planner.md)."""
    from polytrain.trainer.launch import planned

    kernels: list[str] = []
    real = planned.profiler

    def spy(*args: Any, **kwargs: Any) -> Any:
        kernels.append(args[3] if len(args) > 3 else kwargs.get("attention", "flash"))
        return real(*args, **kwargs)

    monkeypatch.setattr(planned, "profiler", spy)
    _plan_for({"name": "parallel", "plan": True}, 2)
    assert kernels == ["cpu"]
