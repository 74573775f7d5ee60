"""Cutting a model that is not one ``nn.Sequential`` into pipeline stages at module paths: where the
cut falls by default, which stage each module and each tie belongs to, what a rank keeps, and the
errors for a cut that cannot work. All local: no process group (the distributed runs are in
tests/test_own_models.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_own_models import HeldModel
from torch import nn

from polytrain.parallel import pipeline_path_cut as P
from polytrain.parallel.pipeline_sequential_cut import PipelineSplitError

pytestmark = pytest.mark.own_logic


def _held(kind: str) -> HeldModel:
    with torch.device("meta"):
        return HeldModel(kind, 4)


@pytest.mark.parametrize("kind, n_stages, paths", [
    ("gpt2", 2, ["model.transformer.h.1"]),
    ("llama", 2, ["model.model.layers.1"]),
    ("vit_b_16", 2, ["model.encoder.layers.encoder_layer_6"]),
    ("vit_b_16", 4, [f"model.encoder.layers.encoder_layer_{i}" for i in (3, 6, 9)]),
    ("resnet50", 2, ["model.layer4.1"]),  # every bottleneck is a block; layer4's three hold 15M of 25.6M
])
def test_the_default_cut_falls_between_the_repeated_blocks(kind: str, n_stages: int,
                                                           paths: list[str]) -> None:
    assert P.default_split_paths(_held(kind), n_stages) == paths


def test_each_module_belongs_to_the_stage_it_is_registered_in_and_a_tie_to_both() -> None:
    module = _held("gpt2")
    cut = P.cut_at_paths(module, ["model.transformer.h.1"], 2)
    assert cut.stage_of["model.transformer.wte"] == cut.stage_of["model.transformer.h.0.attn.c_attn"] == 0
    assert cut.stage_of["model.transformer.h.1.mlp.c_proj"] == cut.stage_of["model.lm_head"] == 1
    assert cut.ties == [(["model.transformer.wte.weight", "model.lm_head.weight"], [0, 1])]


def test_a_rank_keeps_its_stages_modules_and_stand_ins_for_the_rest() -> None:
    module = HeldModel("gpt2", 4)
    everything = {k: v.clone() for k, v in module.state_dict().items()}
    cut = P.cut_at_paths(module, ["model.transformer.h.1"], 2)
    stand_ins = P.keep_stages(module, cut, {1})
    assert sorted(s.path for s in stand_ins) == ["model.transformer.h.0", "model.transformer.wpe",
                                                 "model.transformer.wte"]
    kept = module.state_dict()
    assert "model.lm_head.weight" in kept and "model.transformer.wte.weight" not in kept  # the tie: head side
    assert all(k.startswith(("model.transformer.h.1.", "model.transformer.ln_f.", "model.lm_head."))
               for k in kept)
    assert all(torch.equal(v, everything[k]) for k, v in kept.items())


def test_a_stage_runs_from_the_activation_it_receives_to_the_next_split_point() -> None:
    """Three stages of a three-block model on one process: each runs the whole forward, its stand-ins
    give zeros, it starts from what it received and stops at its end; chained, they are the model."""
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    holder = nn.Module()
    holder.net = whole
    x = torch.randn(2, 4)
    want = whole(x)
    cut = P.cut_at_paths(holder, ["net.2", "net.4"], 3)
    activation = None
    for stage in range(3):
        part = nn.Module()
        part.net = nn.Sequential(*[layer for layer in whole])  # the same layers, a tree of its own
        P.keep_stages(part, cut, {stage})
        P.add_split_hooks(part, cut, {stage})
        with P.running_as(P.StagePass(stage, activation, torch.device("cpu"))):
            try:
                out = part.net(x)
            except P.ReachedSplit as reached:
                activation = reached.activation
            else:
                assert stage == 2
    torch.testing.assert_close(out, want)


class _HeadFirst(nn.Module):
    """Registers its head before the blocks the forward runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_module_run_out_of_its_registered_order_is_named_not_skipped() -> None:
    model = _HeadFirst()
    cut = P.cut_at_paths(model, ["blocks.1"], 2)
    assert cut.stage_of["head"] == 0  # registered before blocks.1, although it runs after
    P.keep_stages(model, cut, {1})
    P.add_split_hooks(model, cut, {1})
    with (P.running_as(P.StagePass(1, torch.zeros(3, 4), torch.device("cpu"))),
          pytest.raises(RuntimeError, match=r"stage 1 ran head \(of stage 0\) after its first split point: "
                                            r"the model runs it later than it registers it")):
        model(torch.zeros(3, 4))


def test_bad_split_points_are_refused_in_words() -> None:
    module = _held("llama")
    with pytest.raises(PipelineSplitError, match=r"'model.model.layer.1' names no module of HeldModel; "
                                                 r"model.model holds \['embed_tokens', 'layers', 'norm', "
                                                 r"'rotary_emb'\]"):
        P.cut_at_paths(module, ["model.model.layer.1"], 2)
    with pytest.raises(PipelineSplitError, match=r"give 2 stages but the pipeline has 3"):
        P.cut_at_paths(module, ["model.model.layers.1"], 3)
    with pytest.raises(PipelineSplitError, match=r"must follow the order the modules are registered in"):
        P.cut_at_paths(module, ["model.model.layers.1", "model.model.layers.0"], 3)
    with pytest.raises(PipelineSplitError, match=r"'model.model.layers.1.self_attn' lies inside split point "
                                                 r"'model.model.layers.1'"):
        P.cut_at_paths(module, ["model.model.layers.1", "model.model.layers.1.self_attn"], 3)
    with pytest.raises(PipelineSplitError, match=r"leave pipeline stage\(s\) \[1\] without a module"):
        P.cut_at_paths(module, ["model.model.rotary_emb", "model.lm_head"], 3)  # rotary: buffers only
    with pytest.raises(PipelineSplitError, match=r"HeldModel has no nn.Sequential child and 2 repeated "
                                                 r"blocks \(in a ModuleList or Sequential\) to cut into 3 "
                                                 r"pipeline stages"):
        P.default_split_paths(module, 3)
    with pytest.raises(PipelineSplitError, match=r"Linear has no nn.Sequential child and 0 repeated blocks"):
        P.default_split_paths(nn.Linear(2, 2), 2)


def test_split_points_in_a_config_are_child_indices_or_module_paths_not_a_mix() -> None:
    from polytrain.core.errors import ConfigError
    from polytrain.core.option_checks import validate_dataclass
    from polytrain.strategies.options import ParallelOptions

    paths = validate_dataclass(ParallelOptions, {"pp": 2, "split_points": ["model.model.layers.4"]},
                               "strategy")
    assert paths.split_points == ["model.model.layers.4"]
    assert validate_dataclass(ParallelOptions, {"pp": 3, "split_points": [2, 4]},
                              "strategy").split_points == [2, 4]
    for mixed in ([2, "model.x"], [{"layer": 2}]):
        with pytest.raises(ConfigError, match=r"strategy.split_points.*expected list\[int\] \| "
                                              r"list\[str\] \| None"):
            validate_dataclass(ParallelOptions, {"pp": 3, "split_points": mixed}, "strategy")


# ------------------------------------------------------------------------ a Sequential with a head beside it

_X = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
_Y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(5))


def _net_and_head() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 3)


def _train_net_and_head(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain import Trainer, TrainModule

    class NetAndHead(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.head = _net_and_head()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.head(self.net(x)), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(_X, _Y), batch_size=8)

    strategy = {"name": "parallel", "pp": 2, "split_points": ["net.2"], "schedule": "gpipe",
                "n_microbatches": 2}
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=3, run_dir=root,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, timeout=60)
    trainer.fit(NetAndHead())
    return trainer.strategy.module_state_dict()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_sequential_with_a_head_beside_it_is_cut_at_a_module_path_equal_to_one_process(
        tmp_path: Any) -> None:
    """The Sequential cut needs every trained layer inside it (its error says so and names this way out):
    cut at ``net.2``, the head beside the Sequential goes with the last stage."""
    import torch.nn.functional as F
    from distributed import run_distributed

    net, head = _net_and_head()
    optimizer = torch.optim.SGD([*net.parameters(), *head.parameters()], lr=0.1)
    for step in range(3):
        rows = slice((step % 2) * 8, (step % 2) * 8 + 8)
        optimizer.zero_grad()
        F.cross_entropy(head(net(_X[rows])), _Y[rows]).backward()
        optimizer.step()
    want = {**{f"net.{k}": v for k, v in net.state_dict().items()},
            **{f"head.{k}": v for k, v in head.state_dict().items()}}
    got = run_distributed(_train_net_and_head, 2, str(tmp_path), timeout=100)[0]
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)
