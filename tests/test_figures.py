"""The pictures in the docs are made by scripts in the repository (``make figures``): the drawings are
exactly what ``docs/figures/diagrams.py`` draws, and ``docs/figures/curves.py`` draws a run's curves from its
own metrics.csv (here one the test writes, as the CSV logger writes it: a row per logging call)."""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.own_logic

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"figures_{name}", FIGURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_drawings_are_what_the_script_draws() -> None:
    diagrams = _load("diagrams")
    for name, draw in diagrams.DRAWINGS.items():
        assert (FIGURES / name).read_text(encoding="utf-8") == draw(), (
            f"run python docs/figures/diagrams.py ({name})")
    mesh = diagrams.mesh_svg()
    assert all(f"rank {r}</text>" in mesh for r in range(8))


def test_the_docs_show_the_pictures() -> None:
    root = FIGURES.parent.parent
    assert "docs/figures/digits-curves.png" in (root / "README.md").read_text(encoding="utf-8")
    assert "figures/fit.svg" in (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "../figures/mesh.svg" in (root / "docs" / "strategies" / "composition.md").read_text(
        encoding="utf-8")
    assert (FIGURES / "digits-curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curves_are_drawn_from_a_runs_metrics_csv(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # a dev extra; the docs extra installs it alone
    rows = [{"step": s, "epoch": s // 4, "train/loss": 2.0 / s} for s in range(1, 13)]
    rows += [{"step": s, "epoch": s // 4 - 1, "val/loss": 1.0 / s, "val/acc": 0.5 + s / 30}
             for s in (4, 8, 12)]
    rows += [{"step": s, "lr-SGD": 0.1 / s} for s in range(1, 13)]
    metrics = tmp_path / "metrics.csv"
    with open(metrics, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=["step", "epoch", "train/loss", "val/loss", "val/acc",
                                                "lr-SGD"])
        writer.writeheader()
        writer.writerows(rows)
    curves = _load("curves")
    series = curves.read_series(str(metrics))
    assert sorted(series) == ["lr-SGD", "train/loss", "val/acc", "val/loss"] and len(series["val/acc"]) == 3
    out = tmp_path / "curves.png"
    curves.draw(series, str(out), "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(out) > 10_000
