"""Expert parallel: a Hugging Face mixture-of-experts model (Qwen3-MoE, its router's auxiliary loss on)
trains under ``ep`` equal to one process averaging the ranks' losses on the same global batch, each rank
holding only its experts, and its checkpoints load and train on one process exactly.

The reference is a plain PyTorch loop: each step it computes the model's loss on every rank's batch (rows
``r::dp`` of the global batch, as the sampler splits it) and averages them. The auxiliary loss is per call,
so the average of the ranks' losses is not the loss of the global batch: the test says which one is meant.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import transformers
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.core.errors import ConfigError
from polytrain.parallel.dims import ParallelDims
from polytrain.parallel.expert_parallel import (
    ExpertParallelPlanError,
    check_expert_degree,
    expert_layers,
    expert_plan,
)
from polytrain.strategies.composed import ParallelStrategy
from polytrain.strategies.options import ParallelOptions

pytestmark = pytest.mark.torch_api

VOCAB, TOKENS, PER_RANK, EXPERTS = 64, 8, 2, 4
STOP_AT, STEPS = 2, 4


def build_model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.5, attn_implementation="eager",
        experts_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(config)


def dataset(dp: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCAB, (STEPS * dp * PER_RANK, TOKENS), generator=generator))


def optimizer_for(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)  # momentum: a lost optimizer state shows


def mean_of_rank_losses(model: nn.Module, tokens: torch.Tensor, ranks: int) -> torch.Tensor:
    """The loss every data-parallel rank computes on its rows (``r::ranks``), averaged."""
    losses = [model(input_ids=tokens[r::ranks], labels=tokens[r::ranks]).loss for r in range(ranks)]
    return sum(losses) / ranks


class HeldMoE(TrainModule):
    """A user's module around the library model. ``ranks`` > 1 on one process: the step averages the losses
    of that many interleaved parts of its batch, what that many data-parallel ranks average."""

    def __init__(self, dp: int, batch_size: int, ranks: int = 1) -> None:
        super().__init__()
        self.dp, self.batch_size, self.ranks = dp, batch_size, ranks
        self.model = build_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return mean_of_rank_losses(self.model, tokens, self.ranks)

    def configure_optimizers(self) -> Any:
        return optimizer_for(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.dp), batch_size=self.batch_size)


@functools.cache
def reference(dp: int) -> dict[int, dict[str, torch.Tensor]]:
    """A plain loop on the global batch averaging the ranks' losses: weights after STOP_AT and STEPS."""
    model = build_model()
    optimizer = optimizer_for(model.parameters())
    snapshots = {}
    for step, (tokens,) in enumerate(DataLoader(dataset(dp), batch_size=dp * PER_RANK), start=1):
        optimizer.zero_grad()
        mean_of_rank_losses(model, tokens, dp).backward()
        optimizer.step()
        if step in (STOP_AT, STEPS):
            snapshots[step] = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    return snapshots


def quiet(root: str, max_steps: int, devices: int, strategy: Any) -> dict[str, Any]:
    return dict(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, run_dir=root,
                logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, num_sanity_val_steps=0, timeout=120)


def full_optimizer(trainer: Trainer) -> dict[str, Any]:
    """Every optimizer entry by parameter name, full tensors (a collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    state = get_optimizer_state_dict(trainer.strategy.module, trainer.strategy.optimizers, options=options)
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def expert_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes this process holds of the experts' tensors, and of what they are in full."""
    held = full = 0
    for name, param in module.named_parameters():
        if ".experts." in name:
            local = param.to_local() if hasattr(param, "to_local") else param
            held += local.numel() * local.element_size()
            full += param.numel() * param.element_size()  # a DTensor's numel is the whole tensor's
    return {"held": held, "full": full}


def _train_save_resume(rank: int, world_size: int, strategy: dict[str, Any], root: str) -> dict[str, Any]:
    dp = world_size // strategy.get("tp", 1) // strategy.get("pp", 1)
    first = Trainer(**quiet(os.path.join(root, "first"), STOP_AT, world_size, strategy))
    first.fit(HeldMoE(dp, PER_RANK))
    saved = os.path.join(root, "stopped")
    first.save_checkpoint(saved)
    experts = first.strategy.module.model.model.layers[0].mlp.experts
    stopped = {"weights": first.strategy.module_state_dict(), "optimizer": full_optimizer(first),
               "experts": expert_bytes(first.strategy.module),
               # split over ep, not only FSDP-sharded: it runs its own experts, its tensors' mesh has ep
               "local_experts": experts.num_experts,
               "mesh": tuple(experts.gate_up_proj.device_mesh.mesh_dim_names)}
    resumed = Trainer(**quiet(os.path.join(root, "resumed"), STEPS, world_size, strategy))
    resumed.fit(HeldMoE(dp, PER_RANK), ckpt_path=saved)
    out = {"stopped": stopped, "resumed": resumed.strategy.module_state_dict(), "checkpoint": saved}
    if strategy == {"name": "parallel", "ep": 2} and world_size == 4:
        # The experts are named whole in the checkpoint: another ep degree (4 experts, one a rank) resumes it.
        other = Trainer(**quiet(os.path.join(root, "ep4"), STEPS, world_size, {"name": "parallel", "ep": 4}))
        other.fit(HeldMoE(dp, PER_RANK), ckpt_path=saved)
        out["resumed_under_ep4"] = other.strategy.module_state_dict()
    return out


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, atol: float) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert_close(got[key], value, rtol=0, atol=atol, msg=lambda m, k=key: f"{what} {k}: {m}")
        else:
            assert got[key] == value, f"{what} {key}"


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size, strategy", [
    (2, {"name": "parallel", "ep": 2}),  # every data-parallel rank an expert group's member: 2 experts each
    (4, {"name": "parallel", "ep": 2}),  # two expert groups; each expert FSDP-sharded over the other group
    (4, {"name": "parallel", "ep": 2, "tp": 2}),  # tp peers share a batch and their group's experts
    (4, {"name": "parallel", "ep": 2, "dp_replicate": 2, "dp_shard": 2}),  # HSDP: ep spans the replicas
], ids=["ep2-on-2", "ep2-on-4", "ep2xtp2-on-4", "ep2-hsdp-on-4"])
def test_experts_split_over_ep_train_and_resume_equal_to_one_process(world_size: int,
                                                                      strategy: dict[str, Any],
                                                                      tmp_path: Any) -> None:
    dp = world_size // strategy.get("tp", 1) // strategy.get("pp", 1)
    out = run_distributed(_train_save_resume, world_size, strategy, str(tmp_path), timeout=540)
    want = reference(dp)
    first = out[0]
    _close(first["stopped"]["weights"], want[STOP_AT], f"{strategy} at step {STOP_AT}", atol=1e-5)
    _close(first["resumed"], want[STEPS], f"{strategy} resumed to step {STEPS}", atol=1e-5)
    if "resumed_under_ep4" in first:
        _close(first["resumed_under_ep4"], want[STEPS], "saved under ep=2, resumed under ep=4", atol=1e-5)
    # Measured: each rank holds its share of the experts only, 1 / dp of them (ep splits them, FSDP the rest).
    for rank, result in enumerate(out):
        held = result["stopped"]["experts"]
        assert held["held"] * dp == held["full"], f"rank {rank} holds {held['held']} of {held['full']} bytes"
        assert result["stopped"]["local_experts"] == EXPERTS // strategy["ep"]
        assert "ep" in result["stopped"]["mesh"], result["stopped"]["mesh"]

    # The checkpoint loads on one process exactly (weights and optimizer state, experts gathered by name)...
    single = Trainer(**quiet(str(tmp_path / "one"), STOP_AT, 1, "single"))
    single.fit(HeldMoE(dp, dp * PER_RANK, ranks=dp), ckpt_path=first["checkpoint"])
    assert single.global_step == STOP_AT
    _close(single.strategy.module_state_dict(), first["stopped"]["weights"], "loaded on one process", atol=0)
    _close(full_optimizer(single), first["stopped"]["optimizer"], "optimizer on one process", atol=0)
    # ...and trains on from it to where the reference is.
    going_on = Trainer(**quiet(str(tmp_path / "on"), STEPS, 1, "single"))
    going_on.fit(HeldMoE(dp, dp * PER_RANK, ranks=dp), ckpt_path=first["checkpoint"])
    _close(going_on.strategy.module_state_dict(), want[STEPS], "resumed on one process", atol=1e-5)


# ------------------------------------------------------------------ errors in words, no process group


def test_the_library_plan_names_the_experts_and_their_tensors() -> None:
    module = HeldMoE(2, PER_RANK)
    layers = expert_layers(module, expert_plan(module))
    assert [layer.path for layer in layers] == [f"model.model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(sorted(layer.tensors) == ["down_proj", "gate_up_proj"] for layer in layers)
    assert all(layer.num_experts == EXPERTS for layer in layers)


class OwnExperts(nn.Module):
    """A module of one's own in the experts' calling convention: tensors with the expert on dim 0."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, 8, 4))
        self.w_out = nn.Parameter(torch.randn(num_experts, 4, 8))
        self.scale = nn.Parameter(torch.ones(4))  # not per expert: stays whole


class OwnMoE(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"experts": OwnExperts(6)}) for _ in range(3))

    def expert_parallel_plan(self) -> dict[str, str]:
        return {"blocks.*.experts": "ep_dispatch_experts", "blocks.*.experts.w_in": "grouped_gemm",
                "blocks.*.experts.w_out": "grouped_gemm"}


def test_a_module_of_ones_own_names_its_experts_with_expert_parallel_plan() -> None:
    module = OwnMoE()
    layers = expert_layers(module, expert_plan(module))
    assert [(layer.path, layer.num_experts, layer.tensors) for layer in layers] == [
        (f"blocks.{i}.experts", 6, ["w_in", "w_out"]) for i in range(3)]
    check_expert_degree(layers, 3, 6)
    typo = {"blocks.*.expert": "ep_dispatch_experts"}
    with pytest.raises(ExpertParallelPlanError, match="'blocks.*.expert' reaches no submodule"):
        expert_layers(module, typo)
    with pytest.raises(ExpertParallelPlanError, match="'colwise'; polytrain knows ep_dispatch_experts"):
        expert_layers(module, {"blocks.*.experts": "colwise"})


def test_an_ep_that_does_not_divide_the_experts_is_refused_naming_the_degrees_that_would() -> None:
    module = HeldMoE(2, PER_RANK)
    layers = expert_layers(module, expert_plan(module))
    with pytest.raises(ExpertParallelPlanError,
                       match=r"ep=3 does not divide .*4 experts.*use ep in \[1, 2, 4\]"):
        check_expert_degree(layers, 3, 12)


def test_a_model_with_no_experts_is_refused_in_words() -> None:
    dense = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ExpertParallelPlanError, match="no expert-parallel plan.*expert_parallel_plan"):
        expert_layers(dense, expert_plan(dense))


def test_a_plan_that_leaves_a_per_expert_tensor_whole_is_refused() -> None:
    module = HeldMoE(2, PER_RANK)
    plan = {"model.model.layers.*.mlp.experts": "ep_dispatch_experts",
            "model.model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}
    with pytest.raises(ExpertParallelPlanError, match=r"not \['down_proj'\]"):
        expert_layers(module, plan)


def test_ep_borrows_from_the_data_parallel_ranks_and_must_divide_them() -> None:
    dims = ParallelDims(4, ep=2)  # dp_shard inferred: 4; ep is not a factor of the world size
    assert (dims.dp_size, dims.edp_size, dims.ep) == (4, 2, 2)
    assert [ParallelDims(4, ep=2, rank=r).ep_rank for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match=r"ep=3 must divide the data-parallel ranks .* = 4"):
        ParallelDims(4, ep=3)
    with pytest.raises(ConfigError,
                       match=r"ep=4 must divide the data-parallel ranks dp_replicate x dp_shard = 1 x 2 = 2"):
        ParallelDims(4, tp=2, ep=4)
    with pytest.raises(ConfigError, match=r"ep=2 with pp=2: .*use pp=1 with ep"):
        ParallelDims(8, pp=2, ep=2)
    with pytest.raises(ConfigError, match=r"ep=2 with cp=2: .*use cp=1"):
        ParallelDims(8, cp=2, ep=2)
    # at config load, before the world size is known (the launching process of `polytrain fit`)
    with pytest.raises(ConfigError, match=r"ep=2 with pp=2"):
        ParallelStrategy.check_options(ParallelOptions(ep=2, pp=2), "cpu")
    with pytest.raises(ConfigError, match=r"parallel degree ep=0 must be >= 1"):
        ParallelOptions(ep=0)


CLIP = 0.05  # below the gradients' norm from the first step on: every step is clipped


class ClippedValidated(HeldMoE):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        self.log("val_loss", mean_of_rank_losses(self.model, tokens, self.ranks), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(5)
        rows = torch.randint(0, VOCAB, (self.dp * PER_RANK, TOKENS), generator=generator)
        return DataLoader(TensorDataset(rows), batch_size=self.batch_size)


def _clipped_and_validated(rank: int, world_size: int, root: str) -> dict[str, Any]:
    options = quiet(root, STEPS, world_size, {"name": "parallel", "ep": 2})
    trainer = Trainer(**options, gradient_clip_val=CLIP, activation_checkpointing=True)
    trainer.fit(ClippedValidated(world_size, PER_RANK))
    return {"weights": trainer.strategy.module_state_dict(),
            "val_loss": float(trainer.callback_metrics["val_loss"])}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_clipping_checkpointing_and_validation_under_ep_equal_one_process(tmp_path: Any) -> None:
    """The experts' gradients live on their own mesh: the norm that clips is still the whole model's; a
    checkpointed block exchanges its tokens again when it recomputes; an evaluation pass dispatches its
    tokens like a training one."""
    out = run_distributed(_clipped_and_validated, 2, str(tmp_path), timeout=240)
    model = build_model()
    optimizer = optimizer_for(model.parameters())
    for (tokens,) in DataLoader(dataset(2), batch_size=2 * PER_RANK):
        optimizer.zero_grad()
        mean_of_rank_losses(model, tokens, 2).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP
        optimizer.step()
    want = {f"model.{k}": v for k, v in model.state_dict().items()}
    _close(out[0]["weights"], want, "clipped under ep=2", atol=1e-5)
    (rows,) = ClippedValidated(2, PER_RANK).val_dataloader().dataset.tensors
    with torch.no_grad():
        # each rank's validation batch is its rows r::2; the logged value is the mean over the ranks
        expected = float(mean_of_rank_losses(model, rows, 2))
    for result in out:
        assert result["val_loss"] == pytest.approx(expected, abs=1e-5)


def _optimizers_over_two_meshes(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from polytrain.parallel.dtensor_optim import step_across_meshes

    meshes = [init_device_mesh("cpu", (1,), mesh_dim_names=(name,)) for name in ("dense", "experts")]
    params = [nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Replicate()])) for mesh in meshes]
    plain = torch.optim.SGD(params, lr=0.1)
    step_across_meshes([plain])
    asked = torch.optim.SGD(params, lr=0.1, foreach=True)
    try:
        step_across_meshes([asked])
    except ConfigError as err:
        refused = str(err)
    for param in params:
        param.grad = torch.ones_like(param)
    plain.step()  # one tensor at a time: DTensor would refuse foreach across the two meshes
    return {"foreach": plain.param_groups[0]["foreach"], "refused": refused,
            "stepped": [p.to_local().tolist() for p in params]}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_param_group_over_two_meshes_steps_one_tensor_at_a_time_or_is_refused_in_words() -> None:
    (out,) = run_distributed(_optimizers_over_two_meshes, 1, timeout=50)
    assert out["foreach"] is False
    assert [value for row in out["stepped"] for value in row] == pytest.approx([0.9] * 4)
    assert "foreach=True over parameters on 2 device meshes" in out["refused"]
    assert "leave foreach unset" in out["refused"]


class Dense(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)


def _fit_dense_under_ep(rank: int, world_size: int, root: str) -> str:
    trainer = Trainer(**quiet(root, 1, world_size, {"name": "parallel", "ep": 2}))
    try:
        trainer.fit(Dense())
    except ExpertParallelPlanError as err:
        return str(err)
    return "trained"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_dense_model_under_ep_is_refused_on_every_rank_in_words(tmp_path: Any) -> None:
    out = run_distributed(_fit_dense_under_ep, 2, str(tmp_path), timeout=100)
    for message in out:
        assert message.startswith("ep > 1 needs a mixture-of-experts model, but Dense has no expert-parallel")
