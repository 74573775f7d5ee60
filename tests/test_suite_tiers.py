"""The suite's tiers (docs/testing.md): every test file is in exactly one, `torch_api` (run at both ends of
the torch range) or `own_logic` (the newest torch only), and a file in none stops a run before any test."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from conftest import TIERS, check_tiers

pytestmark = pytest.mark.own_logic

TESTS = Path(__file__).resolve().parent


def _module_name(path: Path) -> str:
    # As pytest imports it: from the first folder up without an __init__.py (tests/, which conftest.py puts
    # on sys.path), so tests/reliability/test_elastic.py is reliability.test_elastic.
    return ".".join(path.relative_to(TESTS).with_suffix("").parts)


def _tiers_of(module: Any) -> list[str]:
    marks = getattr(module, "pytestmark", [])
    return [mark.name for mark in (marks if isinstance(marks, list) else [marks]) if mark.name in TIERS]


def test_every_test_file_is_in_exactly_one_tier() -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 90  # the walk found the suite
    wrong = {str(path.relative_to(TESTS)): tiers for path in files
             if len(tiers := _tiers_of(importlib.import_module(_module_name(path)))) != 1}
    assert not wrong, f"test files in no tier or in several: {wrong}"


class _Item:
    def __init__(self, nodeid: str, *marks: str) -> None:
        self.nodeid, self.marks = nodeid, [pytest.Mark(name, (), {}) for name in marks]

    def iter_markers(self) -> list[pytest.Mark]:
        return self.marks


def test_a_run_with_a_file_in_no_tier_stops_naming_it() -> None:
    classified = [_Item("tests/test_a.py::test_x", "torch_api"),
                  _Item("tests/test_b.py::test_y", "own_logic")]
    check_tiers(classified)
    unclassified = r"1 test file\(s\) are in no tier or in both: tests/test_c.py\."
    with pytest.raises(pytest.UsageError, match=unclassified):
        check_tiers([*classified, _Item("tests/test_c.py::test_z", "slow")])
    with pytest.raises(pytest.UsageError, match="tests/test_d.py"):
        check_tiers([_Item("tests/test_d.py::test_w", "torch_api", "own_logic")])


# --------------------------------------------------------------------- parallel runs (tests/parallel_runs.py)

_WIRING = '''
import sys
sys.path.insert(0, {tests!r})
import parallel_runs

def pytest_collection_modifyitems(config, items):
    if parallel_runs.in_worker(config):
        parallel_runs.order_longest_first(config, items)

def pytest_collection_finish(session):
    parallel_runs.write_units(session.config, session.items)

def pytest_configure(config):
    parallel_runs.announce_groups_folder(config)

def pytest_sessionfinish(session):
    parallel_runs.remove_groups_folder(session.config)

def pytest_xdist_make_scheduler(config, log):
    return parallel_runs.make_scheduler(config, log)
'''

_SHARED = '''
import os, time
import pytest

@pytest.fixture(scope="module")
def spawn():
    with open("builds.txt", "a") as fh:
        fh.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    return "ranks"

@pytest.mark.parametrize("case", range(6))
def test_asks_while_running(request, case):
    time.sleep(0.2)
    with open("shared_ran.txt", "a") as fh:
        fh.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    assert request.getfixturevalue("spawn") == "ranks"
'''

_ALONE = '''
import time
import pytest

@pytest.mark.parametrize("case", range(6))
def test_alone(case):
    time.sleep(0.2)
'''


@pytest.mark.timeout(120)
def test_a_files_tests_share_its_module_fixture_on_one_worker(tmp_path: Path) -> None:
    """Under ``-n 2 --dist load`` a file whose tests ask for its module-scoped fixture only while running
    goes to one worker whole, so the fixture (in the suite, a spawn of gloo ranks) is built once; xdist's
    own scheduling would split the file over both workers and build it twice."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(_WIRING.format(tests=str(TESTS)))
    (tmp_path / "test_shared.py").write_text(_SHARED)
    (tmp_path / "test_alone.py").write_text(_ALONE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "load",
                           "-p", "no:cacheprovider", "-p", "no:randomly", "test_shared.py", "test_alone.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 passed" in proc.stdout, proc.stdout
    assert len((tmp_path / "builds.txt").read_text().split()) == 1, proc.stdout
    assert len(set((tmp_path / "shared_ran.txt").read_text().split())) == 1, proc.stdout
