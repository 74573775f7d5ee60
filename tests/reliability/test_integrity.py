"""Requirement 4, continued: a checkpoint is complete only when verified against its checksums.

- One flipped bit in a tensor of a checkpoint file (``torch.load`` loads it without a word) is refused
  on load, naming the file and the record, and ``resume: last`` skips that file for the previous one:
  the resumed run ends bitwise equal to an uninterrupted one.
- A sharded (fsdp x2) checkpoint whose shard file is truncated, zeroed or random, or has one flipped bit,
  is refused by every rank on a direct load, naming the directory and the file, and skipped by
  ``resume: last`` with a warning naming it; the resumed run ends bitwise equal to an uninterrupted one.
  The manifest lists every file with its size and CRC-32.
- A damaged directory written before manifests existed fails inside DCP; its ``CheckpointException`` (a
  ``BaseException``) comes out as a ``CheckpointError`` naming the directory on every rank.
- ``resume: last`` with checkpoints none of which loads refuses to start from scratch, naming them;
  so does the config's ``resume: last`` with no checkpoint at all; ``resume: auto`` starts fresh, and so
  does Lightning's ``fit(ckpt_path="last")`` when there is no checkpoint at all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import DistributedRunError, run_distributed

from polytrain import Trainer
from polytrain.callbacks.model_checkpoint import ModelCheckpoint
from polytrain.checkpoint.integrity import MANIFEST_FILE, crc32_of
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.core.errors import CheckpointError, ConfigError

from .helpers import bitwise_equal, figure, rel_module

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]

MAX_STEPS = 8


def _trainer(run_dir: str, strategy: str = "single", devices: int = 1, max_steps: int = MAX_STEPS,
             **kwargs: Any) -> Trainer:
    return Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps,
                   run_dir=run_dir, seed=0,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, timeout=60.0,
                   callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, save_on_fit_end=False)],
                   **kwargs)


def _module() -> Any:
    return rel_module().RelModule(n=32, batch_size=4, hidden=64)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.module_state_dict().items()}


def flip_bit_in_tensor(path: str) -> str:
    """Flip the lowest bit of one byte inside the largest tensor record of a checkpoint file; its name."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
        where = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        fh.seek(where)
        byte = fh.read(1)[0]
        fh.seek(where)
        fh.write(bytes([byte ^ 1]))
    return info.filename


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# --------------------------------------------------------------------------- one process, files


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    trainer = _trainer(str(tmp_path_factory.mktemp("integrity-reference") / "run"))
    trainer.fit(_module())
    return _weights(trainer)


@pytest.mark.timeout(600)
def test_a_flipped_bit_in_a_checkpoint_file_is_refused_and_skipped(tmp_path: Path, reference: dict,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    run_dir = str(tmp_path / "run")
    _trainer(run_dir, max_steps=6).fit(_module())
    ckpt_dir = os.path.join(run_dir, "version_0", "checkpoints")
    newest = os.path.join(ckpt_dir, "epoch=0-step=6.ckpt")
    clean = _tensors(torch.load(newest, weights_only=True))
    record = flip_bit_in_tensor(newest)
    damaged = _tensors(torch.load(newest, weights_only=True))  # torch itself loads it without a word
    assert sum(not torch.equal(a, b) for a, b in zip(clean, damaged)) == 1

    with pytest.raises(CheckpointError, match=r"epoch=0-step=6\.ckpt is damaged: Bad CRC-32 for file"):
        read_checkpoint(newest)
    with pytest.raises(CheckpointError, match=r"epoch=0-step=6\.ckpt is damaged"):
        _trainer(str(tmp_path / "other")).fit(_module(), ckpt_path=newest)

    caplog.set_level(logging.WARNING, logger="polytrain")
    resumed = _trainer(run_dir, resume="last")
    resumed.fit(_module())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    named = [w for w in warnings if "epoch=0-step=6.ckpt is incomplete or corrupt" in w and "CRC-32" in w]
    same = bitwise_equal(_weights(resumed), reference)
    figure("one flipped bit in a checkpoint file",
           f"torch.load loads it silently; polytrain refuses it ({record}), "
           f"resume skips it with a warning: {bool(named)}; bitwise: {same}")
    assert named, warnings
    assert os.path.basename(resumed.ckpt_path) == "epoch=0-step=4.ckpt"
    assert same and resumed.global_step == MAX_STEPS


@pytest.mark.timeout(600)
def test_resume_last_refuses_to_start_over_when_nothing_loads(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    empty = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"resume='last' continues a run, but there is nothing to continue "
                                          r"in .*it holds no checkpoint\. Start fresh with resume=auto"):
        _trainer(empty, resume="last").fit(_module())
    assert not os.path.exists(os.path.join(empty, "version_0"))  # refused before the run claimed a directory

    caplog.set_level(logging.WARNING, logger="polytrain")
    # Lightning's ckpt_path="last" with no checkpoint: warn, start fresh
    lightning = _trainer(empty, max_steps=2)
    lightning.fit(_module(), ckpt_path="last")
    assert lightning.ckpt_path is None and lightning.global_step == 2
    assert any("holds no checkpoint; starting from scratch" in r.getMessage() for r in caplog.records)

    run_dir = str(tmp_path / "run")
    _trainer(run_dir, max_steps=2).fit(_module())
    only = os.path.join(run_dir, "version_0", "checkpoints", "epoch=0-step=2.ckpt")
    with open(only, "r+b") as fh:
        fh.truncate(os.path.getsize(only) // 2)
    for resume_from in ({"resume": "last"}, {"ckpt_path": "last"}):
        trainer = _trainer(run_dir, **{k: v for k, v in resume_from.items() if k == "resume"})
        with pytest.raises(ConfigError, match=r"nothing to continue in .*its checkpoints cannot be loaded: "
                                              r"epoch=0-step=2\.ckpt \(checkpoint .* is damaged"):
            trainer.fit(_module(), ckpt_path=resume_from.get("ckpt_path"))
    fresh = _trainer(run_dir, resume="auto", max_steps=2)
    fresh.fit(_module())
    assert fresh.ckpt_path is None and fresh.global_step == 2
    assert any("resume='auto': no checkpoint under" in r.getMessage()
               and "epoch=0-step=2.ckpt" in r.getMessage()
               for r in caplog.records)
    figure("resume: last with nothing loadable",
           "refused (no checkpoint; only a damaged one); auto starts fresh")


# --------------------------------------------------------------------------- fsdp x2, sharded directories


def _sharded_worker(rank: int, world_size: int, run_dir: str, max_steps: int, resume: str | None,
                    ckpt_path: str | None) -> dict[str, Any]:
    logger = logging.getLogger("polytrain")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        trainer = _trainer(run_dir, "fsdp", world_size, max_steps, resume=resume)
        try:
            trainer.fit(_module(), ckpt_path=ckpt_path)
        except CheckpointError as err:
            return {"error": str(err), "type": type(err).__name__}
        return {"weights": _weights(trainer), "ckpt_path": trainer.ckpt_path, "warnings": records,
                "step": trainer.global_step}
    finally:
        logger.removeHandler(handler)


def _sharded(run_dir: str, max_steps: int = MAX_STEPS, resume: str | None = None,
             ckpt_path: str | None = None) -> list[dict[str, Any]]:
    return run_distributed(_sharded_worker, 2, run_dir, max_steps, resume, ckpt_path, timeout=180.0)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """fsdp x2: an uninterrupted run, and one cut at step 6 (checkpoints at steps 2, 4 and 6) to damage."""
    root = tmp_path_factory.mktemp("integrity-sharded")
    reference = _sharded(str(root / "reference"))
    _sharded(str(root / "cut"), max_steps=6)
    return {"reference": reference[0]["weights"], "cut": str(root / "cut" / "version_0")}


def _damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    if how == "truncated":
        with open(path, "r+b") as fh:
            fh.truncate(size // 2)
    elif how == "zeroed":
        with open(path, "r+b") as fh:
            fh.write(b"\0" * size)
    elif how == "random":
        with open(path, "r+b") as fh:
            fh.write(torch.randint(0, 256, (size,), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(0))
                     .numpy().tobytes())
    elif how == "one bit":
        with open(path, "r+b") as fh:
            fh.seek(size // 2)
            byte = fh.read(1)[0]
            fh.seek(size // 2)
            fh.write(bytes([byte ^ 1]))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["truncated", "zeroed", "random", "one bit"])
def test_a_damaged_shard_is_refused_on_load_and_skipped_on_resume(sharded_run: dict, tmp_path: Path,
                                                                  how: str) -> None:
    run = tmp_path / "run" / "version_0"
    shutil.copytree(sharded_run["cut"], run)
    newest = next((run / "checkpoints").glob("epoch=*-step=6"))
    manifest = json.loads((newest / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(n for n in os.listdir(newest) if n != MANIFEST_FILE)
    assert sorted(manifest) == on_disk and all(manifest[n] == crc32_of(str(newest / n)) for n in on_disk)
    shard = newest / "__1_0.distcp"
    _damage(str(shard), how)

    direct = _sharded(str(tmp_path / "other"), ckpt_path=str(newest))
    expected = f"sharded checkpoint {newest} is damaged: __1_0.distcp "
    assert all(r.get("type") == "CheckpointError" and expected in r["error"] for r in direct), direct
    assert direct[0]["error"] == direct[1]["error"]

    resumed = _sharded(str(tmp_path / "run"), resume="last")
    warned = [w for w in resumed[0]["warnings"]
              if f"{newest} is incomplete or corrupt" in w and "__1_0.distcp" in w]
    same = all(bitwise_equal(r["weights"], sharded_run["reference"]) for r in resumed[:1])
    figure(f"damaged shard ({how}), fsdp x2",
           f"direct load refused on both ranks; resume skipped it with a warning: "
           f"{bool(warned)}; resumed from {os.path.basename(resumed[0]['ckpt_path'])}; "
           f"bitwise: {same}")
    assert warned, resumed[0]["warnings"]
    assert all(os.path.basename(r["ckpt_path"]).endswith("-step=4") for r in resumed)
    assert same and resumed[0]["step"] == MAX_STEPS


@pytest.mark.timeout(600)
def test_dcp_failure_on_a_directory_without_manifest_names_the_checkpoint(sharded_run: dict,
                                                                          tmp_path: Path) -> None:
    run = tmp_path / "run" / "version_0"
    shutil.copytree(sharded_run["cut"], run)
    newest = next((run / "checkpoints").glob("epoch=*-step=6"))
    (newest / MANIFEST_FILE).unlink()  # as written before manifests existed: only DCP can find the damage
    _damage(str(newest / "__1_0.distcp"), "truncated")
    try:
        direct = _sharded(str(tmp_path / "other"), ckpt_path=str(newest))
    except DistributedRunError as err:  # a raw CheckpointException escaping would end up here
        pytest.fail(f"the load did not raise CheckpointError on every rank: {err}")
    assert all(r.get("type") == "CheckpointError"
               and f"sharded checkpoint {newest} cannot be loaded" in r["error"]
               for r in direct), direct
    assert all("\n" not in r["error"] for r in direct), direct
