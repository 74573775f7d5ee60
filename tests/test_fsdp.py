"""FSDP (``fully_shard``) on real gloo ranks must train like one process on the same global batch.

Ranks see per-rank batch b and one process 2b (4b for the 4-rank HSDP run): the injected sampler
deals the shuffled permutation round-robin, so global batch k holds the same samples in both runs,
and FSDP's reduce-scatter averages the ranks' gradients of per-rank mean losses, which is the
gradient of the global mean loss. Float32 results may differ only in summation order (< 1e-5).

Every variant of one world size runs inside one spawn: process start-up (~5 s of torch import per
rank on this machine) dominates the cost of these tiny runs.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from fsdp_state import fsdp_units
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.torch_api

PER_RANK_BATCH = 2
NUM_SAMPLES = 48  # 12 global batches of 4 per epoch: 20 steps cross an epoch boundary
STEPS = 20
TOL = {"rtol": 0.0, "atol": 1e-5}
# Mixed precision: the sharded run rounds each rank's half-batch gradient to bf16/fp16 before the
# fp32 reduce-scatter, one process rounds the whole batch's once, so gradients differ by ~2^-8
# (bf16) or ~2^-11 (fp16) relative. Adam divides by sqrt(v): for entries whose gradient is near
# zero that rounding noise becomes a step of up to lr=0.01, so a weight may drift by about one
# such step over the run (measured: 9e-3 bf16, 9e-5 fp16); losses, averages over many weights,
# move far less (measured: 4e-4 bf16, 3e-5 fp16). Tolerances sit ~2x above those figures.
BF16_TOL = ({"rtol": 0.0, "atol": 1e-3}, {"rtol": 0.0, "atol": 2e-2})  # (losses, weights)
FP16_TOL = ({"rtol": 0.0, "atol": 1e-4}, {"rtol": 0.0, "atol": 2e-4})
FSDP = {"name": "fsdp"}

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "accumulate": {"accumulate_grad_batches": 2},
    "clip": {"gradient_clip_val": 0.05},
    "meta": {"build_now": False},  # layers built in configure_model: on the meta device under fsdp
    "bf16": {"precision": "bf16-mixed"},
    "fp16": {"precision": "16-mixed"},
    # Options that change where state lives and when it is gathered, not the arithmetic.
    "options": {"fsdp": {"cpu_offload": True, "reshard_after_forward": False}},
}
_MODULE_KEYS = ("build_now", "dropout", "poison_step")


def dataset(num_samples: int, seed: int = 1234) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 6, generator=gen)
    y = x[:, :1] * 0.3 - x[:, 1:2] * 0.2 + 0.05 * torch.randn(num_samples, 1, generator=gen)
    return TensorDataset(x, y)


class Net(TrainModule):
    """Three Linear blocks in a Sequential (FSDP units) plus a head the root unit owns."""

    def __init__(self, batch_size: int, num_samples: int = NUM_SAMPLES, build_now: bool = True,
                 dropout: float = 0.0, val_samples: int = 5, lr: float = 0.01,
                 poison_step: int | None = None) -> None:
        super().__init__()
        self.batch_size, self.num_samples, self.val_samples = batch_size, num_samples, val_samples
        self.dropout, self.lr, self.poison_step = dropout, lr, poison_step
        self.losses: list[torch.Tensor] = []
        self.post_clip_norms: list[float] = []
        self.net: nn.Module | None = None
        if build_now:
            torch.manual_seed(0)
            self._build()

    def _build(self) -> None:
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(self.dropout), nn.Linear(16, 16),
                                 nn.Tanh(), nn.Linear(16, 4))
        self.head = nn.Linear(4, 1)  # [1, 4] weight: one row for rank 0, an empty shard for rank 1
        # The dtype a block's weight has while its forward runs: FSDP's mixed precision gathers it
        # in bf16/fp16 (autocast alone would leave it fp32), so this sees whether the policy applied.
        self.weight_dtypes: set[str] = set()
        for layer in (self.net[0], self.head):
            layer.register_forward_pre_hook(lambda mod, args: self.weight_dtypes.add(str(mod.weight.dtype)))

    def configure_model(self) -> None:
        if self.net is None:
            self._build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.detach().float().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_after_backward(self) -> None:
        if self.poison_step == len(self.losses) - 1 and self.global_rank == 1:
            # An overflow in one rank's shard only: the scaler must skip the step on every rank.
            self.net[0].weight.grad.to_local().view(-1)[0] = float("inf")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.post_clip_norms.append(float(global_grad_norm(self)))  # what the update sees

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.num_samples), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.val_samples, seed=99), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


def global_grad_norm(module: nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on every rank (a collective under fsdp), as plain CPU tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in state.items()}


def quiet(root: str, **kwargs: Any) -> dict[str, Any]:
    defaults = dict(accelerator="cpu", run_dir=root, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, log_every_n_steps=1, max_steps=STEPS, seed=0,
                    use_distributed_sampler="always")
    return {**defaults, **kwargs}


def fit(root: str, strategy: Any, batch_size: int, devices: Any, **settings: Any) -> dict[str, Any]:
    module_kwargs = {k: settings.pop(k) for k in _MODULE_KEYS if k in settings}
    module = Net(batch_size, **module_kwargs)
    trainer = Trainer(strategy=strategy, devices=devices, **quiet(root, **settings))
    trainer.fit(module)
    scaler = trainer.strategy.precision.scaler
    return {"losses": [float(x) for x in module.losses], "state": full_state(module),
            "norms": module.post_clip_norms, "weight_dtypes": sorted(module.weight_dtypes),
            "scale": float(scaler.get_scale()) if scaler else None,
            "module": module, "trainer": trainer}


def _eval_checks(root: str) -> dict[str, Any]:
    """5 validation samples, batch 2, 2 ranks: rank 0 holds 2 batches, rank 1 one plus a padding one."""
    run = fit(os.path.join(root, "eval"), FSDP, PER_RANK_BATCH, 2, max_steps=3)
    trainer, module = run["trainer"], run["module"]
    metrics = trainer.validate(module)[0]
    preds = trainer.predict(module)
    return {"val": metrics["val/loss"], "val_batches": len(trainer.strategy.process_dataloader(
        module.val_dataloader(), "val", 0, True)), "preds": [None if p is None else p.clone() for p in preds],
        "state": run["state"]}


def _two_rank_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, settings in VARIANTS.items():
        settings = dict(settings)
        strategy = {**FSDP, **settings.pop("fsdp", {})}
        run = fit(os.path.join(root, name), strategy, PER_RANK_BATCH, world_size, **settings)
        module, strategy = run.pop("module"), run.pop("trainer").strategy
        run["wrapped"] = sorted({type(m).__name__ for m in strategy.model.modules()
                                 if type(m).__name__.startswith("FSDP")})
        run["dp"] = (strategy.dp_rank, strategy.dp_size)
        run["local_rows"] = module.net[0].weight.to_local().shape[0]
        run["units"] = fsdp_units(strategy.model)
        out[name] = run
    poisoned = fit(os.path.join(root, "fp16_inf"), FSDP, PER_RANK_BATCH, world_size, precision="16-mixed",
                   poison_step=3, max_steps=6)
    out["fp16_inf"] = {"scale": poisoned["scale"], "steps": poisoned["trainer"].global_step}
    out["eval"] = _eval_checks(root)
    return out


def single_run(root: str, batch_size: int, **settings: Any) -> dict[str, Any]:
    run = fit(root, "single", batch_size, 1, **settings)
    run.pop("trainer"), run.pop("module")
    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("fsdp2"))
    ranks = run_distributed(_two_rank_worker, 2, root, timeout=200.0)
    single = {name: single_run(os.path.join(root, "single", name), 2 * PER_RANK_BATCH,
                               **{k: v for k, v in settings.items() if k != "fsdp"})
              for name, settings in VARIANTS.items()}
    return {"ranks": ranks, "single": single, "root": root}


def _check_parity(two_ranks: dict[str, Any], variant: str, tol: tuple[dict, dict] = (TOL, TOL)) -> None:
    ranks, single = [r[variant] for r in two_ranks["ranks"]], two_ranks["single"][variant]
    # Each rank's loss is its half-batch mean; their average is the global batch's mean loss.
    mean_losses = [sum(vals) / len(vals) for vals in zip(*(r["losses"] for r in ranks))]
    assert len(mean_losses) == len(single["losses"]) >= STEPS
    assert_close(torch.tensor(mean_losses), torch.tensor(single["losses"]), **tol[0])
    for rank, run in enumerate(ranks):
        assert run["state"].keys() == single["state"].keys()
        for name, value in single["state"].items():
            assert_close(run["state"][name], value, **tol[1],
                         msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_matches_single_device(two_ranks: dict[str, Any]) -> None:
    _check_parity(two_ranks, "plain")
    run = two_ranks["ranks"][0]["plain"]
    # The Sequential's three Linear blocks are units of their own; the router is the root unit.
    assert run["wrapped"] == ["FSDPLinear", "FSDPStepRouter"]
    assert [r["plain"]["dp"] for r in two_ranks["ranks"]] == [(0, 2), (1, 2)]
    assert run["local_rows"] == 8  # Linear(6, 16): 16 rows, half on each rank
    units = run["units"]
    assert sorted(units) == ["<root>", "module.net.0", "module.net.3", "module.net.5"]
    for name, unit in units.items():
        assert unit["param_dtype"] == unit["reduce_dtype"] == {"None"}, (name, unit)  # fp32: no casts
        assert unit["offload"] == ("OffloadPolicy", {False}), (name, unit)
        # blocks free after forward; the root stays
        assert unit["reshard"] is (name != "<root>"), (name, unit)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_cpu_offload_and_no_reshard_match_single_device(two_ranks: dict[str, Any]) -> None:
    _check_parity(two_ranks, "options")
    for run in two_ranks["ranks"]:
        units = run["options"]["units"]
        assert len(units) == 4
        for name, unit in units.items():
            # The options reached fully_shard on every unit, not only the config.
            assert unit["offload"] == ("CPUOffloadPolicy", {True}), (name, unit)
            assert unit["reshard"] is False, (name, unit)
            assert unit["devices"] == unit["grad_devices"] == {"cpu"}, (name, unit)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_gradient_accumulation_matches_single_device(two_ranks: dict[str, Any]) -> None:
    _check_parity(two_ranks, "accumulate")
    assert len(two_ranks["single"]["accumulate"]["norms"]) == STEPS  # 40 micro-batches, 20 steps


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_gradient_clipping_uses_the_global_norm(two_ranks: dict[str, Any]) -> None:
    _check_parity(two_ranks, "clip")
    unclipped = two_ranks["single"]["plain"]["norms"]
    assert min(unclipped) > 0.05  # so every step really was clipped
    for run in two_ranks["ranks"]:
        # The whole model's gradient norm after clipping: a per-shard norm would leave it above 0.05.
        assert max(run["clip"]["norms"]) <= 0.05 + 1e-6
        assert_close(torch.tensor(run["clip"]["norms"]), torch.tensor(two_ranks["single"]["clip"]["norms"]),
                     **TOL)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_meta_device_init_equals_a_cpu_build(two_ranks: dict[str, Any]) -> None:
    # Built on meta, materialised shard by shard: same init (hence same run) as building on CPU.
    _check_parity(two_ranks, "meta")
    assert_close(two_ranks["ranks"][0]["meta"]["state"]["net.0.weight"],
                 two_ranks["single"]["meta"]["state"]["net.0.weight"], **TOL)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_bf16_mixed_matches_single_device_bf16_mixed(two_ranks: dict[str, Any]) -> None:
    _check_parity(two_ranks, "bf16", BF16_TOL)
    for run in two_ranks["ranks"]:
        assert all(v.dtype == torch.float32 for v in run["bf16"]["state"].values())  # fp32 master weights
        # The tolerances alone would pass an fp32 run, so check bf16 really was used: FSDP gathers
        # the weights in bf16 for forward (one process under autocast keeps them fp32) and reduces
        # gradients in fp32, on every unit.
        assert run["bf16"]["weight_dtypes"] == ["torch.bfloat16"]
        for name, unit in run["bf16"]["units"].items():
            assert (unit["param_dtype"] == {"torch.bfloat16"}
                    and unit["reduce_dtype"] == {"torch.float32"}), name
    assert two_ranks["single"]["bf16"]["weight_dtypes"] == ["torch.float32"]
    # And the arithmetic differs from fp32 by far more than fp32's own summation-order noise (1e-5).
    bf16, fp32 = (torch.tensor(two_ranks["ranks"][0][v]["losses"]) for v in ("bf16", "plain"))
    assert (bf16 - fp32).abs().max() > 1e-4


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_16_mixed_grad_scaler_works_with_sharded_gradients(two_ranks: dict[str, Any]) -> None:
    # torch's GradScaler unscales DTensor gradients; no overflow in this run, so same scale as one process.
    _check_parity(two_ranks, "fp16", FP16_TOL)
    for run in two_ranks["ranks"]:
        assert run["fp16"]["weight_dtypes"] == ["torch.float16"]
        assert {str(u["param_dtype"]) for u in run["fp16"]["units"].values()} == {"{'torch.float16'}"}
    scales = [r["fp16"]["scale"] for r in two_ranks["ranks"]]
    assert scales == [two_ranks["single"]["fp16"]["scale"]] * 2
    # An inf planted in rank 1's shard only: found_inf is reduced over the shards, so both ranks
    # skip that step and halve the scale (a per-shard decision would leave rank 0 at 65536).
    assert [r["fp16_inf"]["scale"] for r in two_ranks["ranks"]] == [32768.0, 32768.0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_evaluation_with_uneven_shares_equals_one_process(two_ranks: dict[str, Any],
                                                               tmp_path: Any) -> None:
    rank0, rank1 = (r["eval"] for r in two_ranks["ranks"])
    assert rank0["val_batches"] == rank1["val_batches"] == 2  # both ranks run 2 forwards: no hang
    # One process with the trained weights over all 5 samples.
    module = Net(2 * PER_RANK_BATCH)
    module.load_state_dict(rank0["state"])
    trainer = Trainer(strategy="single", devices=1, **quiet(str(tmp_path)))
    expected = trainer.validate(module)[0]["val/loss"]
    assert abs(rank0["val"] - expected) < 1e-6 and abs(rank1["val"] - expected) < 1e-6
    # Predictions: rank 0 has samples 0, 2, 4; rank 1 has 1, 3. Its padding batch ran (the forward
    # all-gathers) but is not among the predictions.
    assert len(rank1["preds"]) == 1 and rank1["preds"][0] is not None
    with torch.no_grad():
        full = module(dataset(5, seed=99).tensors[0])
    assert_close(torch.cat(rank0["preds"]), full[0::2], **TOL)
    assert_close(rank1["preds"][0], full[1::2], **TOL)


# --------------------------------------------------------------------------- HSDP on 4 ranks


def _hsdp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    strategy = {"name": "fsdp", "dp_replicate": 2, "wrap_modules": ["Linear"]}
    run = fit(root, strategy, 1, "auto")
    module, strategy = run.pop("module"), run.pop("trainer").strategy
    weight = module.net[0].weight
    run.update(dp=(strategy.dp_rank, strategy.dp_size), mesh=tuple(strategy.fsdp_mesh.shape),
               placements=[repr(p) for p in weight.placements], local_rows=weight.to_local().shape[0])
    return run


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hsdp_two_replicas_of_two_shards_matches_single_device(tmp_path: Any) -> None:
    ranks = run_distributed(_hsdp_worker, 4, str(tmp_path / "hsdp"), timeout=240.0)
    single = single_run(str(tmp_path / "single"), 4)
    assert [r["dp"] for r in ranks] == [(r, 4) for r in range(4)]
    for rank, run in enumerate(ranks):
        assert run["mesh"] == (2, 2) and run["placements"] == ["Replicate()", "Shard(dim=0)"]
        assert run["local_rows"] == 8  # sharded over 2 ranks, replicated over the other 2
        for name, value in single["state"].items():
            assert_close(run["state"][name], value, **TOL, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
    mean_losses = [sum(v) / 4 for v in zip(*(r["losses"] for r in ranks))]
    assert_close(torch.tensor(mean_losses), torch.tensor(single["losses"]), **TOL)


# --------------------------------------------------------------------------- exact resume


def _resume_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from polytrain.core.errors import CheckpointError

    common = dict(dropout=0.2, max_steps=18)  # dropout: the restored per-rank RNG streams matter
    whole = fit(os.path.join(root, "whole"), FSDP, PER_RANK_BATCH, 2, **common)
    part = os.path.join(root, "part")
    first = fit(part, FSDP, PER_RANK_BATCH, 2, **{**common, "max_steps": 7}, enable_checkpointing=True)
    module = Net(PER_RANK_BATCH, dropout=0.2)
    trainer = Trainer(strategy=FSDP, devices=2, **quiet(part, max_steps=18, enable_checkpointing=True))
    trainer.fit(module, ckpt_path="last")  # stopped at step 7 of 12 in epoch 0: resumes mid-epoch
    not_a_dir = os.path.join(root, "plain-file")
    if rank == 0:
        open(not_a_dir, "w").close()
    trainer.strategy.barrier()
    try:
        trainer.save_checkpoint(os.path.join(not_a_dir, "ckpt"))
        error = None
    except CheckpointError as err:
        error = str(err)
    return {"whole": whole["state"], "whole_losses": whole["losses"], "first_losses": first["losses"],
            "resumed": full_state(module), "resumed_losses": [float(x) for x in module.losses],
            "steps": trainer.global_step, "error": error,
            "checkpoints": sorted(os.listdir(os.path.join(part, "version_0", "checkpoints")))}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_resume_mid_epoch_is_bitwise_equal_to_an_uninterrupted_run(tmp_path: Any) -> None:
    ranks = run_distributed(_resume_worker, 2, str(tmp_path), timeout=240.0)
    for rank, run in enumerate(ranks):
        assert run["steps"] == 18
        assert run["first_losses"] + run["resumed_losses"] == run["whole_losses"]
        for name, value in run["whole"].items():
            assert torch.equal(run["resumed"][name], value), f"rank {rank} {name} differs after resume"
        # Sharded checkpoints are directories; no temporary directory is left behind.
        assert [n for n in run["checkpoints"] if n.startswith(".tmp") or ".tmp-" in n] == []
        # The resumed run pruned the first run's checkpoint (save_top_k=1): only its own is left.
        assert run["checkpoints"] == ["epoch=1-step=18", "latest"]
        # An unwritable destination: every rank raises the same error instead of some hanging.
        assert run["error"] is not None and "plain-file" in run["error"]
    assert ranks[0]["error"] == ranks[1]["error"]
    ckpt = tmp_path / "part" / "version_0" / "checkpoints" / "epoch=1-step=18"
    assert sorted(os.listdir(ckpt)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json",
                                        "meta.pt"]
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    assert meta["loop"]["global_step"] == 18 and meta["loop"]["batch_in_epoch"] == 6 and "model" not in meta


class _ViewHead(TrainModule):
    """Sequences through a Linear with a bias: on 3-D input its output is a view (``addmm`` then ``view``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.head(self.body(x)).square().mean()  # out of place: what FSDP supports on a view

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 5, 4)), batch_size=4)


def test_a_unit_returning_a_view_is_said_once_in_polytrain_words(tmp_path: Any,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  recwarn: pytest.WarningsRecorder) -> None:
    """torch (2.14 on) warns from every rank, at every unit returning a view, that an in-place op on it
    would skip the unit's all-gather; polytrain says it once, naming the units and what is safe, and torch's
    text is not shown (torch 2.11 says nothing of it: polytrain's line is the only word there)."""
    import logging

    trainer = Trainer(strategy={"name": "fsdp", "wrap_modules": ["Linear"]}, devices=1,
                      **quiet(str(tmp_path), max_steps=2))
    try:
        with caplog.at_level(logging.INFO, logger="polytrain"):
            trainer.fit(_ViewHead())
    finally:
        trainer.strategy.teardown()  # fsdp joins a process group even on one process: leave none behind
    said = [r.getMessage() for r in caplog.records if "return a view" in r.getMessage()]
    assert said == ["fsdp: 3 unit(s) return a view: body.0 (Linear), body.1 (Linear), head (Linear); "
                    "computing from it out of place (a loss, `out = out + y`) is what FSDP supports: an "
                    "in-place op on it (`out += y`) would skip the unit's all-gather in backward "
                    "(torch's warning of this is left out)"], said
    assert not [w for w in recwarn if "returned a view tensor" in str(w.message)]


def test_one_process_fsdp_takes_no_port(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsdp on one process that no launcher started meets in memory: with torch's default port held by
    another program (and no MASTER_PORT given), it trains; a TCP store there would fail on the port."""
    import socket

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 29500))
        holder.listen()
    except OSError:
        pass  # held already by another program: the same situation
    trainer = Trainer(strategy="fsdp", devices=1, **quiet(str(tmp_path), max_steps=2))
    try:
        trainer.fit(_ViewHead())
        assert trainer.global_step == 2 and torch.distributed.get_world_size() == 1
        assert "MASTER_PORT" not in os.environ
    finally:
        trainer.strategy.teardown()
        holder.close()
