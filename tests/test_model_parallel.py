"""``model_parallel`` trains exactly like one device, in both of its forms.

Layers mode: the Sequential's children spread over 2 "devices" of one process (on CPU both are
the CPU, which still runs the placement, the activation moves and the micro-batch pipelining),
with and without ``split_size``, and with DDP over 2 processes on top. Tensor mode: tp=2 on 2
ranks, and tp=2 x dp_shard=2 (FSDP over data) on 4 ranks. Every run is compared with a single-
device run on the same global batch: losses of 20 optimizer steps and the final weights within
1e-5. Distributed runs share one spawn per world layout (process start-up dominates).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Callback, Trainer, TrainModule
from polytrain.core.environment import ClusterEnvironment
from polytrain.core.precision import Precision
from polytrain.strategies.model_parallel import ModelParallelStrategy
from polytrain.trainer.configuration.config import ConfigError

pytestmark = pytest.mark.torch_api

NUM_SAMPLES = 160  # 20 global batches of 8: one epoch = 20 optimizer steps
GLOBAL_BATCH = 8
VAL_SAMPLES = 9  # one process: batches of 4, 4, 1; two data-parallel ranks: 5 and 4 samples
TOL = {"rtol": 0.0, "atol": 1e-5}
CLIP = 0.5


def _data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


class Block(nn.Module):
    """A residual MLP: ``fc`` column-parallel, ``proj`` row-parallel under tensor parallelism."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


class Classifier(TrainModule):
    def __init__(self, batch_size: int = GLOBAL_BATCH, plan: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.plan = plan
        self.batch_sums: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "net"):  # idempotent: called again by validate/test
            return
        # Built under the trainer's seed: every run starts from the same weights.
        self.net = nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.LayerNorm(16), nn.Linear(16, 3))

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if self.plan is not None:
            return self.plan
        return {"net.1.fc": ColwiseParallel(), "net.1.proj": RowwiseParallel(),
                "net.2.fc": ColwiseParallel(), "net.2.proj": RowwiseParallel()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batch_sums.append(float(x.sum()))
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True)  # mean over data-parallel ranks = global batch
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(NUM_SAMPLES, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(VAL_SAMPLES, 1), batch_size=4)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.losses[step] = metrics["train/loss"]


def _fit(run_dir: str, strategy: Any, batch_size: int = GLOBAL_BATCH, module: TrainModule | None = None,
         devices: Any = 1, **kwargs: Any) -> dict[str, Any]:
    module = module if module is not None else Classifier(batch_size)
    recorder = LossRecorder()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, run_dir=run_dir,
                      log_every_n_steps=1, callbacks=[recorder], seed=0, use_distributed_sampler="always",
                      **kwargs)
    trainer.fit(module)
    state = trainer.strategy.module_state_dict()  # every rank calls: it gathers under tensor parallelism
    return {
        "losses": [recorder.losses[s] for s in sorted(recorder.losses)],
        "state": {k: v.detach().cpu().clone() for k, v in state.items()} or None,
        "val": float(trainer.callback_metrics["val/loss"]),
        "batch_sums": getattr(module, "batch_sums", []),
        "trainer": trainer,
    }


def _check(run: dict[str, Any], single: dict[str, Any], what: str) -> None:
    assert len(run["losses"]) == len(single["losses"]) == 20, what
    assert_close(torch.tensor(run["losses"]), torch.tensor(single["losses"]), **TOL,
                 msg=lambda m: f"{what}: {m}")
    assert single["losses"][-1] < single["losses"][0]  # it trained: parity of frozen weights proves nothing
    if run["state"] is None:  # a rank that does not hold the gathered model (tensor mode, rank > 0)
        return _check_val(run, single, what)
    assert run["state"].keys() == single["state"].keys(), what
    for name, value in single["state"].items():
        assert_close(run["state"][name], value, **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")
    _check_val(run, single, what)


def _check_val(run: dict[str, Any], single: dict[str, Any], what: str) -> None:
    assert abs(run["val"] - single["val"]) < 1e-5, (what, run["val"], single["val"])


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("single"))
    runs = {"plain": _fit(os.path.join(root, "plain"), "single"),
            "clip": _fit(os.path.join(root, "clip"), "single", gradient_clip_val=CLIP)}
    runs["plain"]["ckpt"] = os.path.join(root, "single.ckpt")
    runs["plain"]["trainer"].save_checkpoint(runs["plain"]["ckpt"])  # a replicated file, for tensor mode
    # to load
    return runs


# --------------------------------------------------------------------------- layers mode


@pytest.mark.parametrize("options", [{}, {"split_size": 3}, {"split_points": [2], "split_size": 5}],
                         ids=["balanced", "split_size", "split_points"])
def test_layers_on_two_cpu_devices_match_single(single: dict[str, Any], tmp_path: Any,
                                                options: dict[str, Any]) -> None:
    run = _fit(str(tmp_path), {"name": "model_parallel", "mode": "layers", "devices_per_process": 2,
                               **options},
               devices=2)
    placed = run["trainer"].strategy.module.net
    assert type(placed).__name__ == "PlacedSequential"
    assert placed.split_size == options.get("split_size")
    assert placed.bounds == [0, options.get("split_points", [2])[0], 5]  # 5 children over 2 devices
    assert type(placed[1:3]).__name__ == "Sequential" and placed[1] is placed[1:3][0]  # slicing still works
    _check(run, single["plain"], f"layers {options}")


class TwoHalves(Classifier):
    """The seed notes' model-parallel pattern: two halves, each placed by the module itself."""

    def configure_model(self) -> None:
        super().configure_model()
        self.placed_on: list[str] = []

    def place_layers(self, devices: list[torch.device]) -> None:
        self.first, self.second = devices[0], devices[-1]
        self.net[:2].to(self.first)
        self.net[2:].to(self.second)
        self.placed_on = [str(d) for d in devices]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.net[:2](x.to(self.first)).to(self.second)
        loss = F.cross_entropy(self.net[2:](hidden), y.to(self.second))
        self.log("train/loss", loss)
        return loss


def test_layers_place_layers_hook_matches_single(single: dict[str, Any], tmp_path: Any) -> None:
    module = TwoHalves()
    run = _fit(str(tmp_path), {"name": "model_parallel", "devices_per_process": 2}, module=module, devices=2)
    assert module.placed_on == ["cpu", "cpu"]
    assert (isinstance(module.net, nn.Sequential)
            and type(module.net).__name__ == "Sequential")  # not re-placed
    _check(run, single["plain"], "place_layers")


def _layers_ddp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    strategy = {"name": "model_parallel", "mode": "layers", "devices_per_process": 2, "split_size": 2}
    run = _fit(os.path.join(root, "layers-ddp"), strategy, batch_size=GLOBAL_BATCH // world_size,
               devices="auto")
    strat = run.pop("trainer").strategy
    run["wrapper"] = type(strat.model).__name__
    run["dp"] = (strat.dp_rank, strat.dp_size)
    return run


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_layers_with_ddp_over_two_processes_matches_single(single: dict[str, Any], tmp_path: Any) -> None:
    runs = run_distributed(_layers_ddp_worker, 2, str(tmp_path), timeout=150.0)
    assert [r["wrapper"] for r in runs] == ["DistributedDataParallel"] * 2
    assert [r["dp"] for r in runs] == [(0, 2), (1, 2)]
    for rank, run in enumerate(runs):
        _check(run, single["plain"], f"layers+ddp rank {rank}")


# --------------------------------------------------------------------------- tensor mode


def _tensor_worker(rank: int, world_size: int, root: str, strategy: dict[str, Any], batch_size: int,
                   clip: float | None, single_ckpt: str | None = None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    run = _fit(os.path.join(root, "tensor"), strategy, batch_size=batch_size, devices="auto",
               gradient_clip_val=clip)
    trainer = run.pop("trainer")
    module = trainer.strategy.module
    run["dp"] = (trainer.strategy.dp_rank, trainer.strategy.dp_size)
    run["fc_local_shape"] = tuple(module.net[1].fc.weight.to_local().shape)
    run["fc_is_dtensor"] = isinstance(module.net[1].fc.weight, DTensor)
    run["val_batches"] = trainer.num_val_batches
    if _has_sharded_io():
        trainer.save_checkpoint(os.path.join(root, "tp.ckpt"))
    if single_ckpt is not None:  # the other direction: a one-device file into the sharded model
        trainer.strategy.load_checkpoint(single_ckpt)
        run["loaded_single"] = {k: v.clone() for k, v in trainer.strategy.module_state_dict().items()} or None
    return run


def _has_sharded_io() -> bool:
    import importlib.util

    return importlib.util.find_spec("polytrain.checkpoint.sharded") is not None


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory, single: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("tp2"))
    strategy = {"name": "model_parallel", "mode": "tensor", "tp": 2}
    return root, run_distributed(_tensor_worker, 2, root, strategy, GLOBAL_BATCH, CLIP,
                                 single["plain"]["ckpt"], timeout=150.0)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_tensor_parallel_two_ranks_matches_single(single: dict[str, Any], tp2: Any) -> None:
    _, runs = tp2
    for rank, run in enumerate(runs):
        assert run["fc_is_dtensor"] and run["fc_local_shape"] == (32, 16)  # 64 output rows, half each
        assert run["dp"] == (0, 1)  # one data-parallel replica: both ranks see every batch
        assert run["val_batches"] == [3]
        _check(run, single["clip"], f"tp=2 rank {rank}")  # with DTensor-aware gradient clipping
    assert runs[0]["batch_sums"] == runs[1]["batch_sums"]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_tensor_checkpoint_loads_into_single_device(single: dict[str, Any], tp2: Any, tmp_path: Any) -> None:
    if not _has_sharded_io():
        pytest.skip("polytrain/strategies/sharded_io.py does not exist yet: no sharded checkpoint to "
                    "round-trip")
    root, runs = tp2
    module = Classifier()
    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, run_dir=str(tmp_path))
    trainer.validate(module, ckpt_path=os.path.join(root, "tp.ckpt"))
    for name, value in runs[0]["state"].items():
        assert_close(module.state_dict()[name], value, rtol=0.0, atol=0.0, msg=lambda m, n=name: f"{n}: {m}")
    assert abs(float(trainer.callback_metrics["val/loss"]) - runs[0]["val"]) < 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_single_device_checkpoint_loads_into_tensor_parallel(single: dict[str, Any], tp2: Any) -> None:
    _, runs = tp2
    assert runs[1]["loaded_single"] is None  # gathered on rank 0 only
    for name, value in single["plain"]["state"].items():
        assert_close(runs[0]["loaded_single"][name], value, rtol=0.0, atol=0.0,
                     msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tensor_2d_tp2_x_fsdp2_on_four_ranks_matches_single(single: dict[str, Any], tmp_path: Any) -> None:
    strategy = {"name": "model_parallel", "mode": "tensor", "tp": 2, "dp_shard": 2}
    runs = run_distributed(_tensor_worker, 4, str(tmp_path), strategy, GLOBAL_BATCH // 2, None, timeout=220.0)
    assert [r["dp"] for r in runs] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # tp neighbours share a data rank
    # 64 fc rows: split in two by tp, and each half in two again by FSDP over the data dimension.
    assert runs[0]["fc_local_shape"] == (16, 16)
    assert runs[0]["batch_sums"] == runs[1]["batch_sums"] and runs[2]["batch_sums"] == runs[3]["batch_sums"]
    assert runs[0]["batch_sums"] != runs[2]["batch_sums"]
    for rank, run in enumerate(runs):
        # Evaluation splits over dp only: 5 samples (2 batches) and 4 samples (1 batch). FSDP gathers in
        # every forward, so the short data rank repeats a padding batch whose logs are discarded:
        # both run 2, and the metric still equals the single-device mean over 9 samples.
        assert run["val_batches"] == [2]
        assert (run["state"] is None) == (rank > 0)  # the gathered model lands on rank 0 only
        _check(run, single["plain"], f"2D rank {rank}")


# --------------------------------------------------------------------------- errors and options


def test_plan_naming_a_missing_submodule_fails_before_any_process_group(tmp_path: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    module = Classifier(plan={"net.1.fc": ColwiseParallel(), "net.7.fc": ColwiseParallel()})
    with pytest.raises(ConfigError, match=r"'net\.7\.fc'.*no submodule.*tensor_parallel_plan"):
        _fit(str(tmp_path), {"name": "model_parallel", "mode": "tensor"}, module=module)
    assert not dist.is_initialized()


def test_plan_values_must_be_parallel_styles(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"'net\.1\.fc' is a str, not a ParallelStyle"):
        _fit(str(tmp_path), {"name": "model_parallel", "mode": "tensor"},
             module=Classifier(plan={"net.1.fc": "colwise"}))


def _strategy(world_size: int, **options: Any) -> ModelParallelStrategy:
    # ``build``, as the registry does: mode "layers" is LayerPlacementStrategy's.
    return ModelParallelStrategy.build(ModelParallelStrategy.Options(**options), accelerator="cpu",
                                       devices=world_size, num_nodes=1,
                                       precision=Precision.for_accelerator("32", "cpu"), timeout=30.0,
                                       env=ClusterEnvironment(world_size=world_size,
                                                              local_world_size=world_size))


def test_degrees_that_do_not_multiply_to_the_world_size_print_every_number() -> None:
    with pytest.raises(ConfigError) as err:
        _strategy(4, mode="tensor", tp=2, dp_shard=3).setup_environment()
    for part in ("pp=1", "dp_replicate=1", "dp_shard=3", "tp=2", "= 6", "world_size=4"):
        assert part in str(err.value)
    with pytest.raises(ConfigError, match=r"world_size=4 is not divisible by dp_replicate=1 x tp=3"):
        _strategy(4, mode="tensor", tp=3).setup_environment()
    with pytest.raises(ConfigError, match=r"cannot infer tp: world_size=4 is not divisible by "
                                          r"dp_replicate=1 x dp_shard=3 = 3"):
        _strategy(4, mode="tensor", dp_shard=3).setup_environment()
    assert not dist.is_initialized()


def test_processes_per_node_and_option_checks() -> None:
    cls = ModelParallelStrategy
    assert cls.processes_per_node(4, {"mode": "layers", "devices_per_process": 2}) == 2
    assert cls.processes_per_node(8, cls.Options(devices_per_process=4)) == 2
    assert cls.processes_per_node(4, {"mode": "tensor"}) == 4
    with pytest.raises(ConfigError, match="devices=3 is not a multiple of .*devices_per_process=2"):
        cls.processes_per_node(3, {"mode": "layers", "devices_per_process": 2})
    with pytest.raises(ConfigError, match="mode='pipes' is not valid; choose one of: layers, tensor"):
        Trainer(strategy={"name": "model_parallel", "mode": "pipes"})
    with pytest.raises(ConfigError, match="tp=2.*apply to mode: tensor"):
        Trainer(strategy={"name": "model_parallel", "tp": 2})
    with pytest.raises(ConfigError, match="split_size=4.*apply to mode: layers"):
        Trainer(strategy={"name": "model_parallel", "mode": "tensor", "split_size": 4})


def _place(**options: Any) -> None:
    strategy = _strategy(1, **options)
    strategy.setup_environment()
    module = Classifier()
    module.configure_model()
    strategy.setup_module(module)


def test_layers_errors_name_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"5 children on 6 devices: 1 device\(s\) would hold nothing"):
        _place(devices_per_process=6)
    with pytest.raises(ConfigError, match=r"split_points=\[4, 2\] do not cut 5 children into 3 non-empty"):
        _place(devices_per_process=3, split_points=[4, 2])
    with pytest.raises(ConfigError, match=r"has 0 nn.Sequential children \(none\).*sequential=<attribute>"):
        strategy = _strategy(1)
        strategy.setup_environment()
        strategy.setup_module(TrainModule())


# --------------------------------------------------------------------------- real GPUs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_layers_on_two_gpus_match_one_gpu(tmp_path: Any) -> None:
    kwargs = dict(accelerator="cuda", max_epochs=1, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, log_every_n_steps=1)
    runs = {}
    for name, strategy, devices in [("one", "single", 1),
                                    ("two", {"name": "model_parallel", "devices_per_process": 2,
                                             "split_size": 3}, 2)]:
        module, recorder = Classifier(), LossRecorder()
        Trainer(strategy=strategy, devices=devices, run_dir=str(tmp_path / name), callbacks=[recorder],
                seed=0, **kwargs).fit(module)
        runs[name] = (recorder.losses, module)
    placed = runs["two"][1].net
    assert {str(p.device) for p in placed[0].parameters()} == {"cuda:0"}
    assert {str(p.device) for p in placed[-1].parameters()} == {"cuda:1"}
    assert_close(torch.tensor(list(runs["two"][0].values())), torch.tensor(list(runs["one"][0].values())),
                 rtol=0.0, atol=1e-4)
