"""The planner costs expert parallel (``ep``): a Hugging Face mixture-of-experts model (Qwen3-MoE, held by a
``TrainModule``) is ranked with ``ep`` layouts, a dense model with none (and a pinned ``ep`` is refused in the
strategy's words), the all-to-all traffic is what the equations say, and the parameters, gradients and
optimizer state each rank holds when it trains under ``ep`` on real gloo ranks are what the planner predicts.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import transformers
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.core.errors import ConfigError
from polytrain.parallel.planner import Plan, Training, format_table, hardware, plan_module
from polytrain.parallel.planner.search import describe_time

pytestmark = pytest.mark.torch_api

VOCAB, TOKENS, PER_RANK, STEPS = 64, 8, 2, 2
TOP_K, HIDDEN = 2, 16


def build_model(num_experts: int = 4, moe_intermediate_size: int = 8) -> nn.Module:
    """tests/test_expert_parallel.py's tiny Qwen3-MoE; ``num_experts`` and ``moe_intermediate_size`` make the
    experts the bulk of the parameters where memory is measured."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=num_experts, num_experts_per_tok=TOP_K,
        output_router_logits=True, router_aux_loss_coef=0.5, attn_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(config)


def build_dense() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCAB, (samples, TOKENS), generator=generator))


class Held(TrainModule):
    """A user's module around the library model: its loss (the router's auxiliary loss included)."""

    def __init__(self, model: nn.Module, batch_size: int = PER_RANK, samples: int = 0) -> None:
        super().__init__()
        self.model, self.batch_size, self.samples = model, batch_size, samples

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.samples), batch_size=self.batch_size)


def _plan(build: Any, devices: int, pinned: dict[str, int] | None = None) -> Plan:
    """``polytrain plan``'s ranking for the module holding ``build()``, on ``devices`` CPU ranks, as
    tests/test_own_models.py's ``_plan`` asks it."""
    with torch.device("meta"):
        module = Held(build())
    train = Training(global_batch=PER_RANK * devices, precision="32", optimizer="adamw", foreach=False)
    return plan_module(module, dataset(1).tensors[0], hardware("cpu", 1, devices), train, pinned=pinned)


def test_a_mixture_of_experts_model_is_ranked_with_ep_layouts_and_a_dense_one_without() -> None:
    plan = _plan(build_model, 4)
    eps = {e.layout.ep for e in plan.ranked}
    assert eps == {1, 2, 4}, eps  # every divisor of dp that splits the 4 experts
    # ep borrows from the data-parallel ranks: it divides dp, and the world is still dp x tp x pp
    assert all(e.layout.dp % e.layout.ep == 0 and e.layout.world_size == 4 for e in plan.ranked)
    assert any(e.layout.ep == 2 and e.layout.tp == 2 for e in plan.ranked)
    table = format_table(plan, top=100)
    assert "dp_shard4 x ep2 " in table and "dp_shard2 x ep2 x tp2 " in table, table
    by_label = {e.layout.label(): e for e in plan.ranked}
    sharded, split = by_label["dp_shard4"], by_label["dp_shard4 x ep2"]
    # The same dp: the experts are 1/dp a rank either way (FSDP over 4, or ep 2 x FSDP over the other 2)...
    assert split.memory["params"] == pytest.approx(sharded.memory["params"], abs=8)
    # ...but every MoE layer exchanges its (token, expert) rows twice a pass: forward and backward, half of
    # them leaving the rank. A rank's micro-batch is 2 samples of 8 tokens, each to 2 experts, 16 fp32 each.
    rows = PER_RANK * TOKENS * TOP_K * HIDDEN * 4
    assert split.traffic["ep"] == 2 * 2 * 2 * rows * (2 - 1) / 2  # layers x passes x exchanges x rows x 1/2
    assert "ep" not in sharded.traffic and "ep" not in sharded.time
    assert split.time["ep"] > 0 and "ep " in describe_time(split)

    dense = _plan(build_dense, 4)
    assert dense.ranked and all(e.layout.ep == 1 for e in dense.ranked + dense.rejected)  # type: ignore


def test_a_pinned_ep_is_refused_in_the_strategys_words_where_it_cannot_run() -> None:
    # A dense model has no experts to split: every layout rejected, as the strategy's ExpertParallelPlanError
    dense = _plan(build_dense, 4, {"ep": 2})
    refused = [r for r in dense.rejected if "ep > 1 needs a mixture-of-experts model, but Held has no "
               "expert-parallel plan" in r.reason]
    assert not dense.ranked and refused
    assert refused[0].reason.endswith("or train it with ep=1")
    with pytest.raises(ConfigError, match="no layout fits: .*ep2.*needs a mixture-of-experts model"):
        _ = dense.best
    # 4 experts do not split 3 ways; and ep must divide the data-parallel ranks it borrows
    uneven = _plan(build_model, 6, {"ep": 3})
    assert not uneven.ranked
    uneven_words = "ep=3 does not divide the expert count of model.model.layers.0.mlp.experts (4 experts)"
    assert any(r.reason.startswith(uneven_words) for r in uneven.rejected), uneven.rejected
    over = _plan(build_model, 4, {"ep": 4, "tp": 2})
    assert {r.reason for r in over.rejected} >= {
        "ep=4 must divide the data-parallel ranks dp_replicate x dp_shard = 1 x 2 = 2: expert parallel "
        "borrows them (it is not a factor of world_size=4); use an ep that divides 2"}


# ------------------------------------------------------------------ measured against predicted

EXPERTS, EXPERT_WIDTH = 8, 32  # the experts are 82 % of the measured model's parameters


def measured_model() -> nn.Module:
    return build_model(EXPERTS, EXPERT_WIDTH)


def _bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (its shard of a DTensor); a tensor held twice counts once."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            seen[id(t)] = local.numel() * local.element_size()
    return sum(seen.values())


def _train_and_measure(rank: int, world_size: int, strategy: dict[str, Any], root: str) -> dict[str, int]:
    dp = world_size // strategy.get("tp", 1)
    module = Held(measured_model(), PER_RANK, STEPS * dp * PER_RANK)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=STEPS, run_dir=root,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, timeout=120)
    trainer.fit(module)
    # After the last step: the parameters, the gradients of the last backward, AdamW's state (local shards)
    return {"params": _bytes(module.parameters()), "grads": _bytes(p.grad for p in module.parameters()),
            "optimizer": _bytes(v for state in trainer.optimizers[0].state.values() for v in state.values())}


@functools.cache
def _measured_plan(devices: int) -> Plan:
    return _plan(measured_model, devices)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, strategy, label", [
    (2, {"name": "parallel", "ep": 2}, "dp_shard2 x ep2"),
    (4, {"name": "parallel", "ep": 2}, "dp_shard4 x ep2"),
    (4, {"name": "parallel", "ep": 2, "tp": 2}, "dp_shard2 x ep2 x tp2"),
    # HSDP: the dense parameters are sharded over dp_shard (2), the experts over every data-parallel rank (4)
    (4, {"name": "parallel", "dp_replicate": 2, "dp_shard": 2, "ep": 2}, "dp_replicate2 x dp_shard2 x ep2"),
], ids=["ep2-on-2", "ep2-on-4", "ep2xtp2-on-4", "hsdp-ep2-on-4"])
def test_the_state_a_rank_holds_under_ep_is_what_the_planner_predicts(
        world_size: int, strategy: dict[str, Any], label: str, tmp_path: Any) -> None:
    (estimate,) = [e for e in _measured_plan(world_size).ranked
                   if e.layout.label() == label]  # the layout the strategy composes, checkpointing off
    predicted = {term: estimate.memory[term] for term in ("params", "grads", "optimizer")}
    out = run_distributed(_train_and_measure, world_size, strategy, str(tmp_path), timeout=240)
    for rank, held in enumerate(out):
        ratio = sum(held.values()) / sum(predicted.values())
        print(f"{label} rank {rank}: measured {sum(held.values())} B, predicted {sum(predicted.values())} B, "
              f"{ratio:.3f}")
        assert 0.9 <= ratio <= 1.1, f"{label}, rank {rank}: held {held} against predicted {predicted}"


def _planned_fit(rank: int, world_size: int, strategy: dict[str, Any], root: str) -> dict[str, Any]:
    module = Held(build_model(), PER_RANK, STEPS * world_size * PER_RANK)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=1, run_dir=root,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, timeout=120)
    trainer.fit(module)
    experts = module.model.model.layers[0].mlp.experts
    return {"ep": trainer.strategy.dims.ep, "local_experts": experts.num_experts,
            "chosen": trainer.config.strategy["chosen"]}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_planned_run_trains_with_the_ep_it_was_given(tmp_path: Any) -> None:
    """``plan: true`` with ``ep`` pinned: the planner ranks ep=2 layouts only, and the run splits the experts
    as the plan says."""
    strategy = {"name": "parallel", "plan": True, "ep": 2}
    out = run_distributed(_planned_fit, 2, strategy, str(tmp_path), timeout=150)
    for result in out:
        assert result["chosen"]["ep"] == 2
        assert result["ep"] == 2
        assert result["local_experts"] == 2  # 4 experts over 2 ranks


def test_plan_true_plans_ep_for_a_model_with_experts_and_keeps_a_pinned_one() -> None:
    from polytrain.strategies.plan_spec import pinned_degrees, split_plan, with_plan

    names = ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"]
    plain, request = split_plan({"plan": True}, names)
    assert "ep" in request["auto"] and "ep" not in plain
    assert "ep" not in pinned_degrees(with_plan(plain, request))
    plain, request = split_plan({"plan": True, "ep": 2}, names)
    assert plain["ep"] == 2 and "ep" not in request["auto"]
    assert pinned_degrees(with_plan(plain, request))["ep"] == 2
    plain, request = split_plan({"ep": "auto"}, names)  # an 'auto' degree alone asks the planner
    assert request["auto"] == ["dp_shard", "ep"]
