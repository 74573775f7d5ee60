"""score.py WORK LIGHTNING_TESTS FILES: the share of Lightning's public-behaviour cases that pass.

A case is *internal* when its test function's own source (decorators included) reaches Lightning's
private surface: a ``._name`` attribute, a private import, ``mock.patch`` of a module path or a private
method, ``strategy.connect`` or the loops' internals; the figure leaves those out. Every case, with its
kind, status and message, goes to ``WORK/classified.tsv``."""

from __future__ import annotations

import ast
import collections
import re
import sys
import xml.etree.ElementTree as ET

PRIVATE = re.compile(
    r"(?<![\w_])\w+\._(?!_)[A-Za-z]|\bimport _"
    r"|\b_(ResultCollection|FitLoop|EvaluationLoop|FxValidator|request_dataloader|TrainerFabricShim)\b"
    r"|patch(\.object)?\(\s*[\"'](polytrain|lightning)\.|patch\.object\([^)]*[\"']_[a-z]"
    r"|strategy\.connect\(|\.(epoch_loop|_data_connector|batch_progress|epoch_progress)\b")


def kinds(tests_root: str, files: list[str]) -> dict[tuple[str, str], str]:
    """``(module, test name) -> "public" | "internal"`` for every test function of ``files``."""
    found: dict[tuple[str, str], str] = {}
    for name in files:
        with open(f"{tests_root}/{name}", encoding="utf-8") as fh:
            source = fh.read()
        _visit(ast.parse(source).body, name[:-3].replace("/", "."), None, source.splitlines(), found)
    return found


def _visit(nodes: list[ast.stmt], module: str, owner: str | None, lines: list[str],
           found: dict[tuple[str, str], str]) -> None:
    for node in nodes:
        if isinstance(node, ast.ClassDef):
            _visit(node.body, module, node.name, lines, found)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            body = "\n".join(lines[first - 1:node.end_lineno])
            key = (module if owner is None else f"{module}.{owner}", node.name)
            found[key] = "internal" if PRIVATE.search(body) else "public"


def main(work: str, tests_root: str, files_list: str) -> None:
    with open(files_list, encoding="utf-8") as fh:
        files = fh.read().split()
    known = kinds(tests_root, files)
    score: collections.Counter[tuple[str, str]] = collections.Counter()
    with open(f"{work}/classified.tsv", "w", encoding="utf-8") as out:
        for case in ET.parse(f"{work}/result.xml").getroot().iter("testcase"):
            module = case.get("classname", "").removeprefix("tests_pytorch.")
            status, message = "pass", ""
            for verdict in ("failure", "error", "skipped"):
                element = case.find(verdict)
                if element is not None:
                    status = verdict
                    message = (element.get("message") or "")[:200].replace("\n", " ").replace("\t", " ")
            base = case.get("name", "").split("[")[0]
            kind = known.get((module, base), "public")
            score[(kind, status)] += 1
            out.write("\t".join([kind, status, module, case.get("name", ""), message]) + "\n")
    for kind in ("public", "internal"):
        counts = {s: score[(kind, s)] for s in ("pass", "failure", "error", "skipped")}
        ran = counts["pass"] + counts["failure"] + counts["error"]
        share = (f" -> {counts['pass']}/{ran} = {100 * counts['pass'] / ran:.1f}% of those that run"
                 if ran else "")
        print(f"{kind}: {counts}{share}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
