"""The matrix's timeouts under ``--matrix-full`` (the option is declared in tests/conftest.py) and its
covering table in the terminal summary (printed under ``-q`` too)."""

from __future__ import annotations

from typing import Any

import pytest

from .report import format_table, rows_of


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--matrix-full"):
        for item in items:
            if "tests/matrix" in item.nodeid:
                item.add_marker(pytest.mark.timeout(6 * 3600))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    # The rows come with the reports (the controller's, under pytest-xdist), not from this process's tests.
    rows = rows_of(report for reports in terminalreporter.stats.values() for report in reports)
    if not rows:
        return
    full = config.getoption("--matrix-full")
    terminalreporter.write_sep("=", f"feature matrix: {len(rows)} cases "
                                    f"({'full product' if full else 'all pairs'}), "
                                    f"max |weight - reference|")
    for line in format_table(rows):
        terminalreporter.write_line(line)
