"""``_target_`` entries checked from their source, before torch loads. ``polytrain`` reads the file that
defines a config's class (with ``ast``; nothing is imported or run) and matches the keys it is given
against its ``__init__``, so a misspelt argument of ``module:``, ``data:`` or a callback answers in a
tenth of a second instead of after torch's import.

The reading decides only what the source settles: a class defined once at the top of its module, with
its own ``__init__`` (or no ``__init__`` and no base), no decorator, metaclass, ``__new__`` or
``__signature__``; a plain function; a name bound through ``from ... import`` or through the lazy
export table (``_EXPORTS``) polytrain's own packages use. Anything else (a base class's inherited
``__init__``, a module a custom import hook provides, names made at run time) is undecided, and the
check after torch loads (``targets.check_run_targets``, which imports the class) answers it. The
entries are read in that check's order and the reading stops at the first undecided one, so the first
error said is the one the import would say. A class's own ``__init__`` is taken as its signature: a
metaclass inherited from a base that rewrites the call (rare) is not seen here.
"""

from __future__ import annotations

import ast
import importlib.machinery
import inspect
import sys
from typing import Any

from polytrain.trainer.configuration.targets import check_signature, missing_attribute, search_from

MAX_HOPS = 8  # re-exports followed (from a package's __init__ to the module defining the class)


class Undecided(Exception):
    """The source alone does not settle what importing would find."""


def _source_of(module_name: str) -> tuple[str, bool]:
    """(the file defining ``module_name``, whether it is a package's ``__init__``), found as the import
    system's path finder would find it, without running the module or its parents."""
    parts = module_name.split(".")
    search: Any = sys.path
    spec = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = loaded.__spec__
        else:
            spec = importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None:
            raise Undecided(name)  # perhaps a custom finder's module: the import decides
        search = spec.submodule_search_locations
        if depth < len(parts) and search is None:
            raise Undecided(name)
    if spec is None or not isinstance(spec.origin, str) or not spec.origin.endswith(".py"):
        raise Undecided(module_name)
    return spec.origin, spec.submodule_search_locations is not None


def _tree(path: str) -> ast.Module:
    try:
        with open(path, encoding="utf-8") as fh:
            return ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        raise Undecided(path) from None  # the import will say what is wrong with the file


def _bound_names(statements: list[ast.stmt]) -> dict[str, list[ast.stmt]]:
    """Each name the module's top level binds -> the statements binding it (inside ``if``/``try`` too)."""
    bound: dict[str, list[ast.stmt]] = {}
    for node in statements:
        names: list[str] = []
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.asname or alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                for name, found in _bound_names(getattr(node, field, None) or []).items():
                    # bound under a condition: the import decides whether it exists
                    bound.setdefault(name, []).extend([node, *found])
        for name in names:
            bound.setdefault(name, []).append(node)
    return bound


def _dynamic(tree: ast.Module) -> bool:
    """Can the module's names come from somewhere the source does not show?"""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return True
        if isinstance(node, ast.Name) and node.id in ("globals", "setattr", "exec", "vars"):
            return True
    return False


def _exports(tree: ast.Module) -> dict[str, str]:
    """polytrain's lazy export table: ``_EXPORTS = {"Name": "package.module", ...}`` read by the module's
    ``__getattr__``."""
    for node in tree.body:
        named = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if isinstance(node, ast.Assign) and "_EXPORTS" in named:
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return table if isinstance(table, dict) else {}
    return {}


def _imported_module(node: ast.ImportFrom, module_name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module_name if is_package else module_name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _definition(module_name: str, attr: str, where: str, target: str, hops: int = 0) -> tuple[ast.AST, str]:
    """The class or function ``module_name.attr`` names in the source, following re-exports; raises
    ``Undecided`` where the source does not settle it, and the import's own error where it does."""
    if hops > MAX_HOPS:
        raise Undecided(target)
    path, is_package = _source_of(module_name)
    tree = _tree(path)
    if _dynamic(tree):
        raise Undecided(module_name)
    bound = _bound_names(tree.body)
    exports = _exports(tree) if "__getattr__" in bound else {}
    if attr in exports and attr not in bound:
        return _definition(exports[attr], attr, where, target, hops + 1)
    if attr not in bound:
        if is_package or "__getattr__" in bound:
            raise Undecided(target)  # a submodule, or a name the module makes when asked
        raise missing_attribute(where, target, {*bound, *exports})
    [node, *others] = bound[attr]
    if others or node not in tree.body:
        raise Undecided(target)  # bound twice, or under a condition
    if isinstance(node, ast.ImportFrom):
        [alias] = [a for a in node.names if (a.asname or a.name) == attr]
        source = _imported_module(node, module_name, is_package)
        return _definition(source, alias.name, where, target, hops + 1)
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node, path
    raise Undecided(target)  # an assignment or a plain import: a value the source does not show


def _parameters(args: ast.arguments) -> list[inspect.Parameter]:
    kind = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [kind(a.arg, kind.POSITIONAL_ONLY if i < len(args.posonlyargs) else kind.POSITIONAL_OR_KEYWORD,
                   default=kind.empty if d is None else ast.unparse(d))
              for i, (a, d) in enumerate(zip(positional, defaults, strict=True))]
    if args.vararg is not None:
        params.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
    params += [kind(a.arg, kind.KEYWORD_ONLY, default=kind.empty if d is None else ast.unparse(d))
               for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg is not None:
        params.append(kind(args.kwarg.arg, kind.VAR_KEYWORD))
    return params


def _constructor(node: ast.AST, target: str) -> inspect.Signature:
    """What calling the class (or function) takes, as its source says; ``Undecided`` otherwise."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.decorator_list:
            raise Undecided(target)
        return inspect.Signature(_parameters(node.args))
    assert isinstance(node, ast.ClassDef)
    if node.decorator_list or node.keywords:
        raise Undecided(target)  # a decorator (dataclass, ...) or a metaclass may make the signature
    methods = {item.name: item for item in node.body
               if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if {"__new__", "__signature__"} & {*methods, *_bound_names(node.body)}:
        raise Undecided(target)
    init = methods.get("__init__")
    if init is None:
        if node.bases:
            raise Undecided(target)  # inherited: the base's __init__, which may live anywhere
        return inspect.Signature([])  # object's: no arguments
    params = _parameters(init.args)
    if init.decorator_list or not params or params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        raise Undecided(target)
    return inspect.Signature(params[1:])  # without self


def _check(spec: dict[str, Any], where: str) -> None:
    """One entry, nested ``_target_`` mappings first (as ``targets.check_spec`` goes)."""
    target = spec.get("_target_")
    if not isinstance(target, str) or "." not in target:
        raise Undecided(where)  # the full check words these
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    for key, value in kwargs.items():
        if isinstance(value, dict) and "_target_" in value:
            _check(value, f"{where}.{key}")
    module_name, _, attr = target.rpartition(".")
    node, _ = _definition(module_name, attr, where, target)
    check_signature(_constructor(node, target), kwargs, where, target)


def check_targets_from_source(config: dict[str, Any]) -> None:
    """``targets.check_run_targets`` as far as the source settles it, without importing anything: the
    first wrong argument (or missing class) raises the ``ConfigError`` the import would raise."""
    search_from(config.get("config_dir"))  # where the import will look, in the same order
    entries = [(config.get("module"), "module"), (config.get("data"), "data")]
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    entries += [(spec, f"trainer.callbacks[{i}]") for i, spec in enumerate(callbacks)
                if isinstance(spec, dict)]
    try:
        for spec, where in entries:
            if spec is not None:
                _check(spec, where)
    except Undecided:
        return  # from here on the check after torch loads answers
