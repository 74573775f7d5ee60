"""The supported torch range is stated once (pyproject.toml) and tested at both ends (.ci/run): the
Makefile's lowest-end pins must be that range's lower bound, and the torch running this suite must
lie inside it (a venv that drifted outside the range would otherwise pass for a supported one)."""

from __future__ import annotations

import os
import re

import pytest
import torch

pytestmark = pytest.mark.torch_api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def test_makefile_lowest_end_is_the_declared_lower_bound_and_this_torch_is_in_range() -> None:
    low, high = re.search(r'"torch>=([\d.]+),<([\d.]+)"', _read("pyproject.toml")).groups()
    vision_low = re.search(r'"torchvision>=([\d.]+),<[\d.]+"', _read("pyproject.toml")).group(1)
    makefile = _read("Makefile")
    assert re.search(r"^TORCH_MIN := (\S+)$", makefile, re.M).group(1) == f"{low}.*"
    assert re.search(r"^TORCHVISION_MIN := (\S+)$", makefile, re.M).group(1) == f"{vision_low}.*"
    assert "make test-torch-min" in _read(".ci/run") and "make test\n" in _read(".ci/run")
    running = _version(torch.__version__)
    assert _version(low) <= running < _version(high), (
        f"torch {torch.__version__} is outside the supported range >={low},<{high} (pyproject.toml); "
        f"reinstall the venv (make clean && make test) or widen the range after testing that version")
