"""Each limit holds in its own window and each cap in its own, over random files that
``fairlimit check`` accepts (issue 37): mixed windows from a second to a month, calendar
periods, odd intervals, sliding and gcra, several limits per rule, weights and nested caps.
Hypothesis properties on every backend, time from an injected clock."""

import asyncio
import tempfile
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fairlimit.config.loader import load
from fairlimit.core.admission import Code
from fairlimit.limiter import Limiter
from fairlimit.store.base import Store
from helpers import FakeClock, desc, req
from strategies import LimitSpec, TreeSpec, window_trees

pytestmark = pytest.mark.behaviour

# Where the clock starts: a plain Tuesday evening, an hour before a Berlin month starts, and
# a minute before Berlin's clocks go forward (a 23-hour civil day).
STARTS = [1_700_000_000, 1_706_741_998, 1_711_846_770]
# Gaps between requests in milliseconds: most short, some across a minute, an hour, a day,
# a week and a month, so that long windows roll over within an example.
GAPS_MS = [0, 0, 1, 1, 37, 50, 300, 300, 1000, 2500, 13_000, 61_000, 3_599_000, 86_400_000,
           7 * 86_400_000, 31 * 86_400_000]  # fmt: skip
Step = tuple[int, int, int]  # (gap index, client index, hits)
steps_lists = st.lists(
    st.tuples(st.integers(0, len(GAPS_MS) - 1), st.integers(0, 5), st.integers(1, 3)),
    min_size=8,
    max_size=60,
)
# A Redis example costs round trips: fewer of them there (the profile's own budget caps them).
EXAMPLES = {
    backend: min(n, settings.default.max_examples)
    for backend, n in {"memory": 80, "redis": 20, "redis-cluster": 12}.items()
}


def _limiter(tree: TreeSpec, store: Store, clock: FakeClock) -> Limiter:
    """The file loaded as ``fairlimit check`` loads it (which must accept it)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "p.yaml"
        path.write_text(tree.text)
        return Limiter(load([path]), store, clock)


def _run(open_store: Callable[[], Store], check: Callable[[Store], object]) -> None:
    async def run() -> None:
        store = open_store()
        try:
            await check(store)  # type: ignore[misc]
        finally:
            await store.close()

    asyncio.run(run())


def _civil(calendar: tuple[str, str], ms: int) -> object:
    """The civil period (day, week from Monday, month) in its zone that holds ``ms``."""
    unit, zone = calendar
    day = datetime.fromtimestamp(ms / 1000, ZoneInfo(zone)).date()
    if unit == "day":
        return day
    if unit == "week":
        return day - timedelta(days=day.weekday())
    return day.year, day.month


def _passed(limit: LimitSpec, cap: bool, events: list[tuple[int, int]]) -> str | None:
    """How ``events`` (ms, hits) admitted on one counter pass ``limit``, else None: per
    fixed window (epoch-aligned or civil), or in any span of one window (sliding: the
    count, gcra: the count and the burst)."""
    if limit.algorithm == "fixed":
        per: dict[object, int] = defaultdict(int)
        for ms, hits in events:
            window = _civil(limit.calendar, ms) if limit.calendar else ms // (limit.window * 1000)
            per[window] += hits
        worst = max(per.items(), key=lambda item: item[1])
        most = limit.count
    else:
        most = limit.count + (limit.burst if limit.algorithm == "gcra" else 0)
        span = limit.window * 1000
        worst = max(
            ((ms, sum(h for t, h in events if ms <= t < ms + span)) for ms, _ in events),
            key=lambda item: item[1],
        )
    if worst[1] <= most:
        return None
    return f"{'cap ' if cap else ''}{limit.yaml}: {worst[1]} > {most} in window {worst[0]}"


async def _drive(tree: TreeSpec, store: Store, start: int, steps: list[Step]) -> list[str]:
    """Send the steps (each client sends its path), then each way a limit was passed."""
    clock = FakeClock(float(start))
    limiter = _limiter(tree, store, clock)
    admitted: dict[tuple[tuple[str, ...], int], list[tuple[int, int]]] = defaultdict(list)
    limits: dict[tuple[tuple[str, ...], int], tuple[LimitSpec, bool]] = {}
    ms = start * 1000
    refused = 0
    for gap, client, hits in steps:
        ms += GAPS_MS[gap]
        clock.t = ms / 1000
        path = tree.paths[client % len(tree.paths)]
        out = await limiter.should_rate_limit(req("p", desc(*(f"{k}={v}" for k, v in path)),
                                                  hits=hits))  # fmt: skip
        if out.code is not Code.OK:
            refused += 1
            continue
        for identity, node in tree.levels(path):
            for index, limit in enumerate(node.limits):
                admitted[(identity, index)].append((ms, hits))
                limits[(identity, index)] = (limit, node.active is not None)
    event(f"refused: {'none' if not refused else 'some' if refused < len(steps) else 'all'}")
    return [
        f"{'/'.join(identity)}: {problem}"
        for (identity, index), events in admitted.items()
        if (problem := _passed(*limits[(identity, index)], events)) is not None
    ]


class TestEveryWindowHolds:
    # The backend fixture only names the store kind; each example opens its own store.
    def test_a_new_clients_first_request_is_admitted(
        self, backend: str, open_store: Callable[[], Store]
    ) -> None:
        """Nothing contended (a fresh store), at any moment of any window: a client's first
        request of one hit is admitted, whatever its limits' windows are beside the caps'
        (a 1000/hour client under a 100/s cap is not held to 0.278 a second)."""

        @settings(
            max_examples=EXAMPLES[backend],
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(window_trees(), st.sampled_from(STARTS), st.integers(0, 40 * 86_400_000),
               st.integers(0, 5))  # fmt: skip
        def check(tree: TreeSpec, start: int, offset_ms: int, client: int) -> None:
            async def first(store: Store) -> None:
                clock = FakeClock(start + offset_ms / 1000)
                path = tree.paths[client % len(tree.paths)]
                out = await _limiter(tree, store, clock).should_rate_limit(
                    req("p", desc(*(f"{k}={v}" for k, v in path)))
                )
                assert out.code is Code.OK, (tree.text, path, out.statuses)

            _run(open_store, first)

        check()

    def test_no_limit_and_no_cap_is_passed_in_any_window(
        self, backend: str, open_store: Callable[[], Store]
    ) -> None:
        """Clients sending 1 to 3 hits at gaps from a millisecond to a month: no fixed or
        calendar window of any limit or cap admits more than its count, no span of one
        window more than a sliding limit's count or a gcra limit's count and burst."""

        @settings(
            max_examples=EXAMPLES[backend],
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(window_trees(), st.sampled_from(STARTS), steps_lists)
        def check(tree: TreeSpec, start: int, steps: list[Step]) -> None:
            async def drive(store: Store) -> None:
                passed = await _drive(tree, store, start, steps)
                assert not passed, (tree.text, passed)

            _run(open_store, drive)

        check()
