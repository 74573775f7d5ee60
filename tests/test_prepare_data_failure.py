"""A ``prepare_data`` that raises on local rank 0 (a download without network) ends the job with that
rank's own traceback, whichever rank's error the launcher reports: the ranks that were waiting raise
an error that carries it (``RankFailedError``), instead of failing at the barrier with no word of why."""

from __future__ import annotations

import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import POLYTRAIN, run  # noqa: E402

pytestmark = pytest.mark.torch_api

URL = "https://example.invalid/cifar-10-python.tar.gz"


def fetch_archive(url: str) -> None:
    raise ConnectionError(f"cannot reach {url}: [Errno -3] Temporary failure in name resolution")


class FailingDownload(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def prepare_data(self) -> None:  # local rank 0 only; the other rank waits at the barrier
        fetch_archive(URL)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)


def _fit_and_report(rank: int, world_size: int, run_dir: str) -> dict[str, str]:
    trainer = Trainer(accelerator="cpu", strategy="ddp", devices=world_size, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, default_root_dir=run_dir,
                      timeout=30)
    try:
        trainer.fit(FailingDownload())
    except Exception as err:  # noqa: BLE001 - what this rank would hand its launcher
        return {"type": type(err).__name__, "text": "".join(traceback.format_exception(err))}
    return {"type": "none", "text": "fit returned"}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_rank_ends_with_the_preparing_ranks_traceback(tmp_path: Path) -> None:
    rank0, rank1 = run_distributed(_fit_and_report, 2, str(tmp_path), timeout=100)
    assert rank0["type"] == "ConnectionError" and "in fetch_archive" in rank0["text"], rank0["text"]
    # The waiting rank did not hang or fail at the barrier: it ends with rank 0's traceback in its message.
    assert rank1["type"] == "RankFailedError", rank1["text"]
    assert "prepare_data raised on rank 0" in rank1["text"], rank1["text"]
    assert f"cannot reach {URL}" in rank1["text"] and "in fetch_archive" in rank1["text"], rank1["text"]


MODULE_FILE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from polytrain import TrainModule

    def fetch_archive(url):
        raise ConnectionError(f"cannot reach {url}: [Errno -3] Temporary failure in name resolution")

    class FailingDownload(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
        def prepare_data(self):
            fetch_archive("URL")
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
''').replace('"URL"', repr(URL))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["elastic", "spawn"])
def test_cli_shows_the_preparing_ranks_exception_and_where_it_was_raised(tmp_path: Path,
                                                                         launcher: str) -> None:
    (tmp_path / "failing_download.py").write_text(MODULE_FILE)
    (tmp_path / "cfg.yaml").write_text("module: {_target_: failing_download.FailingDownload}\n")
    result = run([*POLYTRAIN, "fit", "-c", tmp_path / "cfg.yaml", "trainer.accelerator=cpu",
                  "trainer.devices=2", f"trainer.launcher={launcher}", f"trainer.run_dir={tmp_path / 'run'}",
                  "trainer.logger=false", "trainer.enable_progress_bar=false", "trainer.timeout=30"],
                 timeout=180)
    assert result.returncode == 1, result.describe()
    assert f"ConnectionError: cannot reach {URL}" in result.stderr, result.describe()
    assert "in fetch_archive" in result.stderr, result.describe()  # the raising function, from the traceback
    assert "traceback is in" not in result.stderr, result.describe()
    # Under either launcher: the preparing rank's traceback once, short, then the line naming it
    said = result.stderr.strip().splitlines()
    header = [n for n, line in enumerate(said) if line.startswith("polytrain: rank 0 failed (torch's and "
                                                                   "polytrain's frames left out")]
    assert len(header) == 1 and len(said) - header[0] <= 30, result.describe()
    assert said[-1].startswith("polytrain: fit failed on rank 0: ConnectionError: cannot reach"), (
        result.describe())
