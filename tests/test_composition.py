"""Composed parallelism (strategy ``parallel``) trains exactly like one device, and its checkpoints move
between layouts.

The model is the GPT example (examples/gpt), tiny: embeddings, two blocks, a norm and a head in one
``nn.Sequential``, its own ``tensor_parallel_plan()``, its own ``training_step`` (which the pipeline
runs per micro-batch on the last stage). Four layouts are compared with a hand-written PyTorch loop on
one device over the same global batches (10 steps, SGD with momentum, losses and every weight within 1e-5):

    pp2 x tp2 x dp_shard2 (8 ranks)      dp_replicate2 x dp_shard2 x tp2 (8 ranks)
    pp2 x dp_shard2 (4 ranks)            pp2 x tp2 (4 ranks)

Validation after step 10 runs through each layout too (its val/loss on every rank equals one device's).
Checkpoints: saved after 5 steps under pp2 x tp2 x dp_shard2, resumed to step 10 on one device and under
dp_shard4; saved on one device and under dp_shard4, resumed under pp2 x tp2 x dp_shard2. Each resumed run
must land where the uninterrupted hand loop does. Three spawns (4, 8, 4 ranks) run every job.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

from gpt_module import CharGPT  # noqa: E402 - the example, imported from its folder

from polytrain import Callback, Trainer  # noqa: E402

pytestmark = pytest.mark.torch_api

TOL = {"rtol": 0.0, "atol": 1e-5}
SIZE = dict(d_model=16, n_head=2, n_layer=2, block_size=8, stride=8)
BATCH = 16  # the global batch; per data-parallel rank it is BATCH // dp
STEPS, HALF = 10, 5
LAYOUTS: dict[str, dict[str, Any]] = {
    "pp2_tp2_dp2": {"pp": 2, "tp": 2, "dp_shard": 2},
    "dpr2_dp2_tp2": {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
    "pp2_dp2": {"pp": 2, "dp_shard": 2},
    "pp2_tp2": {"pp": 2, "tp": 2},
    "dp4": {"dp_shard": 4},
}


class GPT(CharGPT):
    """The example with SGD (Adam turns rounding noise in near-zero gradients into visible updates)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class Losses(Callback):
    """Each step's loss as this rank's step returned it (the mean of its micro-batches under pp)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def strategy(layout: str | None) -> Any:
    if layout is None:
        return "single"
    return {"name": "parallel", "n_microbatches": 4, **LAYOUTS[layout]}


ACC_CLIP = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}  # small enough to clip every step


def fit(root: str, layout: str | None, steps: int, save: str | None = None, ckpt: str | None = None,
        **trainer_kwargs: Any) -> dict:
    """Every rank calls this; returns this rank's losses, topology, and (rank 0) the full model."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = LAYOUTS.get(layout, {}) if layout else {}
    dp = world // (degrees.get("pp", 1) * degrees.get("tp", 1))
    torch.manual_seed(0)
    module = GPT(batch_size=BATCH // dp, **SIZE)
    recorder = Losses()
    name = f"{layout or 'single'}-{steps}{'-resumed' if ckpt else ''}{'-acc' if trainer_kwargs else ''}"
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy(layout), max_steps=steps, seed=0,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False,
                      num_sanity_val_steps=0, val_check_interval=STEPS, run_dir=os.path.join(root, name),
                      callbacks=[recorder], timeout=120.0, use_distributed_sampler="always",
                      **trainer_kwargs)  # validation once, after step 10
    trainer.fit(module, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    s = trainer.strategy
    state = s.module_state_dict()  # a collective: the full model on rank 0
    return {"losses": recorder.losses, "steps": trainer.global_step, "dp": (s.dp_rank, s.dp_size),
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} or None,
            "logged": float(trainer.callback_metrics["train/loss"]), "logging": trainer.is_logging_rank,
            "val": (float(trainer.callback_metrics["val/loss"]) if "val/loss" in trainer.callback_metrics
                    else None)}


def hand_loop(steps: int, accumulate: int = 1, clip: float | None = None) -> dict[str, Any]:
    """The reference: plain PyTorch on one device, the global batch in the order a one-rank
    ``DistributedSampler(seed=0)`` draws it, the loss divided over an accumulation window, gradients
    clipped by norm before the step, validation after the last step (mean weighted by batch size)."""
    torch.manual_seed(0)
    module = GPT(batch_size=BATCH, **SIZE)  # the same initial weights as the trained module
    net, vocab = module.net, len(module.vocab)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    data = module.train_dataloader().dataset
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loss_of = lambda x, y: F.cross_entropy(net(x).reshape(-1, vocab), y.reshape(-1))  # noqa: E731
    losses: list[float] = []
    for i, (x, y) in enumerate(DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)):
        loss = loss_of(x, y) / accumulate
        losses.append(loss.item())  # on_train_batch_end's outputs hold the loss divided as for backward
        loss.backward()
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            if (i + 1) // accumulate == steps:
                break
    assert (i + 1) // accumulate == steps, "the reference needs one epoch to hold every step"
    val = None
    if steps == STEPS:
        with torch.no_grad():
            batches = list(module.val_dataloader())
            val = sum(loss_of(x, y).item() * len(x) for x, y in batches) / sum(len(x) for x, _ in batches)
    return {"losses": losses, "val": val,
            "state": {f"net.{k}": v.clone() for k, v in net.state_dict().items()}}


def jobs_for(world: int, root: str) -> list[tuple[str, dict[str, Any]]]:
    ck = lambda name: os.path.join(root, name)  # noqa: E731
    if world == 8:
        return [("pp2_tp2_dp2", dict(layout="pp2_tp2_dp2", steps=STEPS)),
                ("dpr2_dp2_tp2", dict(layout="dpr2_dp2_tp2", steps=STEPS)),
                ("save 3d", dict(layout="pp2_tp2_dp2", steps=HALF, save=ck("3d-step5"))),
                ("single -> 3d", dict(layout="pp2_tp2_dp2", steps=STEPS, ckpt=ck("single-step5.ckpt"))),
                ("dp4 -> 3d", dict(layout="pp2_tp2_dp2", steps=STEPS, ckpt=ck("dp4-step5")))]
    if not os.path.exists(ck("3d-step5")):
        return [("pp2_dp2", dict(layout="pp2_dp2", steps=STEPS)),
                ("pp2_tp2", dict(layout="pp2_tp2", steps=STEPS)),
                ("save dp4", dict(layout="dp4", steps=HALF, save=ck("dp4-step5"))),
                ("pp2_dp2 acc+clip", dict(layout="pp2_dp2", steps=HALF, **ACC_CLIP))]
    return [("3d -> dp4", dict(layout="dp4", steps=STEPS, ckpt=ck("3d-step5")))]


def worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, kwargs in jobs_for(world_size, root):
        try:
            out[key] = fit(root, **kwargs)
        except Exception:  # noqa: BLE001 - reported by the test that reads this job; the rest are skipped
            out[key] = traceback.format_exc()
            break
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("composition"))
    fit(root, None, HALF, save=os.path.join(root, "single-step5.ckpt"))  # input of 'single -> 3d'
    ranks: dict[str, list[Any]] = {}
    for world in (4, 8, 4):
        for rank, result in enumerate(run_distributed(worker, world, root, timeout=900.0)):
            for key, value in result.items():
                ranks.setdefault(key, [None] * world)[rank] = value
    ranks["3d -> single"] = [fit(root, None, STEPS, ckpt=os.path.join(root, "3d-step5"))]
    return {"single": hand_loop(STEPS), "ranks": ranks,
            "single acc+clip": hand_loop(HALF, ACC_CLIP["accumulate_grad_batches"],
                                         ACC_CLIP["gradient_clip_val"])}


def results(runs: dict[str, Any], key: str) -> list[dict[str, Any]]:
    got = runs["ranks"].get(key)
    if got is None:
        pytest.fail(f"job {key} did not run (an earlier job of its spawn failed)", pytrace=False)
    failed = [f"rank {r}:\n{x}" for r, x in enumerate(got) if isinstance(x, str)]
    if failed:
        pytest.fail(f"job {key} raised\n" + "\n".join(failed[:1]), pytrace=False)
    return got


def global_losses(ranks: list[dict[str, Any]]) -> torch.Tensor:
    """The global batch's loss per step: the mean over data-parallel ranks (each sees an equal share;
    tp/pp peers of one data rank report the same value)."""
    by_dp: dict[int, list[float]] = {}
    for r in ranks:
        by_dp.setdefault(r["dp"][0], r["losses"])
    return torch.tensor(list(by_dp.values())).mean(0)


def check(ranks: list[dict[str, Any]], reference: dict[str, Any], what: str, first_step: int = 0) -> float:
    want = torch.tensor(reference["losses"][first_step:])
    got = global_losses(ranks)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert_close(got, want, **TOL, msg=lambda m: f"{what} losses: {m}")
    worst = (got - want).abs().max().item()
    state = ranks[0]["state"]
    assert state is not None and state.keys() == reference["state"].keys(), what
    for name, value in reference["state"].items():
        assert_close(state[name], value, **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")
        worst = max(worst, (state[name] - value).abs().max().item())
    assert all(r["state"] is None for r in ranks[1:]), what  # gathered on rank 0 only
    for r in ranks:  # validation through the layout (padding batches where FSDP gathers), every rank's view
        if reference["val"] is not None:
            assert abs(r["val"] - reference["val"]) < 1e-5, (what, r["val"], reference["val"])
            worst = max(worst, abs(r["val"] - reference["val"]))
    print(f"{what}: largest difference from one device {worst:.1e}")
    return worst


@pytest.mark.distributed
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["pp2_tp2_dp2", "pp2_dp2", "pp2_tp2", "dpr2_dp2_tp2"])
def test_layout_matches_one_device(runs: dict[str, Any], layout: str) -> None:
    single = runs["single"]
    assert single["losses"][-1] < single["losses"][0]  # it trained: parity of frozen weights proves nothing
    ranks = results(runs, layout)
    assert all(r["steps"] == STEPS for r in ranks)
    check(ranks, single, layout)
    # Every rank's callbacks saw a train/loss (the user's own self.log, shared from the last stage), and
    # exactly one rank logs.
    assert sum(r["logging"] for r in ranks) == 1
    if layout.startswith("pp"):
        last = [r for r in ranks if r["logging"]][0]
        assert abs(last["logged"] - last["losses"][-1]) < 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("key", ["3d -> single", "3d -> dp4", "single -> 3d", "dp4 -> 3d"])
def test_checkpoints_resume_across_layouts(runs: dict[str, Any], key: str) -> None:
    ranks = results(runs, key)
    assert all(r["steps"] == STEPS for r in ranks)
    check(ranks, runs["single"], key, first_step=HALF)


@pytest.mark.distributed
@pytest.mark.timeout(1800)
def test_the_saved_halves_match_one_device(runs: dict[str, Any]) -> None:
    half = {"losses": runs["single"]["losses"][:HALF]}
    for key in ("save 3d", "save dp4"):
        ranks = results(runs, key)
        assert_close(global_losses(ranks), torch.tensor(half["losses"]), **TOL)


# ------------------------------------------------------------------------ one process: dims, config, registry


def test_parallel_dims_infer_one_degree_and_print_every_number() -> None:
    from polytrain.core.errors import ConfigError
    from polytrain.parallel.dims import ParallelDims

    dims = ParallelDims(8, pp=2, tp=2, rank=5)  # dp_shard=-1 -> 2
    assert (dims.dp_shard, dims.dp_size, dims.fsdp_size) == (2, 2, 2)
    assert dims.coordinates() == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert (dims.pp_rank, dims.dp_rank, dims.tp_rank, dims.cp_rank) == (1, 0, 1, 0)
    assert (dims.group_ranks("tp") == [4, 5] and dims.group_ranks("dp") == [5, 7]
            and dims.group_ranks("pp") == [1, 5])
    assert dims.pp_enabled and dims.tp_enabled and dims.dp_shard_enabled and not dims.cp_enabled
    assert ParallelDims(8, dp_shard=2, tp=2, pp=-1).pp == 2  # any one degree may be inferred
    with pytest.raises(ConfigError) as err:
        ParallelDims(8, dp_replicate=2, dp_shard=2, tp=3)
    for part in ("pp=1", "dp_replicate=2", "dp_shard=2", "cp=1", "tp=3", "= 12", "world_size=8"):
        assert part in str(err.value)
    with pytest.raises(ConfigError, match="only one parallel degree may be -1"):
        ParallelDims(8, tp=-1)  # dp_shard is -1 by default
    with pytest.raises(ConfigError, match=r"cannot infer pp: world_size=8 is not divisible by "
                                          r"dp_replicate=1 x dp_shard=3 = 3"):
        ParallelDims(8, dp_shard=3, pp=-1)
    with pytest.raises(RuntimeError, match="mesh is not built"):
        dims.get_mesh("tp")


def test_a_mesh_is_reused_while_its_process_group_lives(tmp_path: Any) -> None:
    """The next Trainer of a job (same degrees, same process group) reuses the mesh instead of creating
    its subgroups again; once the group is destroyed and made anew, the mesh is built over the new one,
    and teardown's release_mesh forgets every kept mesh."""
    import torch.distributed as dist

    from polytrain.parallel import dims as dims_module
    from polytrain.parallel.dims import ParallelDims

    if dist.is_initialized():
        pytest.skip("another test left a process group initialised")

    def make_group(n: int) -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{n}'}", rank=0, world_size=1)

    make_group(0)
    try:
        first = ParallelDims(1)
        mesh = first.build_mesh("cpu")
        second = ParallelDims(1)
        assert second.build_mesh("cpu") is mesh and second.get_mesh("fsdp") is first.get_mesh("fsdp")
    finally:
        dist.destroy_process_group()
    make_group(1)
    third = ParallelDims(1)
    try:
        assert third.build_mesh("cpu") is not mesh
        assert dist.get_world_size(third.get_mesh("dp").get_group()) == 1  # groups of the live process group
    finally:
        dist.destroy_process_group()
        third.release_mesh()
    assert not dims_module._BUILT


def test_parallel_degrees_are_checked_at_config_load_and_cp_refused_on_cpu() -> None:
    from polytrain.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cp=2 \(context parallel\) runs only on CUDA"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "cp": 2})
    with pytest.raises(ConfigError, match="schedule='pipes' is not known"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "pp": 2, "schedule": "pipes"})
    with pytest.raises(ConfigError,
                       match=r"schedule='zbv' splits backward .* use gpipe, 1f1b or interleaved_1f1b"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "pp": 2, "dp_shard": 2, "schedule": "zbv",
                                             "stages_per_rank": 2})
    # pp inferred (-1) may be more than one stage: the schedule is refused before the world size is known.
    with pytest.raises(ConfigError, match=r"schedule='zbv' splits backward"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "pp": -1, "dp_shard": 2, "schedule": "zbv",
                                             "stages_per_rank": 2})
    with pytest.raises(ConfigError, match="strategy 'parallel' has no option 'tp_size'"):
        Trainer(accelerator="cpu", strategy={"name": "parallel", "tp_size": 2})


def test_every_name_is_a_registered_class_and_lightning_names_still_work() -> None:
    from polytrain.strategies.registry import (
        _STRATEGIES,
        available_strategies,
        normalize_strategy,
        strategy_class,
    )

    assert available_strategies() == ["auto", "single", "dp", "ddp", "fsdp", "model_parallel", "pipeline",
                                      "parallel"]
    for name in _STRATEGIES:
        assert strategy_class(name).name == name
    assert normalize_strategy("ddp_find_unused_parameters_true") == {"name": "ddp",
                                                                     "find_unused_parameters": True}
    assert normalize_strategy("single_device") == {"name": "single"}
    trainer = Trainer(strategy="ddp_find_unused_parameters_true", accelerator="cpu")
    assert trainer.config.strategy["name"] == "ddp" and trainer.config.strategy["find_unused_parameters"]


def test_presets_compose_the_layouts_they_always_had() -> None:
    from polytrain.core.environment import ClusterEnvironment
    from polytrain.strategies.registry import build_strategy

    def build(spec: dict[str, Any], world: int = 8, nodes: int = 1) -> Any:
        return build_strategy(spec, accelerator="cpu", devices=world // nodes, num_nodes=nodes,
                              precision="32", timeout=10.0,
                              env=ClusterEnvironment(world_size=world, local_world_size=world // nodes))

    expected = {  # spec -> (pp, dp_replicate, dp_shard, tp, data parallel, sharded checkpoints)
        "ddp": (1, 8, 1, 1, "ddp", False),
        "fsdp": (1, 1, 8, 1, "fsdp", True),
        "pipeline": (8, 1, 1, 1, "all_reduce", True),  # a no-op with one replica
        "single": (1, 8, 1, 1, "none", False),  # started 8 times: independent replicas, as it always was
    }
    for name, (pp, rep, shard, tp, mode, sharded) in expected.items():
        s = build({"name": name})
        assert ((s.dims.pp, s.dims.dp_replicate, s.dims.dp_shard, s.dims.tp, s.data_parallel,
                 not s.replicated)
                == (pp, rep, shard, tp, mode, sharded)), name
    s = build({"name": "fsdp"}, nodes=2)  # one replica per node: HSDP
    assert (s.dims.dp_replicate, s.dims.dp_shard) == (2, 4)
    s = build({"name": "pipeline", "pp": 2})
    assert (s.dims.pp, s.dims.dp_size, s.data_parallel) == (2, 4, "all_reduce")
    s = build({"name": "model_parallel", "mode": "tensor", "tp": 2})
    assert (s.dims.tp, s.dims.dp_shard, s.data_parallel) == (2, 4, "fsdp")
    s = build({"name": "parallel", "pp": 2, "tp": 2})
    assert (s.dims.pp, s.dims.tp, s.dims.dp_shard, s.data_parallel) == (2, 2, 2, "fsdp")
    s = build({"name": "parallel", "dp_replicate": 8, "dp_shard": 1})
    assert s.data_parallel == "ddp" and s.replicated
    assert type(build({"name": "model_parallel"})).__name__ == "LayerPlacementStrategy"


def test_a_new_strategy_is_one_class_that_registers_itself() -> None:
    from dataclasses import dataclass

    from polytrain.parallel.apply import ParallelLayout
    from polytrain.strategies.composed import ParallelStrategy
    from polytrain.strategies.registry import _CLASSES, register, strategy_class, validate_strategy_spec

    @dataclass
    class TwoDOptions:
        tp: int = 2

    @register
    class TwoD(ParallelStrategy):  # FSDP x TP with one option: what a user's own preset looks like
        name = "two_d_test"
        Options = TwoDOptions

        @classmethod
        def compose(cls, options: Any, num_nodes: int) -> ParallelLayout:
            return ParallelLayout(tp=options.tp, dp_shard=-1)

    try:
        assert strategy_class("two_d_test") is TwoD
        assert validate_strategy_spec({"name": "two_d_test", "tp": 4}) == {"name": "two_d_test", "tp": 4}
        assert Trainer(strategy="two_d_test", accelerator="cpu").config.strategy == {"name": "two_d_test",
                                                                                     "tp": 2}
    finally:
        _CLASSES.pop("two_d_test")


@pytest.mark.distributed
@pytest.mark.timeout(1800)
def test_accumulation_and_clipping_compose_with_the_pipeline_and_fsdp(runs: dict[str, Any]) -> None:
    # 2 batches per optimizer step: FSDP inside each stage reduces on every schedule step (adding into the
    # sharded gradients), clipping by the norm over both stages and all shards.
    ranks = results(runs, "pp2_dp2 acc+clip")
    assert all(r["steps"] == HALF for r in ranks)
    check(ranks, runs["single acc+clip"], "pp2_dp2 accumulate 2 + clip")
