"""Stateful training data (``state_dict``/``load_state_dict`` on the DataLoader or its dataset): the
checkpoint holds each data-parallel rank's state, a resume loads it instead of replaying the consumed
batches (the data produced after a resume is only what was left), the run ends bitwise equal to the
uninterrupted one, and a resume at another data-parallel size is refused.

Streams: an ``IterableDataset`` written here (state = its position) over a plain map-style dataset, on one
process and ddp x2; torchdata's ``StatefulDataLoader`` when torchdata is installed (the ``data`` extra).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from test_user_samplers import Indexed as Table  # sample i: (i, x_i, y_i); counts what is loaded
from torch.utils.data import DataLoader, IterableDataset

from polytrain import Trainer, TrainModule
from polytrain.callbacks import Callback
from polytrain.core.errors import SamplerError
from polytrain.data.stateful import state_source

pytestmark = pytest.mark.torch_api

N = 24  # 12 items per rank under ddp x2: batch 3 gives 4 batches an epoch
BATCH = 3
EPOCHS = 2
SAVE_AT = {1: 10, 2: 6}  # world -> step to checkpoint at: epoch 1, batch 2 (8 or 4 batches an epoch)


class Stream(IterableDataset):
    """A stream over ``Table``, sharded by data-parallel rank (plain ddp: the process group's rank); its
    state is its position, and it counts the items it produces."""

    def __init__(self, n: int = N) -> None:
        self.table, self.pos, self.produced = Table(n), 0, 0

    def _mine(self) -> list[int]:
        rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return list(range(rank, len(self.table), size))

    def __iter__(self) -> Iterator[Any]:
        mine = self._mine()
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            self.produced += 1
            yield self.table[i]
        self.pos = 0  # the next epoch starts the stream again

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class Learner(TrainModule):
    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.net.weight.copy_(torch.tensor([[0.1, -0.2, 0.3, -0.4]]))
            self.net.bias.fill_(0.05)
        self.loader = loader
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.seen.append(idx.tolist())
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return self.loader


class SaveAt(Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:  # the same on every rank: every rank saves
            trainer.save_checkpoint(self.path)


def _fit(root: str, world: int, loader: Any, ckpt_path: str | None = None, **kwargs: Any) -> dict[str, Any]:
    module = Learner(loader)
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      run_dir=root, num_sanity_val_steps=0, max_epochs=EPOCHS, seed=3, devices=world,
                      strategy="ddp" if world > 1 else "single", **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return {"seen": module.seen, "weights": [p.detach().clone() for p in module.parameters()],
            "loader": type(trainer.train_dataloader).__name__}


def _stream_runs(rank: int, world: int, root: str) -> dict[str, Any]:
    """Uninterrupted (checkpointing mid-epoch on the way), then resumed from that checkpoint."""
    ckpt = os.path.join(root, f"stream{world}.ckpt")
    full = _fit(os.path.join(root, "full"), world, DataLoader(Stream(), BATCH),
                callbacks=[SaveAt(SAVE_AT[world], ckpt)])
    stream = Stream()
    resumed = _fit(os.path.join(root, "resumed"), world, DataLoader(stream, BATCH), ckpt_path=ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["data"]
    return {"full": full, "resumed": resumed, "produced": stream.produced, "ckpt": ckpt, "saved": saved}


def _check_resumed(out: dict[str, Any], world: int) -> None:
    full, resumed, step = out["full"], out["resumed"], SAVE_AT[world]
    assert resumed["seen"] == full["seen"][step:]
    for a, b in zip(resumed["weights"], full["weights"]):
        assert torch.equal(a, b)
    # Only the remaining items were produced: replaying the epoch's first batches would add 2 x 3.
    assert out["produced"] == sum(len(batch) for batch in full["seen"][step:])


@pytest.mark.timeout(200)
def test_stream_resumes_from_its_state_on_one_process(tmp_path: Any) -> None:
    out = _stream_runs(0, 1, str(tmp_path))
    _check_resumed(out, 1)
    # The position after the last consumed batch, not after the batch the loop had fetched ahead.
    assert out["saved"] == [{"dp_rank": 0, "dp_size": 1, "state": {"pos": 2 * BATCH}}]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_stream_runs, 2, str(tmp_path_factory.mktemp("stateful")), timeout=200.0)


@pytest.mark.distributed
@pytest.mark.timeout(260)
def test_stream_resumes_from_each_ranks_state_under_ddp(ddp_runs: list[dict[str, Any]]) -> None:
    for out in ddp_runs:
        _check_resumed(out, 2)
    assert ddp_runs[0]["saved"] == [{"dp_rank": r, "dp_size": 2, "state": {"pos": 2 * BATCH}}
                                    for r in range(2)]
    assert ddp_runs[0]["full"]["seen"] != ddp_runs[1]["full"]["seen"]  # each rank its own shard


@pytest.mark.distributed
@pytest.mark.timeout(260)
def test_state_from_another_data_parallel_size_is_refused(ddp_runs: list[dict[str, Any]],
                                                          tmp_path: Any) -> None:
    with pytest.raises(SamplerError, match=r"for 2 data-parallel rank\(s\) and this run has 1") as err:
        _fit(str(tmp_path), 1, DataLoader(Stream(), BATCH), ckpt_path=ddp_runs[0]["ckpt"])
    assert "Resume with 2 data-parallel ranks" in str(err.value)


def test_dataset_state_is_not_read_through_workers() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert state_source(DataLoader(Stream(), BATCH, num_workers=1)) is None
    assert any("StatefulDataLoader" in str(w.message) for w in caught)
    assert state_source(DataLoader(Stream(), BATCH)) is not None
    assert state_source(DataLoader(Table(4), BATCH)) is None  # a plain loader: the batch-skip path


# ---------------------------------------------------------------- torchdata's StatefulDataLoader


def _torchdata_runs(rank: int, world: int, root: str, workers: int) -> dict[str, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ckpt = os.path.join(root, f"td{world}-{workers}.ckpt")
    step = 6 if world == 2 else 10  # epoch 1, batch 2 either way
    full = _fit(os.path.join(root, "full"), world,
                StatefulDataLoader(Table(N), BATCH, shuffle=True, num_workers=workers),
                callbacks=[SaveAt(step, ckpt)])
    table = Table(N)
    loader = StatefulDataLoader(table, BATCH, shuffle=True, num_workers=workers)
    resumed = _fit(os.path.join(root, "resumed"), world, loader, ckpt_path=ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["data"]
    return {"full": full, "resumed": resumed, "step": step, "loaded": table.loaded, "saved": saved}


def _check_torchdata(out: dict[str, Any], workers: int) -> None:
    full, resumed, step = out["full"], out["resumed"], out["step"]
    assert resumed["seen"] == full["seen"][step:]
    for a, b in zip(resumed["weights"], full["weights"]):
        assert torch.equal(a, b)
    # The loader polytrain runs is still the user's kind (under ddp: rebuilt with the distributed sampler),
    # and its state is in the checkpoint, this data-parallel rank's under its rank.
    assert resumed["loader"] == "StatefulDataLoader"
    assert [e["dp_rank"] for e in out["saved"]] == list(range(len(out["saved"])))
    if not workers:  # workers load copies of the dataset: their counts stay in them
        assert out["loaded"] == sum(len(batch) for batch in full["seen"][step:])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_on_one_process(workers: int, tmp_path: Any) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    _check_torchdata(_torchdata_runs(0, 1, str(tmp_path), workers), workers)


@pytest.mark.distributed
@pytest.mark.timeout(260)
def test_torchdata_stateful_dataloader_under_ddp(tmp_path: Any) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    for out in run_distributed(_torchdata_runs, 2, str(tmp_path), 0, timeout=200.0):
        _check_torchdata(out, 0)
