"""docs/architecture.md walks the step and a resume hop by hop, each row naming a file, a line and the call
made there. The walk stays true to the code: every row's line holds its call, and the step takes at most
six hops from the fit loop to ``optimizer.step()``."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"`(polytrain/[\w/]+\.py):(\d+)` \| `([^`]+)`")
HOP = re.compile(r"^\| (\d+) \| `(polytrain/[\w/]+\.py):(\d+)` \| `([^`]+)` \|$")


def _doc() -> str:
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as fh:
        return fh.read()


def test_every_row_of_the_walk_names_the_line_that_makes_its_call() -> None:
    rows = ROW.findall(_doc())
    assert len(rows) >= 15, rows  # the step (two paths), forward and backward, the resume
    wrong = []
    for path, line, call in rows:
        with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        held = lines[int(line) - 1] if int(line) <= len(lines) else ""
        if call not in held:
            wrong.append(f"{path}:{line} holds {held.strip()!r}, not {call!r}")
    assert not wrong, "docs/architecture.md's walk is out of date:\n" + "\n".join(wrong)


def test_the_step_reaches_optimizer_step_within_six_hops_from_the_fit_loop() -> None:
    hops = [HOP.match(line) for line in _doc().splitlines()]
    numbers = [int(m.group(1)) for m in hops if m is not None]
    assert numbers[:6] == [1, 2, 3, 4, 5, 6], numbers  # the closure path, in order
    assert hops[[i for i, m in enumerate(hops) if m is not None][0]].group(2).endswith("fit_loop.py")
    last = [m for m in hops if m is not None and int(m.group(1)) == 6][0]
    assert last.group(2) == "polytrain/core/precision.py" and last.group(4) == "optimizer.step()"
    assert max(numbers) <= 6
