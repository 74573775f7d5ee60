"""``BasePredictionWriter`` as Lightning's: every rank writes its share per batch or per epoch with the
dataset indices of each prediction, so the files put back together hold each sample's prediction once,
equal to one process's; ``return_predictions=False`` returns nothing."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from conftest import TinyModule
from distributed import run_distributed
from torch.utils.data import DataLoader

from polytrain import Trainer
from polytrain.callbacks import BasePredictionWriter

pytestmark = pytest.mark.own_logic


class FileWriter(BasePredictionWriter):
    def __init__(self, out: str, write_interval: str) -> None:
        super().__init__(write_interval)
        self.out = out
        self.batches = 0

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any,
                           batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self.batches += 1
        torch.save({"pred": prediction, "idx": list(batch_indices)},
                   os.path.join(self.out, f"batch-{trainer.global_rank}-{batch_idx}.pt"))

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        torch.save({"preds": predictions, "idx": batch_indices},
                   os.path.join(self.out, f"epoch-{trainer.global_rank}.pt"))


class Predicting(TinyModule):
    def __init__(self) -> None:
        super().__init__(val_n=10, batch_size=3)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=3)


def _kwargs(run_dir: str, **over: Any) -> dict[str, Any]:
    return {**dict(strategy="single", accelerator="cpu", devices=1, run_dir=run_dir,
                   enable_progress_bar=False, enable_model_summary=False, logger=False), **over}


def _by_index(out: str) -> dict[int, torch.Tensor]:
    """Every prediction the files hold, keyed by dataset index; a repeated index fails."""
    found: dict[int, torch.Tensor] = {}
    for name in sorted(os.listdir(out)):
        data = torch.load(os.path.join(out, name), weights_only=True)
        if name.startswith("batch-"):
            pairs = [(data["pred"], data["idx"])]
        else:
            assert len(data["idx"]) == 1  # one loader
            pairs = list(zip(data["preds"], data["idx"][0]))
        for pred, idx in pairs:
            for row, i in zip(pred, idx):
                key = (name.split("-")[0], i)
                assert key not in found, f"index {i} written twice"
                found[key] = row
    return found


def _expected(module: TinyModule) -> torch.Tensor:
    with torch.no_grad():
        return module(module.val_ds.tensors[0])


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_one_process_writes_every_prediction_with_its_index(tmp_path: Any, run_dir: str,
                                                            interval: str) -> None:
    out = str(tmp_path / "preds")
    os.makedirs(out)
    module = Predicting()
    writer = FileWriter(out, interval)
    result = Trainer(**_kwargs(run_dir, callbacks=[writer])).predict(module, return_predictions=False)
    assert result is None
    found = _by_index(out)
    expected = _expected(module)
    for kind in {"batch": ["batch"], "epoch": ["epoch"], "batch_and_epoch": ["batch", "epoch"]}[interval]:
        rows = {i: row for (k, i), row in found.items() if k == kind}
        assert sorted(rows) == list(range(10))
        # batches of 3 against one of 10: the CPU's matmul kernel may differ by batch size, in the last bit
        assert all(torch.allclose(rows[i], expected[i], rtol=0, atol=1e-6) for i in rows)
    assert writer.batches == (0 if interval == "epoch" else 4)


def _predict_on_rank(rank: int, world: int, out: str, run_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Predicting()
    returned = Trainer(**_kwargs(run_dir, strategy="ddp", devices=world,
                                 callbacks=[FileWriter(out, "batch_and_epoch")])).predict(module)
    return {"returned": len(returned)}


def test_ddp_ranks_together_write_each_sample_once(tmp_path: Any, run_dir: str) -> None:
    out = str(tmp_path / "preds")
    os.makedirs(out)
    results = run_distributed(_predict_on_rank, 2, out, run_dir, timeout=240)
    assert [r["returned"] for r in results] == [2, 2]  # rank 0: samples 0, 2, .., 8; rank 1: 1, 3, .., 9
    found = _by_index(out)
    torch.manual_seed(0)
    expected = _expected(Predicting())
    for kind in ("batch", "epoch"):
        rows = {i: row for (k, i), row in found.items() if k == kind}
        assert sorted(rows) == list(range(10))  # each sample once over both ranks, no padding
        assert all(torch.allclose(rows[i], expected[i]) for i in rows)
    assert sorted(n for n in os.listdir(out) if n.startswith("epoch")) == ["epoch-0.pt", "epoch-1.pt"]


def test_bad_write_interval_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="batch, epoch, batch_and_epoch"):
        FileWriter("x", "step")
