"""Requirement 6: data edge cases under 2 real ranks -- a clear error before any training step on
EVERY rank, never a hang; and a validation metric over 5 samples on 2 ranks equal to one process's.

One spawn of 2 gloo ranks runs every case back to back (each error is agreed by all ranks before
anyone raises, so the process group stays usable for the next case).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch.utils.data import DataLoader, Subset

from .helpers import figure, quiet, rel_module

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]

CASES = {  # name: (RelModule keywords, extra Trainer keywords)
    # (shuffle=False: with shuffle=True torch's own RandomSampler already refuses 0 samples in the
    # user's code)
    "empty dataset": (dict(n=0, batch_size=4, shuffle=False), {}),
    "fewer samples than ranks": (dict(n=1, batch_size=1), {}),
    "drop_last leaves zero batches": (dict(n=6, batch_size=4, drop_last=True), {}),
    "uneven user sampler (use_distributed_sampler=false)":
        (dict(n=20, batch_size=4), dict(use_distributed_sampler=False)),
}
EXPECTED = {
    "empty dataset": ("EmptyDataError", "the train dataset has 0 sample(s)"),
    "fewer samples than ranks": ("EmptyDataError", "has 1 sample(s) for 2 data-parallel ranks"),
    "drop_last leaves zero batches": ("EmptyDataError", "yields 0 batches on data-parallel rank(s) [0, 1]"),
    "uneven user sampler (use_distributed_sampler=false)":
        ("ValueError", "different numbers of train batches per epoch: [3, 2]"),
}


def _uneven_module(**kwargs: Any) -> Any:
    """The user shards the data by hand, unevenly: rank 0 gets 12 samples (3 batches), rank 1 gets 8 (2)."""
    mod = rel_module()

    class Uneven(mod.RelModule):
        def train_dataloader(self) -> DataLoader:
            ds = mod.IndexedRegression(self.n)
            mine = range(0, 12) if self.trainer.global_rank == 0 else range(12, 20)
            return DataLoader(Subset(ds, list(mine)), batch_size=self.batch_size)

    return Uneven(**kwargs)


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from polytrain import Trainer

    out: dict[str, Any] = {}
    for name, (module_kwargs, trainer_kwargs) in CASES.items():
        make = _uneven_module if "uneven" in name else rel_module().RelModule
        module = make(**module_kwargs)
        trainer = Trainer(**quiet(os.path.join(root, str(len(out))), max_epochs=1, **trainer_kwargs))
        start = time.time()
        try:
            trainer.fit(module)
            out[name] = {"error": None}
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(err).__name__}: {err}", "seconds": time.time() - start}
        out[name]["steps_run"] = module.train_steps_run
    module = rel_module().RelModule(n=8, batch_size=2, val_n=5)
    metrics = Trainer(**quiet(os.path.join(root, "val"))).validate(module)
    out["validation"] = metrics[0]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("data-edges")), timeout=300.0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_fails_clearly_on_every_rank_before_training(runs: list[dict[str, Any]], case: str) -> None:
    kind, text = EXPECTED[case]
    per_rank = [r[case] for r in runs]
    clear = [r["error"] is not None and r["error"].startswith(kind) and text in r["error"] for r in per_rank]
    figure(f"data edge case: {case}", f"clear error on {sum(clear)}/2 ranks before any training step "
                                      f"(steps run: {[r['steps_run'] for r in per_rank]})")
    assert all(clear), [r["error"] for r in per_rank]
    assert [r["steps_run"] for r in per_rank] == [0, 0]


@pytest.mark.timeout(600)
def test_validation_over_5_samples_on_2_ranks_equals_one_process(runs: list[dict[str, Any]],
                                                                  tmp_path: Any) -> None:
    from polytrain import Trainer

    module = rel_module().RelModule(n=8, batch_size=2, val_n=5)
    single = Trainer(**quiet(str(tmp_path / "single"), strategy="single", devices=1)).validate(module)[0]
    two = [r["validation"]["val/loss"] for r in runs]
    figure("validation over 5 samples on 2 ranks", f"val/loss 2 ranks {two[0]:.9f} vs 1 process "
                                                   f"{single['val/loss']:.9f}")
    assert two[0] == two[1]
    assert torch.isclose(torch.tensor(two[0]), torch.tensor(single["val/loss"]), rtol=1e-6, atol=0)
