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
