"""The covering table printed at the end of a pytest run (tests/matrix/conftest.py), one row per case."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .cases import NAMES, Case


@dataclass
class Row:
    case: Case
    tolerance: float
    whole: float | None = None  # max |weight difference| of the uninterrupted run (None: did not run)
    resumed: float | None = None
    passed: bool = False
    skipped: bool = False


ROWS = pytest.StashKey[dict[str, Row]]()


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "0 (bitwise)" if x == 0 else f"{x:.1e}"


def format_table(rows: list[Row]) -> list[str]:
    headers = [*NAMES, "tolerance", "max diff", "resumed", "ok"]
    body = [[str(v) for v in r.case.values().values()]
            + ["bitwise" if r.tolerance == 0 else f"{r.tolerance:.0e}", _num(r.whole), _num(r.resumed),
               "yes" if r.passed else "skipped" if r.skipped else "NO"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths]), *(line(b) for b in body)]
