"""Each case of the feature matrix trains to the weights of the plain-PyTorch reference.

Cases (tests/matrix/cases.py): the all-pairs covering set of strategy x precision x accumulation x
optimizers x dropout x DataLoader workers x resume point x clipping x SGD implementation x validation
schedule, or with ``--matrix-full``
(``python -m tests.matrix --full``) every valid case of the product. All multi-rank cases run in one
spawn of two gloo ranks; ``single`` cases in this process. Each invalid combination has a test that
polytrain still refuses it. The table of cases and measured differences ends the pytest output.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from distributed import run_distributed

from .cases import INVALID, Case, all_pairs, covering_cases, full_cases, is_valid, pairs_of, tolerance
from .reference import reference
from .report import Row
from .runner import run_cases, spawn_worker

pytestmark = pytest.mark.torch_api

SPAWN_SECONDS = 60.0 + 20.0  # start-up and refusals, plus per multi-rank case (below)
PER_CASE_SECONDS = 15.0


REFUSED_WITH = {  # the invalid combinations' errors, as polytrain words them
    (("strategy", "tensor"), ("precision", "16-mixed")):
        r"ConfigError: precision '16-mixed' is not supported by "
        r"tensor parallelism",
    (("strategy", "pipeline"), ("precision", "16-mixed")):
        r"ConfigError: precision '16-mixed' is not supported by "
        r"the pipeline strategy",
    (("strategy", "pipeline"), ("optimizers", 2), ("clip", True)):
        r"ConfigError: gradient clipping by norm under pipeline parallelism .* "
        r"same optimizers in the same order",
    (("precision", "16-mixed"), ("impl", "fused")):
        r"ConfigError: optimizer 0 is SGD\(fused=True, momentum=0.9\) under precision '16-mixed' on CPU",
}


def _cases(config: pytest.Config) -> list[Case]:
    return full_cases() if config.getoption("--matrix-full") else covering_cases()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        cases = _cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[c.name for c in cases])


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's polytrain results by name (rank 0's weights, or a traceback), and the refusals."""
    root = str(tmp_path_factory.mktemp("matrix"))
    cases = _cases(request.config)
    multi = [c for c in cases if c.world > 1]
    timeout = SPAWN_SECONDS + PER_CASE_SECONDS * len(multi)
    results = run_distributed(spawn_worker, 2, multi, root, timeout=timeout)[0]
    results.update(run_cases([c for c in cases if c.world == 1], root))
    return results


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_case_matches_the_reference(case: Case, runs: dict[str, Any], request: pytest.FixtureRequest) -> None:
    tol, why = tolerance(case)
    row = Row(case.name, case.values(), tol)
    try:
        _compare(case, runs, row, tol, why)
    finally:
        request.node.user_properties.append(row.as_property())  # for the table (tests/matrix/conftest.py)


def _compare(case: Case, runs: dict[str, Any], row: Row, tol: float, why: str) -> None:
    got = runs.get(case.name)
    if got is None:
        pytest.fail(f"{case.name} did not run (an earlier case of its spawn failed)", pytrace=False)
    if isinstance(got, str):
        pytest.fail(f"{case.name} raised:\n{got}", pytrace=False)
    want = reference(case)
    assert want["net.0.weight"].ne(build_weights()["net.0.weight"]).any(), "the reference did not train"
    row.whole = _max_diff(got["whole"], want)
    row.resumed = _max_diff(got["resumed"], want) if case.resume != "none" else None
    worst = max(row.whole, row.resumed or 0.0)
    assert worst <= tol, (f"{case.name}: weights differ from the plain-PyTorch reference by {row.whole:.3e} "
                          f"(resumed: {row.resumed}); allowed {tol:g} because {why}")
    row.passed = True


def build_weights() -> dict[str, torch.Tensor]:
    from .model import SEED, build

    torch.manual_seed(SEED)
    return {f"net.{k}": v for k, v in build(False).state_dict().items()}


def test_the_covering_set_holds_every_valid_pair_and_no_invalid_combination() -> None:
    cases = covering_cases()
    covered = set().union(*(pairs_of(c.values()) for c in cases))
    assert all_pairs() <= covered, sorted(all_pairs() - covered)[:5]
    assert all(is_valid(c.values()) for c in cases)
    assert cases == covering_cases(), "the generator must be deterministic"
    assert len(cases) < len(full_cases()) // 20
    assert set(REFUSED_WITH) == set(INVALID), "every invalid combination needs its refusal pattern"


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("combo", list(INVALID), ids=lambda c: "+".join(f"{k}={v}" for k, v in c))
def test_an_invalid_combination_is_still_refused(combo: tuple, runs: dict[str, Any]) -> None:
    message = runs["refusals"][repr(combo)]
    assert message, f"polytrain now accepts {combo}: move it into the matrix (INVALID says: {INVALID[combo]})"
    assert re.search(REFUSED_WITH[combo], message, re.S), message
