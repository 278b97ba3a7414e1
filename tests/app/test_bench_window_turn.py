"""bench/window_turn.py reads h2load's per-request log as its docstring says: percentiles,
the requests slower than the threshold, and those of them that started in the last or the
first tenth of a second."""

from pathlib import Path

import pytest

from helpers import bench_module

pytestmark = pytest.mark.unit


def test_slow_requests_are_told_apart_by_where_in_their_second_they_started(
    tmp_path: Path,
) -> None:
    second = 1_796_614_432_000_000  # µs since the epoch, a whole second
    rows = [(second + 500_000 + i, 2_000) for i in range(95)]  # mid-second, 2 ms
    rows += [(second + 950_000, 21_000), (second + 1_050_000, 16_000)]  # at the turn
    rows += [(second + 99_999, 30_000), (second + 100_000, 15_500)]  # in, then just out
    rows += [(second + 899_999, 15_001), (second + 900_000, 15_000)]  # out; at, not slow
    log = tmp_path / "h2load.tsv"
    log.write_text("".join(f"{start}\t200\t{took}\n" for start, took in rows))
    with bench_module("window_turn") as window_turn:
        figures = window_turn.figures(log, 15.0)
    assert figures["requests"] == 101
    assert (figures["slow"], figures["slow_at_turn"]) == (5, 3)
    assert (figures["p50_ms"], figures["max_ms"]) == (2.0, 30.0)
    assert figures["p99_ms"] == 21.0  # the 100th of 101 in order
