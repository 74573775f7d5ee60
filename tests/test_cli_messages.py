"""What the command line prints besides errors: the final metrics line and the warning an elastic config
that cannot continue after a restart gets."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import POLYTRAIN, TINY_CONFIG, run  # noqa: E402

from polytrain.cli import _print_metrics  # noqa: E402
from polytrain.trainer.config import TrainerConfig, elastic_warning, load_config  # noqa: E402


def test_final_metrics_keep_four_significant_digits(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = SimpleNamespace(callback_metrics={"train/loss": torch.tensor(0.000194), "val/acc": torch.tensor(0.98333),
                                                "val/loss": torch.tensor(12.3456)})
    _print_metrics(trainer)
    assert capsys.readouterr().out == "final metrics: train/loss=0.000194  val/acc=0.9833  val/loss=12.35\n"


STEP_CHECKPOINTS = "trainer.callbacks=[{_target_: polytrain.callbacks.ModelCheckpoint, every_n_train_steps: 4}]"


@pytest.mark.parametrize("overrides, missing", [
    (["trainer.max_restarts=2"], ["trainer.resume: auto", "a ModelCheckpoint with every_n_train_steps"]),
    (["trainer.max_restarts=2", "trainer.resume=auto"], ["a ModelCheckpoint with every_n_train_steps"]),
    (["trainer.num_nodes=1:2", STEP_CHECKPOINTS], ["trainer.resume: auto"]),
    (["trainer.max_restarts=2", "trainer.resume=auto", STEP_CHECKPOINTS], []),
    ([], []),
])
def test_an_elastic_config_that_would_start_over_is_warned(overrides: list[str], missing: list[str]) -> None:
    config = load_config(str(TINY_CONFIG), overrides)
    warning = elastic_warning(TrainerConfig(**config["trainer"]))
    if not missing:
        assert warning is None
        return
    assert warning is not None and "each restart will start the training over" in warning
    assert all(m in warning for m in missing) and "docs/reliability.md" in warning
    assert ("resume: auto" in warning) == ("trainer.resume: auto" in missing)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_cli_prints_the_elastic_warning_as_one_line(tmp_path: Path) -> None:
    result = run([*POLYTRAIN, "fit", "-c", str(TINY_CONFIG), f"trainer.run_dir={tmp_path / 'run'}",
                  "trainer.max_restarts=1", "trainer.max_epochs=1"], timeout=150)
    assert result.returncode == 0, result.describe()
    warnings = [line for line in result.stderr.splitlines() if line.startswith("polytrain: warning:")]
    assert len(warnings) == 1 and "trainer.max_restarts=1 restarts the workers" in warnings[0], result.describe()
