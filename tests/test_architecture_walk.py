"""docs/architecture.md walks the step and a resume hop by hop, each row naming a file, a line and the call
made there. The walk stays true to the code: every row's line holds its call, and the step takes at most
six hops from the fit loop to ``optimizer.step()``."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.own_logic

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
    assert last.group(2) == "polytrain/core/precision.py" and last.group(4) == "optimizer.step(**kwargs)"
    assert max(numbers) <= 6


def _source(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def test_the_composed_strategy_asks_its_executor_instead_of_branching_on_pipeline() -> None:
    """``parallel.py`` keeps options and composition; what differs with a pipeline is the executor's,
    chosen once. At most three conditions there mention the pipeline."""
    branches = [line.strip() for line in _source("polytrain/strategies/parallel.py").splitlines()
                if re.match(r"\s*(if|elif|while)\b.*(pipeline|\.pp\b|\bpp\b)", line)
                or re.search(r"\bif\b.*(\.pp\b|pipeline).*\belse\b", line)]
    assert len(branches) <= 3, branches


def test_loop_state_changes_only_through_its_own_methods() -> None:
    """No module assigns a field of FitProgress or Stopping: ``trainer/loops/progress.py``'s methods do."""
    fields = ("epoch", "global_step", "batch_in_epoch", "batches_stepped", "validation_due", "at_epoch_end",
              "sample_base", "train_batch_size", "requested", "agreed", "out_of_time", "told_min")
    assignment = re.compile(r"\b(progress|p|stopping|s)\.(" + "|".join(fields) + r")\s*([+\-]?=)(?!=)")
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "polytrain")):
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), ROOT)
            owner = os.path.join("polytrain", "trainer", "loops", "progress.py")
            if not name.endswith(".py") or path == owner:
                continue
            for number, line in enumerate(_source(path).splitlines(), 1):
                if assignment.search(line):
                    found.append(f"{path}:{number}: {line.strip()}")
    assert not found, "loop state written outside trainer/loops/progress.py:\n" + "\n".join(found)


def test_only_the_trainer_and_the_lightning_facing_api_take_the_trainer() -> None:
    """Loop pieces get the collaborators they use. Under ``polytrain/trainer/`` only ``trainer.py`` holds
    the Trainer, and the module API that Lightning code expects to see it (``self.trainer`` in a module,
    a callback's ``trainer`` argument through the hook funnel): no other module imports the Trainer or
    has a parameter named ``trainer`` or typed ``Trainer``."""
    import ast

    allowed = {"trainer.py", os.path.join("api", "module.py"), os.path.join("api", "hooks.py")}
    base = os.path.join(ROOT, "polytrain", "trainer")
    found = []
    for folder, _, files in os.walk(base):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), base)
            if not name.endswith(".py") or rel in allowed:
                continue
            tree = ast.parse(_source(os.path.join("polytrain", "trainer", rel)))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "polytrain.trainer.trainer":
                    found.append(f"{rel}:{node.lineno} imports the Trainer")
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                    for arg in args:
                        annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                        if arg.arg == "trainer" or re.search(r"\bTrainer\b", annotation):
                            found.append(f"{rel}:{node.lineno} {node.name}({arg.arg}: {annotation})")
    assert not found, "modules under polytrain/trainer/ that take the Trainer:\n" + "\n".join(found)
