"""Shared fixtures for the single-process unit tests: a tiny regression TrainModule over a
TensorDataset, a per-test run_dir, and Trainer keyword defaults that keep every run quiet and fast."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# `from distributed import run_distributed` in the distributed tests resolves against this folder.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import parallel_runs  # noqa: E402 - after the sys.path insertion on purpose

from polytrain import TrainModule  # noqa: E402

SEED_VARIABLES = ("PL_GLOBAL_SEED", "POLYTRAIN_SEED")  # what seed_everything leaves in the environment

# Tiny models train in microseconds; thread start-up would dominate on a 2-core machine.
torch.set_num_threads(1)


def make_dataset(n: int = 16, features: int = 4, seed: int = 0) -> TensorDataset:
    """A fixed linear-regression problem; the generator keeps it independent of the global RNG."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyModule(TrainModule):
    """Linear regression with every knob a test needs exposed as an attribute."""

    def __init__(self, n: int = 16, batch_size: int = 4, lr: float = 0.1, features: int = 4,
                 val_n: int | None = 8, shuffle: bool = False, drop_last: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(features, 1)
        self.lr = lr
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.train_ds = make_dataset(n, features, seed=0)
        self.val_ds = make_dataset(val_n, features, seed=1) if val_n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val/loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("test/loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=self.shuffle,
                          drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader | None:
        if self.val_ds is None:
            return None
        return DataLoader(self.val_ds, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader | None:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader | None:
        return self.val_dataloader()


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    """Every test starts from the same random state, whatever ran before it: polytrain does not
    reseed when trainer.seed is unset (it leaves the user's streams alone), so the test must. A seed a
    test left with ``seed_everything`` (``PL_GLOBAL_SEED``: a request for Lightning's seeding) is taken
    away again, so it cannot change the tests after it."""
    import random

    import numpy as np

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    saved = {name: os.environ.pop(name, None) for name in SEED_VARIABLES}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture
def run_dir(tmp_path: Any) -> str:
    path = tmp_path / "run"
    return str(path)


@pytest.fixture
def quiet_kwargs(run_dir: str) -> dict[str, Any]:
    """Trainer keywords for a fast, silent single-process CPU run writing only under run_dir. No sanity
    check, so validation counts in these tests are the loop's own (tests/test_lifecycle.py covers it)."""
    return dict(strategy="single", accelerator="cpu", devices=1, run_dir=run_dir, enable_progress_bar=False,
                enable_checkpointing=False, logger=False, log_every_n_steps=1, num_sanity_val_steps=0)


@pytest.fixture
def make_trainer(quiet_kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``make_trainer(**overrides)``: a quiet Trainer; overrides win over the quiet defaults."""
    from polytrain import Trainer

    def build(**overrides: Any) -> Any:
        return Trainer(**{**quiet_kwargs, **overrides})

    return build


@pytest.fixture
def tiny_module() -> type[TinyModule]:
    return TinyModule


@pytest.fixture
def sgd_closures(monkeypatch: Any) -> list[bool]:
    """Whether each ``torch.optim.SGD.step`` call got a closure, in call order (the step itself runs as
    usual)."""
    closures: list[bool] = []
    original = torch.optim.SGD.step

    def recording_step(self: torch.optim.SGD, closure: Any = None) -> Any:
        closures.append(closure is not None)
        return original(self, closure)

    monkeypatch.setattr(torch.optim.SGD, "step", recording_step)
    return closures


def pytest_addoption(parser: Any) -> None:
    # Here, not in tests/matrix/conftest.py: options must be known before that folder is collected.
    parser.addoption("--matrix-full", action="store_true", default=False,
                     help="tests/matrix: every valid case of the cartesian product, not the all-pairs "
                          "covering set")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    check_tiers(items)
    if parallel_runs.in_worker(config):
        parallel_runs.order_longest_first(config, items)
    skip_gpu_tests(items)


@pytest.hookimpl(tryfirst=True)  # the collection as it will run, written before xdist reports it
def pytest_collection_finish(session: Any) -> None:
    parallel_runs.write_units(session.config, session.items)


def pytest_configure(config: Any) -> None:
    parallel_runs.announce_groups_folder(config)


def pytest_sessionfinish(session: Any) -> None:
    parallel_runs.record_durations(session.config)
    parallel_runs.remove_groups_folder(session.config)


if importlib.util.find_spec("xdist") is not None:  # a hook pytest knows only with pytest-xdist installed

    def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
        return parallel_runs.make_scheduler(config, log)


def skip_gpu_tests(items: list[Any]) -> None:
    """`gpu` tests skip (reported as skipped, never as passed) where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------- the suite's two tiers

# Every test file says which end of the supported torch range it needs (docs/testing.md has the rule):
# `torch_api` files run on the newest and the lowest torch, `own_logic` files on the newest only.
TIERS = ("torch_api", "own_logic")


def check_tiers(items: list[Any]) -> None:
    """A file in no tier (or in both) stops the run before any test: no file is left out of a tier unseen."""
    unclassified = sorted({item.nodeid.split("::")[0] for item in items
                           if len([m for m in item.iter_markers() if m.name in TIERS]) != 1})
    if unclassified:
        raise pytest.UsageError(
            f"{len(unclassified)} test file(s) are in no tier or in both: {', '.join(unclassified)}. Give "
            "each file exactly one of `pytestmark = pytest.mark.torch_api` (it proves something a torch "
            "release can change: runs at both ends of the torch range) or `pytest.mark.own_logic` (the "
            "newest torch only); docs/testing.md states the rule")
