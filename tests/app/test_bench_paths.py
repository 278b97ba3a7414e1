"""The benchmark's in-process paths still run against the code they measure.

bench/run.py measures; these only run its in-process pieces once, so that a change of the
servicer or the limiter that breaks them (the servicer came to read its message from the
call, on a task: the bench drove it bare and stopped with "no running event loop") fails
here rather than in the next benchmark run. No figure is judged.
"""

import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.unit


@pytest.fixture
def inproc():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import inproc as module

        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_the_servicer_path_runs(inproc) -> None:  # type: ignore[no-untyped-def]
    result = inproc.servicer_cost()
    assert set(result) == {"us_per_request"} and result["us_per_request"] > 0


def test_the_recompute_path_runs(inproc) -> None:  # type: ignore[no-untyped-def]
    assert inproc.lambda_recompute(sizes=(100,))
