"""``python -m tests.matrix [--full] [pytest args]``: the matrix's tests; ``--full`` runs the whole
product."""

from __future__ import annotations

import os
import sys

import pytest

if __name__ == "__main__":
    args = sys.argv[1:]
    full = "--full" in args
    args = [a for a in args if a != "--full"]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(pytest.main(["-q", here, *(["--matrix-full"] if full else []), *args]))
