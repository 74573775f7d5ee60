"""Requirement 8: checkpoint security. Our checkpoints load with ``weights_only=True`` and no
allow-list; a checkpoint carrying a malicious ``__reduce__`` payload is refused with
``CheckpointError`` on every load path (read, ``resume: last`` scanning, ``fit(ckpt_path=...)``,
``polytrain checkpoint consolidate``) and the payload never runs (zero marker files); a crafted
``torch.distributed.checkpoint`` ``.metadata`` file is refused before anything in it is
constructed (``sharded_io._MetadataUnpickler``, an allow-list of DCP's metadata classes).
"""

from __future__ import annotations

import ast
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from polytrain import Trainer
from polytrain.callbacks.model_checkpoint import ModelCheckpoint
from polytrain.checkpoint.layout import find_resumable, is_complete
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.cli import main as cli_main
from polytrain.core.errors import CheckpointError

from .helpers import REPO, figure, rel_module

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]


class Payload:
    """Unpickling this runs ``os.system('touch MARKER')``: what an attacker's checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _foreign_safe_globals() -> list[Any]:
    """Entries of torch's weights-only allow-list that torch itself did not register (torch.distributed
    registers its own classes and the exception types c10d raises: those construct no code)."""
    out = []
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        module = getattr(obj, "__module__", "") or ""
        if (module.startswith("torch") or module == "traceback"
                or (isinstance(obj, type) and issubclass(obj, BaseException))):
            continue
        out.append(obj)
    return out


def _trainer(run_dir: Path, **kwargs: Any) -> Trainer:
    return Trainer(strategy="single", accelerator="cpu", devices=1, run_dir=str(run_dir), logger=False,
                   seed=0, enable_progress_bar=False, enable_model_summary=False, **kwargs)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("good") / "run"
    saver = ModelCheckpoint(every_n_train_steps=1, save_top_k=1, save_last=True)
    _trainer(run_dir, max_steps=2, callbacks=[saver]).fit(
        rel_module().RelModule(n=16, batch_size=4))
    return run_dir / "version_0" / "checkpoints" / "last.ckpt"


def _malicious_file(path: Path, marker: Path, good: Path) -> Path:
    payload = torch.load(good, weights_only=True)
    payload["callbacks"] = {"Evil": Payload(marker)}  # hidden among legitimate entries
    torch.save(payload, path)
    return path


def _malicious_dcp(directory: Path, marker: Path, good: Path) -> Path:
    directory.mkdir(parents=True)
    meta = {k: v for k, v in torch.load(good, weights_only=True).items() if k not in ("model", "optimizer")}
    torch.save(meta, directory / "meta.pt")
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (directory / "__0_0.distcp").write_bytes(b"")
    return directory


@pytest.mark.timeout(300)
def test_our_checkpoints_load_with_weights_only_and_no_allowlist(good_checkpoint: Path) -> None:
    assert _foreign_safe_globals() == []
    payload = torch.load(good_checkpoint, weights_only=True)
    assert "model" in payload and "loop" in payload and "rng" in payload
    # Every torch.load in the library is weights_only=True, except the spawn launcher reading the result
    # file its own worker wrote a moment earlier into a private temporary directory, and the branch a user
    # takes by asking for it (load_from_checkpoint(weights_only=False), Lightning's argument).
    loose = []
    for path in sorted((REPO / "polytrain").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                           and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    loose.append(f"{path.relative_to(REPO)}: {ast.unparse(node)}")
        assert "add_safe_globals" not in text and "safe_globals(" not in text, path
    spawned = "polytrain/trainer/launch/process_placement.py: torch.load(result_path, weights_only=False)"
    asked = "polytrain/checkpoint/reading.py: torch.load(path, map_location='cpu', weights_only=False)"
    assert loose == [asked, spawned], loose
    figure("our checkpoints",
           "load with weights_only=True, no allow-list of ours (entries beyond torch's own: "
           f"{len(_foreign_safe_globals())}); library "
           f"torch.load calls without weights_only=True: {len(loose)} (the spawn result file; "
           f"load_from_checkpoint(weights_only=False) when a user asks)")


@pytest.mark.timeout(300)
def test_reduce_payload_is_refused_on_every_load_path(tmp_path: Path, good_checkpoint: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _malicious_file(tmp_path / "evil.ckpt", marker, good_checkpoint)
    refused = []
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        read_checkpoint(str(evil))
    refused.append("read_checkpoint")
    assert not is_complete(str(evil))
    refused.append("is_complete")
    # resume: last scanning a directory whose newest checkpoint is the malicious one
    ckpt_dir = tmp_path / "run" / "version_0" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    shutil.copy(good_checkpoint, ckpt_dir / "epoch=0-step=2.ckpt")
    shutil.copy(evil, ckpt_dir / "epoch=0-step=3.ckpt")
    os.utime(ckpt_dir / "epoch=0-step=2.ckpt", (1, 1))
    assert find_resumable(str(ckpt_dir)) == str(ckpt_dir / "epoch=0-step=2.ckpt")
    refused.append("find_resumable (fell back)")
    with pytest.raises(CheckpointError):
        _trainer(tmp_path / "fit", max_steps=3).fit(rel_module().RelModule(n=16, batch_size=4),
                                                    ckpt_path=str(evil))
    refused.append("Trainer.fit(ckpt_path)")
    with pytest.raises(CheckpointError):
        cli_main(["checkpoint", "consolidate", str(evil), str(tmp_path / "out.pt")])
    refused.append("polytrain checkpoint consolidate")
    assert not (tmp_path / "out.pt").exists()
    figure("checkpoint with a __reduce__ payload",
           f"refused on {len(refused)}/5 load paths; marker files created: "
           f"{int(marker.exists())}")
    assert not marker.exists()


@pytest.mark.timeout(300)
def test_crafted_dcp_metadata_is_refused_before_unpickling(tmp_path: Path, good_checkpoint: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _malicious_dcp(tmp_path / "evil-sharded", marker, good_checkpoint)
    assert is_complete(str(evil))  # looks committed: only reading it can tell
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        read_checkpoint(str(evil))
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        _trainer(tmp_path / "fit", max_steps=3).fit(rel_module().RelModule(n=16, batch_size=4),
                                                    ckpt_path=str(evil))
    with pytest.raises(CheckpointError):
        cli_main(["checkpoint", "consolidate", str(evil), str(tmp_path / "out.pt")])
    figure("crafted DCP .metadata", f"refused on 3/3 load paths before unpickling; marker files created: "
                                    f"{int(marker.exists())}")
    assert not marker.exists()
    assert _foreign_safe_globals() == []
