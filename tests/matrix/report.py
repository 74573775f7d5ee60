"""The covering table printed at the end of a pytest run (tests/matrix/conftest.py), one row per case.

A row travels from the test to the summary in the test report's ``user_properties`` (plain values), so the
table is whole when the cases ran in pytest-xdist's workers and the summary is printed by the controller."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .cases import NAMES

PROPERTY = "matrix_row"  # the user_properties key a case's row travels under


@dataclass
class Row:
    name: str  # the case's name (its test id)
    values: dict[str, Any]  # the case's value of each dimension, in NAMES order
    tolerance: float
    whole: float | None = None  # max |weight difference| of the uninterrupted run (None: did not run)
    resumed: float | None = None
    passed: bool = False
    skipped: bool = False

    def as_property(self) -> tuple[str, dict[str, Any]]:
        return PROPERTY, asdict(self)


def rows_of(reports: Iterable[Any]) -> list[Row]:
    """The rows the cases' reports carry, in the order the cases ran."""
    rows: dict[str, Row] = {}
    for report in reports:
        if getattr(report, "when", None) != "call":
            continue
        for key, value in getattr(report, "user_properties", ()):
            if key == PROPERTY:
                rows[value["name"]] = Row(**value)
    return list(rows.values())


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "0 (bitwise)" if x == 0 else f"{x:.1e}"


def format_table(rows: list[Row]) -> list[str]:
    headers = [*NAMES, "tolerance", "max diff", "resumed", "ok"]
    body = [[str(r.values[name]) for name in NAMES]
            + ["bitwise" if r.tolerance == 0 else f"{r.tolerance:.0e}", _num(r.whole), _num(r.resumed),
               "yes" if r.passed else "skipped" if r.skipped else "NO"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths]), *(line(b) for b in body)]
