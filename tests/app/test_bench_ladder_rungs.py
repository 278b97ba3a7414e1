"""bench/ladder.py's rungs that patch fairlimit's own code still serve.

A change of what a rung replaces stopped ``bench/run.py`` at its ladder: the guards rung
answered a message where the servicer had come to expect the response's bytes and its
code's name, so every call of the rung failed with UNKNOWN. Each rung here starts as the
ladder starts it and answers its route's hot client once; no figure is judged.
"""

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from helpers import bench_module

pytestmark = pytest.mark.process

PATCHED = ("server", "guards", "server-stream", "handler", "cap-histogram", "cap-gc",
           "cap+uvloop", "cap-uvloop")  # fmt: skip


@pytest.fixture
def ladder() -> Iterator[ModuleType]:
    with bench_module("ladder") as module:
        yield module


def test_the_rungs_here_are_those_patched(ladder: ModuleType) -> None:
    """Every rung that patches fairlimit is started below."""
    patching = {rung for rung, patches in ladder.PATCHES.items() if patches}
    assert patching == set(PATCHED), patching


@pytest.mark.parametrize("rung", PATCHED)
def test_each_patched_rung_serves(ladder: ModuleType, rung: str, tmp_path: Path) -> None:
    route = {**ladder.RUNGS, **ladder.WHAT_IF}[rung][0]
    server, port = ladder._start(rung, tmp_path, None)
    try:
        assert ladder._ask(port, route, rung) == "OK"
    finally:
        server.stop()
