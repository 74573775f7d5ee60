"""Runs started together into one run_dir never share a version directory or a file.

Twenty processes (job arrays and sweeps start runs this way) each build a Trainer with the default loggers
(TensorBoard and CSV) and a ModelCheckpoint, and calls ``fit``; all twenty wait at one barrier in the
last hook before a run's directory is chosen, so they choose at the same moment.
Each run logs its own index and records, once its fit is over, the hash of every file in its directory.
Afterwards: twenty version directories, one per run, and every file still holds what its run wrote
(the CSV its own index only, the checkpoint its own final weights).
"""

from __future__ import annotations

import os
import pickle
import queue
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import _get_context
from test_run_directories import _snapshot as file_hashes

RUNS = 20
pytestmark = [pytest.mark.own_logic, pytest.mark.timeout(600)]


def _run(index: int, root: str, barrier: Any, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        from polytrain import Trainer
        from polytrain.callbacks.model_checkpoint import ModelCheckpoint
        from tests.reliability.scripts.rel_module import RelModule

        class Indexed(RelModule):
            def configure_callbacks(self) -> list[Any]:
                # The last hook before the run's directory is chosen: all twenty choose at once.
                barrier.wait(timeout=300)
                return []

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                self.log("run_index", float(index))
                return super().training_step(batch, batch_idx)

        trainer = Trainer(strategy="single", accelerator="cpu", devices=1, max_steps=4, run_dir=root,
                          seed=index,
                          log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[ModelCheckpoint(every_n_train_steps=2, save_last=True)])
        module = Indexed(n=16, batch_size=4)
        trainer.fit(module)
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        # Plain pickle: the queue's own tensor pickling shares storages that die with this process.
        results.put((index, "ok", pickle.dumps((trainer.log_dir, file_hashes(trainer.log_dir), weights))))
    except BaseException as err:  # noqa: BLE001 - the test shows it
        import traceback

        results.put((index, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def test_twenty_runs_started_together_get_twenty_versions_and_keep_every_file(tmp_path: Path) -> None:
    ctx = _get_context()
    barrier, results = ctx.Barrier(RUNS), ctx.Queue()
    root = str(tmp_path / "runs")
    procs = [ctx.Process(target=_run, args=(i, root, barrier, results), daemon=True) for i in range(RUNS)]
    for proc in procs:
        proc.start()
    done: dict[int, Any] = {}
    errors = []
    try:
        while len(done) + len(errors) < RUNS:
            try:
                index, status, payload = results.get(timeout=300)
            except queue.Empty:
                pytest.fail(f"runs {sorted(set(range(RUNS)) - set(done))} did not finish within 300 s")
            if status == "ok":
                done[index] = pickle.loads(payload)
            else:
                errors.append(f"run {index}: {payload}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert not errors, "\n".join(errors)

    dirs = {index: log_dir for index, (log_dir, _, _) in done.items()}
    assert len(set(dirs.values())) == RUNS, f"runs shared a directory: {sorted(dirs.items())}"
    assert sorted(os.listdir(root)) == sorted(f"version_{i}" for i in range(RUNS))
    for index, (log_dir, written, weights) in done.items():
        assert written, f"run {index} wrote nothing into {log_dir}"
        assert file_hashes(log_dir) == written, f"run {index}: files in {log_dir} changed after it ended"
        names = set(written)
        assert {"metrics.csv", "goodput.jsonl", "checkpoints/last.ckpt", "checkpoints/latest"} <= names, names
        assert any(n.startswith("events.out.tfevents") for n in names), names
        with open(os.path.join(log_dir, "metrics.csv"), encoding="utf-8") as fh:
            rows = fh.read().splitlines()
        column = rows[0].split(",").index("run_index")
        assert {float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]} == {float(index)}
        saved = torch.load(os.path.join(log_dir, "checkpoints", "last.ckpt"), weights_only=True)["model"]
        assert all(torch.equal(saved[k], weights[k]) for k in weights), (
            f"run {index}: last.ckpt holds another run's weights")
