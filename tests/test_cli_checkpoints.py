"""``--ckpt`` as a newcomer types it: checked in the launching process before any worker starts.

A missing path, a damaged file, or ``last`` with nothing to load ends the command with one line on
stderr and exit code 2, in the words of the command that asked (validate, test, resume from), naming the
checkpoints that do exist; ``--ckpt best`` in a new process takes the best checkpoint the run's own
ModelCheckpoint recorded, as ``ckpt_path="best"`` does after a fit in Python.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import POLYTRAIN, TINY_CONFIG, run  # noqa: E402

pytestmark = [pytest.mark.own_logic, pytest.mark.slow, pytest.mark.timeout(300)]


def _polytrain(command: str, run_dir: Path, *args: str) -> object:
    return run([*POLYTRAIN, command, "-c", str(TINY_CONFIG), f"trainer.run_dir={run_dir}", *args],
               timeout=120)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("cli-checkpoints") / "run"
    result = _polytrain("fit", run_dir)
    assert result.returncode == 0, result.describe()
    return run_dir


def test_a_missing_path_is_one_line_naming_the_checkpoints_that_exist(fitted: Path, tmp_path: Path) -> None:
    missing = tmp_path / "does_not_exist.ckpt"
    result = _polytrain("validate", fitted, "--ckpt", str(missing))
    assert result.returncode == 2, result.describe()
    line = _one_line(result.stderr)
    assert line.startswith(f"polytrain validate: the checkpoint to validate does not exist: {missing}. "
                           f"Checkpoints under {fitted}: version_0/checkpoints/epoch=1-step=16.ckpt"), line
    assert result.stdout == ""  # no worker started


def test_a_damaged_file_is_one_line_before_any_worker(fitted: Path, tmp_path: Path) -> None:
    torn = tmp_path / "torn.ckpt"
    shutil.copyfile(fitted / "version_0" / "checkpoints" / "last.ckpt", torn)
    with open(torn, "r+b") as fh:
        fh.truncate(1000)
    result = _polytrain("test", fitted, "--ckpt", str(torn))
    assert result.returncode == 2, result.describe()
    line = _one_line(result.stderr)
    assert line.startswith("polytrain test: the checkpoint to test cannot be used: "
                           f"checkpoint {torn} is damaged"), line


def test_last_with_nothing_to_evaluate_says_so(tmp_path: Path) -> None:
    result = _polytrain("validate", tmp_path / "empty", "--ckpt", "last")
    assert result.returncode == 2, result.describe()
    line = _one_line(result.stderr)
    assert line == ("polytrain validate: ckpt_path='last': there is no checkpoint to validate in "
                    f"{tmp_path / 'empty'}: "
                    f"it holds no checkpoint. Fit first, or name a checkpoint file"), line
    assert not (tmp_path / "empty").exists()  # refused before anything was written


def test_best_on_the_command_line_is_the_best_the_run_recorded(fitted: Path) -> None:
    best = _polytrain("validate", fitted, "--ckpt", "best")
    assert best.returncode == 0, best.describe()
    # Without a monitor the best is the newest checkpoint kept (Lightning's meaning): the same table.
    newest = fitted / "version_0" / "checkpoints" / "epoch=1-step=16.ckpt"
    # the file it took, said once
    said = f"ckpt_path='best': validate: the best checkpoint ModelCheckpoint recorded, {newest}"
    assert best.stderr.count(said) == 1, best.describe()
    named = _polytrain("validate", fitted, "--ckpt", str(newest))
    assert named.returncode == 0, named.describe()
    table = [line for line in best.stdout.splitlines() if "val/loss" in line]
    assert table and table == [line for line in named.stdout.splitlines() if "val/loss" in line]


def test_help_names_every_checkpoint_choice() -> None:
    result = run([*POLYTRAIN, "validate", "--help"], timeout=60)
    assert result.returncode == 0, result.describe()
    text = " ".join(result.stdout.split())
    assert all(word in text for word in ("a path", "'last'", "'best'", "'auto'")), text
