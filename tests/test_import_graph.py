"""The import structure of the package: layers that point one way, no circles, few late imports.

polytrain is layered (docs/architecture.md). A module may import, at run time, only modules of a
lower layer or of its own package:

    4  polytrain (the package's lazy exports), polytrain.cli, polytrain.__main__
    3  polytrain.trainer                      the loop; wires strategies and callbacks together
    2  polytrain.strategies, polytrain.callbacks
    1  polytrain.data, polytrain.checkpoint, polytrain.parallel, polytrain.layers
    0  polytrain.core                         errors, precision, batches, collectives, environment

``if TYPE_CHECKING:`` imports do not run, so they may name the Trainer for annotations, but only
where listed in ``TYPING_ONLY``. An import inside a function is allowed only for a heavy or optional
third-party module, with its reason on the same line (``# late: ...``); their number may only fall.

The graph is read from the source with ``ast`` (nothing is imported), so the test also fails on
code paths no other test runs.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.own_logic

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "polytrain"

LAYERS = {
    "polytrain.core": 0,
    "polytrain.data": 1,
    "polytrain.checkpoint": 1,
    "polytrain.parallel": 1,
    "polytrain.layers": 1,
    "polytrain.strategies": 2,
    "polytrain.callbacks": 2,
    "polytrain.trainer": 3,
    "polytrain.cli": 4,
    "polytrain.__main__": 4,
    "polytrain": 4,
}

TOP = max(LAYERS.values())  # the entry points may import each other

# (importing package, imported package) pairs allowed under ``if TYPE_CHECKING:`` only.
TYPING_ONLY = {("polytrain.callbacks", "polytrain.trainer")}

# Function-level imports in the package. Lower this when you remove one; never raise it to make
# room for an import that only dodges a circle (restructure instead). An optional extra is imported
# where it is asked for (mlflow, wandb, torchao for trainer.float8): each of those counts here.
# 10: torch.utils.flop_counter (core/lazy.py), 80 ms off every Trainer import; 11: safetensors, the hf extra
LATE_IMPORT_BUDGET = 11


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str  # "module" | "function" | "typing"
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


MODULES = _modules()


def _package(name: str) -> str:
    """The layer-table entry a module belongs to (longest matching prefix)."""
    best = ""
    for prefix in LAYERS:
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return best


def _resolve(base: str, names: list[str]) -> list[str]:
    """``from base import a, b``: the modules that brings in (``base.a`` when that is a module)."""
    found = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
    return found or [base]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, source_lines: list[str]) -> None:
        self.module = module
        self.lines = source_lines
        self.edges: list[Edge] = []
        self.late: list[tuple[str, int, str]] = []  # (module, line, text) of every function-level import
        self._depth = 0
        self._typing = 0

    def _kind(self) -> str:
        return "typing" if self._typing else ("function" if self._depth else "module")

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node):
            self._typing += 1
            for child in node.body:
                self.visit(child)
            self._typing -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _record(self, node: ast.stmt, targets: list[str]) -> None:
        kind = self._kind()
        if kind == "function":
            self.late.append((self.module, node.lineno, self.lines[node.lineno - 1].strip()))
        for target in targets:
            if target == "polytrain" or target.startswith("polytrain."):
                self.edges.append(Edge(self.module, target, kind, node.lineno))

    def visit_Import(self, node: ast.Import) -> None:
        self._record(node, [alias.name for alias in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = self.module.split(".")
            is_package = MODULES[self.module].name == "__init__.py"
            anchor = package if is_package else package[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names = [alias.name for alias in node.names]
        self._record(node, _resolve(base, names) if base.startswith("polytrain") else [base])


def _collect() -> tuple[list[Edge], list[tuple[str, int, str]]]:
    edges, late = [], []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        collector = _Collector(name, text.splitlines())
        collector.visit(ast.parse(text, filename=str(path)))
        edges += collector.edges
        late += collector.late
    return edges, late


EDGES, LATE = _collect()


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over run-time imports."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        if e.kind != "typing" and e.target in graph and e.target != e.source:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = [m for m in MODULES if not _package(m)]
    assert not unplaced, f"modules outside every layer (add their package to LAYERS): {unplaced}"


def test_no_import_circles() -> None:
    cycles = _cycles(EDGES)
    detail = "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(
            f"{e.source}:{e.line} imports {e.target}" for e in EDGES
            if e.source in c and e.target in c and e.kind != "typing")
        for c in cycles)
    assert not cycles, f"import circles between polytrain modules:\n{detail}"


def test_imports_point_down() -> None:
    upward = []
    for e in EDGES:
        src, dst = _package(e.source), _package(e.target)
        if not dst or src == dst or e.target in (src, "polytrain.core"):
            continue  # same package, or the bottom layer itself
        if e.kind == "typing" and (src, dst) in TYPING_ONLY:
            continue
        if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src] < TOP):
            upward.append(f"{e.source}:{e.line} ({e.kind}) imports {e.target}: "
                          f"layer {LAYERS[src]} -> {LAYERS[dst]}")
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_core_imports_nothing_above_it() -> None:
    bad = [f"{e.source}:{e.line} imports {e.target}" for e in EDGES
           if _package(e.source) == "polytrain.core" and _package(e.target) != "polytrain.core"]
    assert not bad, "polytrain.core must not import the layers above it:\n" + "\n".join(bad)


def test_no_function_level_import_of_polytrain() -> None:
    late = [f"{e.source}:{e.line} imports {e.target}" for e in EDGES if e.kind == "function"]
    assert not late, ("polytrain modules imported inside functions hide the real dependencies (usually a "
                      "circle being dodged); import them at module level:\n" + "\n".join(late))


def test_late_imports_say_why_and_only_fall() -> None:
    unexplained = [f"{m}:{line}: {text}" for m, line, text in LATE if "# late:" not in text]
    assert not unexplained, ("a function-level import needs its reason on the same line (`# late: ...`), "
                             "or move it to module level:\n" + "\n".join(unexplained))
    listing = "\n".join(f"  {m}:{line}: {text}" for m, line, text in LATE)
    assert len(LATE) <= LATE_IMPORT_BUDGET, (
        f"{len(LATE)} function-level imports, budget {LATE_IMPORT_BUDGET}: the count may only fall. "
        f"Load the new one at module level, or remove another:\n{listing}")
    assert len(LATE) == LATE_IMPORT_BUDGET, (
        f"only {len(LATE)} function-level imports remain: lower LATE_IMPORT_BUDGET in {__file__} "
        f"to {len(LATE)}")


def test_the_collector_sees_a_circle_and_an_upward_import() -> None:
    """The checks above can fail: a planted circle and upward import are found."""
    planted = [Edge("polytrain.core.batch", "polytrain.trainer.loops.fit_loop", "module", 1),
               Edge("polytrain.trainer.loops.fit_loop", "polytrain.core.batch", "module", 1)]
    assert any({"polytrain.core.batch", "polytrain.trainer.loops.fit_loop"} <= set(c)
               for c in _cycles(EDGES + planted))
    src, dst = _package(planted[0].source), _package(planted[0].target)
    assert LAYERS[dst] > LAYERS[src]
