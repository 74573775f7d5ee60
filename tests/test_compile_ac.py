"""``trainer.compile`` and ``trainer.activation_checkpointing`` (polytrain.parallel.compile /
.activation_checkpointing) under every strategy.

Parity: compiled vs eager within 1e-5 (fp32, SGD: Adam would turn summation-order noise in
near-zero gradients into steps of up to lr), checkpointed vs not within 1e-6 (measured: equal).
Inductor compiles are slow on a 2-core machine: the inductor runs use one tiny model shape so the
on-disk FX graph cache serves them after the first run; tensor parallel and pipeline compile with
``aot_eager`` (dynamo and AOTAutograd trace the same graph; only the code generation is skipped).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import sys
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn

from polytrain import Trainer
from polytrain.core.errors import ConfigError
from polytrain.parallel.activation_checkpointing import apply_activation_checkpointing, resolve_checkpointing
from polytrain.parallel.compile import apply_compile, compile_targets, resolve_compile

GPT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt")
if GPT_DIR not in sys.path:
    sys.path.insert(0, GPT_DIR)

from gpt_module import Block, CharGPT  # noqa: E402 - after the sys.path insertion

pytestmark = pytest.mark.torch_api

COMPILE_TOL = {"rtol": 0.0, "atol": 1e-5}
AC_TOL = {"rtol": 0.0, "atol": 1e-6}


class DropBlock(Block):
    """The example's transformer block with dropout on both residual branches."""

    def __init__(self, d_model: int, n_head: int, p: float) -> None:
        super().__init__(d_model, n_head)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class SmallGPT(CharGPT):
    """CharGPT (2 blocks, d=32) with dropout in the blocks and SGD."""

    def __init__(self, dropout: float = 0.0, lr: float = 0.1, d_model: int = 32, batch_size: int = 8) -> None:
        super().__init__(d_model=d_model, n_head=4, n_layer=2, block_size=16, batch_size=batch_size, lr=lr)
        for i in (1, 2):
            self.net[i] = DropBlock(d_model, 4, dropout)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(strategy: Any = "single", devices: int = 1, steps: int = 3, dropout: float = 0.0, d_model: int = 32,
        run_dir: str = "/tmp", **trainer_kwargs: Any) -> tuple[SmallGPT, Trainer]:
    torch.manual_seed(0)
    module = SmallGPT(dropout=dropout, d_model=d_model)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=2, run_dir=run_dir, seed=0, **trainer_kwargs)
    trainer.fit(module)
    return module, trainer


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.module_state_dict().items()}


# --------------------------------------------------------------------------- options and targets


def test_options_are_checked_when_the_trainer_is_built() -> None:
    assert resolve_compile(True) == {} and resolve_compile(False) is None
    assert resolve_compile({"mode": "max-autotune", "modules": "Block"}) == {"mode": "max-autotune",
                                                                            "modules": ["Block"]}
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['mdoe'\].*fullgraph"):
        Trainer(compile={"mdoe": "max-autotune"})
    with pytest.raises(ConfigError, match="trainer.compile='yes'"):
        Trainer(compile="yes")
    assert resolve_checkpointing(True) == {"modules": None, "every": 1, "mode": "full"}
    assert resolve_checkpointing("Block") == {"modules": ["Block"], "every": 1, "mode": "full"}
    assert resolve_checkpointing({"mode": "op"}) == {"modules": None, "every": 1, "mode": "op"}
    with pytest.raises(ConfigError, match=r"mode='ops' is not valid; use full .* or op"):
        Trainer(activation_checkpointing={"mode": "ops"})
    with pytest.raises(ConfigError, match="every=0"):
        Trainer(activation_checkpointing={"every": 0})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['blocks'\]"):
        Trainer(activation_checkpointing={"blocks": ["Block"]})


def test_targets_are_the_wrap_policy_blocks() -> None:
    gpt = SmallGPT()
    blocks = [gpt.net[1], gpt.net[2]]
    # single/ddp: the network in one region; fsdp/tensor: each repeated block (the FSDP units).
    assert compile_targets(gpt, {}, "model") == [gpt.net]
    assert compile_targets(gpt, {}, "blocks") == blocks
    assert compile_targets(gpt, {"modules": ["Embeddings", "DropBlock"]}, "model") == [gpt.net[0], *blocks]
    with pytest.raises(ConfigError, match="no submodule of that class"):
        compile_targets(gpt, {"modules": ["Blok"]})
    # Embeddings, final norm and head are checkpointed only when named: they save nothing.
    assert apply_activation_checkpointing(gpt, resolve_checkpointing(True)) == blocks
    every_2 = SmallGPT()
    assert apply_activation_checkpointing(every_2, resolve_checkpointing({"every": 2})) == [every_2.net[2]]


def test_checkpointed_and_compiled_blocks_keep_names_class_and_copies() -> None:
    gpt = SmallGPT()
    keys = list(gpt.state_dict())
    apply_activation_checkpointing(gpt, resolve_checkpointing(True))
    apply_compile([gpt.net[1]], {"backend": "eager"})
    block = gpt.net[1]
    assert list(gpt.state_dict()) == keys  # checkpoints, FSDP and optimizer state see the same names
    assert isinstance(block, DropBlock) and type(block).__name__ == "DropBlock"
    assert type(gpt.net[2]) is not DropBlock  # checkpointed: a same-named subclass
    # Copies (EMA callbacks deepcopy modules) and pickles are the user's class, eager, with their own weights.
    twin = copy.deepcopy(block)
    assert type(twin) is DropBlock and type(pickle.loads(pickle.dumps(gpt)).net[2]) is DropBlock
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(2, 4, 32)
    assert torch.equal(twin(x), x) and not torch.equal(block(x), x)


# --------------------------------------------------------------------------- activation checkpointing


def test_checkpointing_recomputes_with_the_same_dropout_masks(run_dir: str) -> None:
    """Non-reentrant checkpointing restores the RNG state for the recompute: the masks of the
    recompute equal the forward's, which equal a run without checkpointing; the RNG stream after
    the run is the same, so the weights match exactly."""
    runs = {}
    for name, ac in (("plain", False), ("ac", True)):
        torch.manual_seed(0)
        module = SmallGPT(dropout=0.3)
        masks: list[torch.Tensor] = []
        for block in (module.net[1], module.net[2]):
            block.drop.register_forward_hook(lambda m, i, o, masks=masks: masks.append(o == 0))
        trainer = Trainer(strategy="single", accelerator="cpu", max_steps=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, limit_val_batches=0, run_dir=run_dir, seed=0,
                          activation_checkpointing=ac)
        trainer.fit(module)
        runs[name] = (masks, state(trainer), torch.get_rng_state())
    plain_masks, plain_state, plain_rng = runs["plain"]
    ac_masks, ac_state, ac_rng = runs["ac"]
    # Per step: 4 dropout calls in forward (2 blocks x 2), then with AC the recompute's, block 2 first.
    # The recompute stops once the last tensor backward needs exists (checkpoint's early stop), inside
    # the second dropout, before its forward hook: 1 or 2 recorded masks per block, by torch version.
    per_step = 4
    assert len(plain_masks) == 2 * per_step and len(ac_masks) % 2 == 0 and len(ac_masks) > len(plain_masks)
    ac_step = len(ac_masks) // 2
    for step in range(2):
        expected = plain_masks[step * per_step:(step + 1) * per_step]
        forward = ac_masks[step * ac_step: step * ac_step + per_step]
        recompute = ac_masks[step * ac_step + per_step:(step + 1) * ac_step]
        assert all(torch.equal(a, b) for a, b in zip(forward, expected, strict=True))
        assert recompute and all(any(torch.equal(m, f) for f in expected) for m in recompute)
        assert any(m.any() for m in expected)  # dropout did drop something
    assert torch.equal(plain_rng, ac_rng)
    assert max_diff(plain_state, ac_state) <= AC_TOL["atol"]


# --------------------------------------------------------------------------- compile, one process


@pytest.mark.timeout(900)  # compiling takes minutes on a loaded 2-core machine
def test_compile_single_matches_eager_without_graph_breaks(run_dir: str, caplog: Any) -> None:
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    _, eager = fit(run_dir=run_dir)
    with caplog.at_level(logging.INFO, logger="polytrain"):
        module, compiled = fit(run_dir=run_dir, compile=True, activation_checkpointing=True)
    assert max_diff(state(eager), state(compiled)) <= COMPILE_TOL["atol"]
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 1  # something was compiled
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile:")]
    assert lines[0].startswith("torch.compile: 1 module(s) (Sequential x1)")
    assert len([m for m in lines if "compiling (first training batch" in m]) == 1, lines  # reported once
    # Evaluation after fit runs the same compiled module (no_grad: a graph of its own).
    assert compiled.validate(module)[0]["val/loss"] == pytest.approx(eager.validate()[0]["val/loss"],
                                                                     abs=1e-5)


# --------------------------------------------------------------------------- distributed


def _parity_run(rank: int, world: int, strategy: Any, backend: str, d_model: int, run_dir: str) -> Any:
    import torch._dynamo.backends.distributed as ddp_backend

    subgraphs: list[int] = []
    original = ddp_backend.DDPOptimizer.compile_fn

    def counting_compile_fn(self: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        inner, count = self.backend_compile_fn, [0]

        def compile_one(*args: Any, **kw: Any) -> Any:
            count[0] += 1
            return inner(*args, **kw)

        self.backend_compile_fn = compile_one
        try:
            return original(self, gm, example_inputs, **kwargs)
        finally:
            subgraphs.append(count[0])

    ddp_backend.DDPOptimizer.compile_fn = counting_compile_fn
    out = {}
    # Checkpointing with dropout in the blocks; compile without (inductor draws its own random numbers,
    # and torch 2.15's AOTAutograd fails on checkpoint + dropout + DTensor: docs/compile.md).
    variants = {"eager_dropout": (0.2, {}), "ac": (0.2, {"activation_checkpointing": True}),
                "ac_op": (0.2, {"activation_checkpointing": {"mode": "op"}}), "eager": (0.0, {}),
                "compiled": (0.0, {"compile": {"backend": backend}}),
                "both": (0.0, {"compile": {"backend": backend}, "activation_checkpointing": True})}
    applied = {}  # per variant: (dynamo graphs compiled, checkpointed blocks on this rank)
    for name, (dropout, kwargs) in variants.items():
        torch._dynamo.utils.counters.clear()
        _, trainer = fit(strategy, world, dropout=dropout, d_model=d_model, run_dir=f"{run_dir}/{name}",
                         **kwargs)
        out[name] = state(trainer)
        counters = torch._dynamo.utils.counters
        applied[name] = (counters["stats"]["unique_graphs"],
                         sum(hasattr(type(m), "_polytrain_checkpointed_from")
                             for m in trainer.strategy.module.modules()))
        # no silent fallback to eager
        assert not counters["graph_break"], (name, dict(counters["graph_break"]))
    # Every rank compiled and checkpointed where asked (a pipeline rank: its own blocks), and only there.
    assert [applied[n][0] > 0 for n in variants] == [False, False, False, False, True, True], applied
    assert [applied[n][1] > 0 for n in variants] == [False, True, True, False, False, True], applied
    if rank:
        return None
    diffs = {name: max_diff(out["eager"], out[name]) for name in ("compiled", "both")}
    diffs["ac"] = max(max_diff(out["eager_dropout"], out["ac"]), max_diff(out["eager_dropout"], out["ac_op"]))
    return diffs, subgraphs


@pytest.mark.timeout(600)
def test_compile_and_checkpointing_ddp_match_eager(tmp_path: Any) -> None:
    # d=128: the blocks hold 1.6 MB, more than one 1 MB DDP bucket, so DDPOptimizer must split.
    diffs, subgraphs = run_distributed(_parity_run, 2, {"name": "ddp", "bucket_cap_mb": 1}, "inductor", 128,
                                       str(tmp_path), timeout=580)[0]
    assert diffs["ac"] <= AC_TOL["atol"], diffs
    assert diffs["compiled"] <= COMPILE_TOL["atol"] and diffs["both"] <= COMPILE_TOL["atol"], diffs
    # The compiled region runs inside DDP's forward: DDPOptimizer compiled it split at bucket boundaries.
    assert subgraphs and min(subgraphs) >= 2, subgraphs


@pytest.mark.timeout(600)
def test_compile_and_checkpointing_fsdp_match_eager(tmp_path: Any) -> None:
    diffs, subgraphs = run_distributed(_parity_run, 2, {"name": "fsdp"}, "inductor", 32, str(tmp_path),
                                       timeout=580)[0]
    assert diffs["ac"] <= AC_TOL["atol"], diffs
    assert diffs["compiled"] <= COMPILE_TOL["atol"] and diffs["both"] <= COMPILE_TOL["atol"], diffs
    assert not subgraphs  # no DDP: blocks compiled whole, FSDP's gathers outside them


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [{"name": "model_parallel", "mode": "tensor"}, {"name": "pipeline"}],
                         ids=["tensor", "pipeline"])
def test_compile_and_checkpointing_tensor_and_pipeline(strategy: dict[str, Any], tmp_path: Any) -> None:
    diffs, _ = run_distributed(_parity_run, 2, strategy, "aot_eager", 32, str(tmp_path), timeout=580)[0]
    assert diffs["ac"] <= AC_TOL["atol"], diffs
    assert diffs["compiled"] <= COMPILE_TOL["atol"] and diffs["both"] <= COMPILE_TOL["atol"], diffs


def _example_run(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from polytrain.trainer.configuration.config import instantiate, load_config

    path = os.path.join(GPT_DIR, "config_compile.yaml")
    overrides = [f"trainer.run_dir={run_dir}", "trainer.enable_progress_bar=false", "trainer.logger=false",
                 "trainer.enable_checkpointing=false", "trainer.max_epochs=1",
                 "trainer.limit_train_batches=3",
                 "trainer.limit_val_batches=1", "trainer.compile.backend=aot_eager"]  # inductor: see the top
    config = load_config(path, overrides)
    assert (config["trainer"]["compile"] == {"backend": "aot_eager"}
            and config["trainer"]["activation_checkpointing"])
    module = instantiate(config["module"], "module", config.get("config_dir"))
    trainer = Trainer.from_config(config)
    trainer.fit(module)
    return {"steps": trainer.global_step,
            "compiled": [hasattr(type(b), "_polytrain_compiled_from") for b in module.net],
            "checkpointed": [hasattr(type(b), "_polytrain_checkpointed_from") for b in module.net]}


@pytest.mark.timeout(900)  # compiling takes minutes on a loaded 2-core machine
def test_the_compile_example_config_runs(tmp_path: Any) -> None:
    out = run_distributed(_example_run, 2, str(tmp_path), timeout=880)[0]
    assert out["steps"] == 3
    assert out["compiled"] == out["checkpointed"] == [False, True, True, False, False]  # the two Blocks
