"""The architecture's rules that a reading of the source can check: the composed strategy asks its executor
instead of branching on the pipeline, loop state changes only through its own methods, and only the
Trainer and Lightning's API take the Trainer. (The step's path is checked on the running code:
tests/test_step_stack.py.)"""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.own_logic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def test_the_composed_strategy_asks_its_executor_instead_of_branching_on_pipeline() -> None:
    """``parallel.py`` keeps options and composition; what differs with a pipeline is the executor's,
    chosen once. At most three conditions there mention the pipeline."""
    branches = [line.strip() for line in _source("polytrain/strategies/composed.py").splitlines()
                if re.match(r"\s*(if|elif|while)\b.*(pipeline|\.pp\b|\bpp\b)", line)
                or re.search(r"\bif\b.*(\.pp\b|pipeline).*\belse\b", line)]
    assert len(branches) <= 3, branches


def test_loop_state_changes_only_through_its_own_methods() -> None:
    """No module assigns a field of FitProgress or Stopping: ``trainer/loops/progress.py``'s methods do."""
    fields = ("epoch", "global_step", "batch_in_epoch", "total_batches", "batch_index", "total_unknown",
              "is_last_batch", "batches_stepped", "validation_due", "at_epoch_end",
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
