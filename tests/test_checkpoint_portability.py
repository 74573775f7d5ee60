"""Checkpoints are portable: any strategy at any world size loads any other's (DESIGN §4).

One 2-rank spawn trains with ddp, saves a replicated file, continues from it with fsdp and saves a
sharded (DCP) directory; the single-device and 1-rank fsdp loads, consolidation and the safety
checks then run in this process.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import pytest
import torch
from distributed import free_port, run_distributed
from test_fsdp import PER_RANK_BATCH, TOL, Net, full_state, quiet
from torch import nn
from torch.testing import assert_close

from polytrain import Trainer
from polytrain.checkpoint.consolidate import consolidate
from polytrain.checkpoint.layout import find_resumable
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.core.errors import CheckpointError

pytestmark = pytest.mark.torch_api

FIRST, SECOND = 6, 12  # ddp trains to step 6; fsdp continues to 12


def full_optimizer(trainer: Trainer) -> dict[str, Any]:
    """Every optimizer entry by parameter name, full tensors (a collective under fsdp)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    state = get_optimizer_state_dict(trainer.strategy.module, trainer.strategy.optimizers, options=options)
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _train(root: str, strategy: Any, devices: int, max_steps: int, ckpt: str | None = None) -> Trainer:
    module = Net(PER_RANK_BATCH)
    trainer = Trainer(strategy=strategy, devices=devices, **quiet(root, max_steps=max_steps))
    trainer.fit(module, ckpt_path=ckpt)
    return trainer


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ddp_file, fsdp_dir = os.path.join(root, "ddp.ckpt"), os.path.join(root, "fsdp-step12")
    ddp = _train(os.path.join(root, "ddp"), "ddp", 2, FIRST)
    ddp.save_checkpoint(ddp_file)
    reference = _train(os.path.join(root, "ddp-whole"), "ddp", 2, SECOND)  # never interrupted
    fsdp = _train(os.path.join(root, "fsdp"), "fsdp", 2, SECOND, ckpt=ddp_file)  # ddp(2) -> fsdp(2)
    fsdp.save_checkpoint(fsdp_dir)
    loaded = _train(os.path.join(root, "fsdp-load"), "fsdp", 2, FIRST, ckpt=ddp_file)  # loads, no steps
    return {"ddp": full_state(ddp.strategy.module), "ddp_optim": full_optimizer(ddp),
            "loaded": full_state(loaded.strategy.module), "loaded_optim": full_optimizer(loaded),
            "loaded_step": loaded.global_step, "reference": full_state(reference.strategy.module),
            "fsdp": full_state(fsdp.strategy.module), "fsdp_optim": full_optimizer(fsdp)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("portability"))
    ranks = run_distributed(_worker, 2, root, timeout=200.0)
    return {"root": root, "ranks": ranks, "file": os.path.join(root, "ddp.ckpt"),
            "dir": os.path.join(root, "fsdp-step12")}


def _same(actual: dict[str, Any], expected: dict[str, Any], what: str, exact: bool = True) -> None:
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            tol = {"rtol": 0.0, "atol": 0.0} if exact else TOL
            assert_close(actual[key], value, **tol, msg=lambda m, k=key: f"{what} {k}: {m}")
        else:
            assert actual[key] == value, f"{what} {key}"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ddp_file_loads_into_fsdp_and_training_continues(saved: dict[str, Any]) -> None:
    for run in saved["ranks"]:
        # Loaded exactly (weights and name-keyed optimizer state), step count restored...
        assert run["loaded_step"] == FIRST
        _same(run["loaded"], run["ddp"], "ddp -> fsdp weights")
        _same(run["loaded_optim"], run["ddp_optim"], "ddp -> fsdp optimizer")
        # ...and 6 more fsdp steps land where an uninterrupted ddp run does.
        _same(run["fsdp"], run["reference"], "continued under fsdp", exact=False)
    # The replicated file's model is a plain state_dict for a plain module.
    plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    weights = torch.load(saved["file"], weights_only=True)["model"]
    plain.load_state_dict({k[len("net."):]: v for k, v in weights.items() if k.startswith("net.")})


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_directory_loads_into_single_device(saved: dict[str, Any], tmp_path: Any) -> None:
    run = saved["ranks"][0]
    trainer = _train(str(tmp_path), "single", 1, SECOND, ckpt=saved["dir"])  # fsdp(2) -> single(1)
    assert trainer.global_step == SECOND
    _same(full_state(trainer.strategy.module), run["fsdp"], "fsdp -> single weights")
    _same(full_optimizer(trainer), run["fsdp_optim"], "fsdp -> single optimizer")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_directory_loads_into_one_rank_fsdp(saved: dict[str, Any], tmp_path: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A world of one still runs fully_shard over a 1-rank mesh (DTensor parameters).
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    run = saved["ranks"][0]
    trainer = _train(str(tmp_path), "fsdp", 1, SECOND, ckpt=saved["dir"])  # fsdp(2) -> fsdp(1)
    try:
        assert type(trainer.strategy.module.net[0]).__name__ == "FSDPLinear"
        _same(full_state(trainer.strategy.module), run["fsdp"], "fsdp(2) -> fsdp(1) weights")
        _same(full_optimizer(trainer), run["fsdp_optim"], "fsdp(2) -> fsdp(1) optimizer")
    finally:
        trainer.strategy.teardown()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_consolidate_writes_a_plain_state_dict(saved: dict[str, Any], tmp_path: Any) -> None:
    from polytrain.cli import main

    out = str(tmp_path / "weights.pt")
    assert main(["checkpoint", "consolidate", saved["dir"], out]) == 0  # no process group involved
    weights = torch.load(out, weights_only=True)
    module = Net(PER_RANK_BATCH)
    module.load_state_dict(weights)  # a plain TrainModule, strict
    _same(module.state_dict(), saved["ranks"][0]["fsdp"], "consolidated")
    # A replicated file consolidates too.
    _same(consolidate(saved["file"], str(tmp_path / "from-file.pt")), saved["ranks"][0]["ddp"], "from file")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torn_sharded_directory_is_never_resumed(saved: dict[str, Any], tmp_path: Any) -> None:
    import shutil

    ckpt_dir = tmp_path / "version_0" / "checkpoints"
    shutil.copytree(saved["dir"], ckpt_dir / "epoch=0-step=12")
    torn = ckpt_dir / "epoch=0-step=13"
    shutil.copytree(saved["dir"], torn)
    os.unlink(torn / "meta.pt")  # the save crashed before its last file
    assert find_resumable(str(ckpt_dir)) == str(ckpt_dir / "epoch=0-step=12")
    with pytest.raises(CheckpointError, match="incomplete.*meta.pt"):
        read_checkpoint(str(torn))


class _Marker:
    """Unpickling this would create a file: what a malicious checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_crafted_metadata_is_refused_before_anything_runs(saved: dict[str, Any], tmp_path: Any) -> None:
    import shutil

    evil = tmp_path / "evil"
    shutil.copytree(saved["dir"], evil)
    marker = tmp_path / "pwned"
    with open(evil / ".metadata", "wb") as fh:
        pickle.dump(_Marker(str(marker)), fh)
    # pickle names the builtin by its __module__: io.open up to Python 3.11, _io.open from 3.12.
    with pytest.raises(CheckpointError,
                       match=re.escape(f"refusing to load {open.__module__}.{open.__name__}")):
        consolidate(str(evil), str(tmp_path / "out.pt"))
    trainer = Trainer(strategy="single", devices=1, **quiet(str(tmp_path / "run")))
    with pytest.raises(CheckpointError, match="refusing"):
        trainer.validate(Net(PER_RANK_BATCH), ckpt_path=str(evil))
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def test_legacy_replicated_file_with_index_keyed_optimizers_still_loads(tmp_path: Any) -> None:
    trainer = _train(str(tmp_path / "a"), "single", 1, 3)
    module, optimizer = trainer.strategy.module, trainer.strategy.optimizers[0]
    legacy = {"polytrain": {"format": 1, "version": "0.1.0"}, "model": module.state_dict(),
              "optimizers": [optimizer.state_dict()],
              "loop": {"epoch": 0, "global_step": 3, "batch_in_epoch": 3, "world_size": 1, "dp_size": 1}}
    torch.save(legacy, tmp_path / "legacy.ckpt")
    resumed = _train(str(tmp_path / "b"), "single", 1, 3, ckpt=str(tmp_path / "legacy.ckpt"))
    _same(full_state(resumed.strategy.module), full_state(module), "legacy weights")
    _same(full_optimizer(resumed), full_optimizer(trainer), "legacy optimizer")
