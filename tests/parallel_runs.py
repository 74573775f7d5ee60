"""How ``pytest -n N`` (pytest-xdist; ``make test``) spreads the suite over its worker processes.

Each test goes alone to whichever worker is free, except tests that share a fixture wider than one test:
those go together, as one unit, to one worker, so the fixture is built once (a module's spawn of gloo
ranks, the reliability battery's background jobs, which must start in one process only). A module-scoped
fixture makes one unit of its module's tests; a package- or session-scoped one makes one unit of every
test under the folder whose conftest defines it; pytest's and plugins' own wide fixtures
(``tmp_path_factory``) group nothing. A file marked ``pytest.mark.one_worker`` is one unit too: its tests
share work the module caches (``functools.cache``), which each worker would otherwise do again.

Fixtures are known where the tests are collected, in the workers; the scheduler runs in the controller,
which collects nothing. So each worker writes every test's unit to a file in a folder the controller
made (``GROUPS_ENV``), and the controller's scheduler reads it once the workers have collected. (xdist's
own ``--dist loadgroup`` renames the tests' node ids to carry their group, which pytest 9.2's derived node
ids no longer allow.)

Units go out longest first, by the durations this machine's last run recorded in pytest's cache, where
there are some (each test's, summed over its unit); else units of several tests first, biggest first, then
the rest in collection order. A long unit started last would keep one worker busy alone at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import pytest

GROUPS_ENV = "POLYTRAIN_TEST_GROUPS"  # the folder the workers write their units to
MADE_FOLDER = pytest.StashKey[str]()  # the controller's: the folder it made, removed when the run ends
DURATIONS_KEY = "polytrain/durations"  # pytest's cache: each test's seconds (setup, call, teardown) last run


def modules_with_own_wide_fixtures(items: list[Any]) -> set[str]:
    """The test files that define a module-scoped fixture of their own. All of such a file's tests are one
    unit, whether they name the fixture or ask for it while running (``request.getfixturevalue``): pytest
    tears a module's fixtures down as soon as a test of another file runs, so a file's tests split between
    workers, or with another file's tests between them, would build the fixture (a spawn of gloo ranks)
    again and again."""
    from _pytest.fixtures import getfixturemarker

    files: dict[str, Any] = {}
    for item in items:
        if getattr(item, "module", None) is not None:
            files.setdefault(item.nodeid.split("::")[0], item.module)
    return {path for path, module in files.items()
            if any(getattr(getfixturemarker(value), "scope", None) == "module"
                   for value in vars(module).values())}


def shared_fixture_group(item: Any, modules: set[str] = frozenset()) -> str | None:
    """The unit of tests ``item`` must run with (None: it may run alone); ``modules``: the files whose
    tests are one unit whatever they name (``modules_with_own_wide_fixtures``)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a test function (no fixtures to share)
        return None
    folder, module = None, None
    if item.nodeid.split("::")[0] in modules or item.get_closest_marker("one_worker") is not None:
        module = item.nodeid.split("::")[0]
    for name in info.names_closure:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if not fixturedef.baseid:  # pytest's or a plugin's
                continue
            if fixturedef.scope in ("package", "session"):
                # the widest wins: a folder's fixtures are shared by every test under it
                folder = fixturedef.baseid if folder is None else min(folder, fixturedef.baseid, key=len)
            elif fixturedef.scope == "module":
                module = item.nodeid.split("::")[0]
    return folder or module


def units_of(items: list[Any]) -> dict[str, str]:
    """Every test's unit: its shared fixtures' group, or its own node id."""
    modules = modules_with_own_wide_fixtures(items)
    return {item.nodeid: shared_fixture_group(item, modules) or item.nodeid for item in items}


def order_longest_first(config: pytest.Config, items: list[Any]) -> None:
    """Collection order, which the scheduler keeps: the longest units first (see the module's docstring)."""
    units = units_of(items)
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    durations = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    size: dict[str, float] = {}
    for nodeid, unit in units.items():
        size[unit] = size.get(unit, 0.0) + (durations.get(nodeid, 0.0) if durations else 1.0)
    if not durations:  # no record: several tests before one, the biggest first
        size = {unit: n if n > 1 else 0.0 for unit, n in size.items()}
    first_seen = {unit: i for i, unit in reversed(list(enumerate(units[item.nodeid] for item in items)))}
    items.sort(key=lambda item: (-size[units[item.nodeid]], first_seen[units[item.nodeid]]))


def in_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def announce_groups_folder(config: pytest.Config) -> None:
    """In the controller of a parallel run, before the workers start: the folder they write their units to
    (they inherit the environment)."""
    if not in_worker(config) and getattr(config.option, "numprocesses", None):
        config.stash[MADE_FOLDER] = os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="polytrain-test-units-")


def write_units(config: pytest.Config, items: list[Any]) -> None:
    """In a worker, once its collection is final: every test's unit, for the controller's scheduler."""
    folder = os.environ.get(GROUPS_ENV)
    if folder and in_worker(config):
        path = os.path.join(folder, f"{config.workerinput['workerid']}.json")
        with open(f"{path}.tmp", "w", encoding="utf-8") as fh:
            json.dump(units_of(items), fh)
        os.replace(f"{path}.tmp", path)  # whole or absent when the controller reads it


def record_durations(config: pytest.Config) -> None:
    """In the controller (or a serial run), at the end: each test's seconds, for the next run's order."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    if cache is None or in_worker(config) or reporter is None:
        return
    reports = [report for reports in reporter.stats.values() for report in reports]
    durations = dict(cache.get(DURATIONS_KEY, {}))
    ran: dict[str, float] = {}
    for report in reports:
        if getattr(report, "when", None) in ("setup", "call", "teardown"):
            ran[report.nodeid] = ran.get(report.nodeid, 0.0) + report.duration
    durations.update(ran)
    cache.set(DURATIONS_KEY, durations)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The controller's scheduler under ``--dist load`` (what ``-n N`` alone asks for; other modes are
    xdist's): xdist's scope scheduling, its scopes our units, queued in the workers' collection order
    (longest first), not xdist's (most tests first)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class SharedFixtureScheduling(LoadScopeScheduling):
        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self._units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:  # first asked once every worker has collected, and written its file
                self._units = read_units()
            return self._units.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


def remove_groups_folder(config: pytest.Config) -> None:
    folder = config.stash.get(MADE_FOLDER, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def read_units() -> dict[str, str]:
    folder = os.environ.get(GROUPS_ENV)
    if not folder or not os.path.isdir(folder):
        return {}
    files = sorted(name for name in os.listdir(folder) if name.endswith(".json"))
    if not files:
        return {}
    with open(os.path.join(folder, files[0]), encoding="utf-8") as fh:  # every worker collected the same
        return json.load(fh)
