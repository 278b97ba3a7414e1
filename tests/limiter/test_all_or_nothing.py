"""All or nothing, as a Hypothesis property on every backend: a rejected request moves no
counter, and the simple counters hold their limits exactly."""

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairlimit.config.loader import parse_domain
from fairlimit.core.admission import Code
from fairlimit.core.rules import Config, Loaded
from fairlimit.limiter import Limiter
from fairlimit.store.base import Store
from helpers import FakeClock, desc, req

pytestmark = pytest.mark.behaviour

CONFIG = """
domain: d
descriptors:
  - key: cap
    value: c
    rate_limit: {unit: second, requests_per_unit: 5}
    fair_share: {active_clients: 2}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 3}
  - key: flat
    rate_limit: {unit: second, requests_per_unit: 2}
"""
FLAT_LIMIT = 2
PROBES = (("cap=c",), ("flat=x",), ("flat=y",))

descriptor_choices = st.sampled_from(
    [("cap=c", "user=a"), ("cap=c", "user=b"), ("cap=c", "user=c"), ("flat=x",), ("flat=y",),
     ("cap=c",)]
)  # fmt: skip
Step = tuple[list[tuple[str, ...]], int, bool]
steps_lists = st.lists(
    st.tuples(
        st.lists(descriptor_choices, min_size=1, max_size=3), st.integers(0, 3), st.booleans()
    ),
    max_size=40,
)
# A Redis example costs round trips: fewer of them there, and no deadline on a busy machine.
# The profile's own budget caps them (the mutation profile's 25: it runs per mutant).
EXAMPLES = {
    backend: min(n, settings.default.max_examples)
    for backend, n in {"memory": 60, "redis": 15, "redis-cluster": 10}.items()
}


async def _check(store: Store, steps: list[Step]) -> None:
    clock = FakeClock(1_000_000.0)  # on a window boundary: every tick starts a new window
    limiter = Limiter(Loaded(Config.of([parse_domain(CONFIG, "p.yaml")]), (), ()), store, clock)
    probes = [req("d", desc(*p, hits=0)) for p in PROBES]
    used: Counter[str] = Counter()  # hits admitted on flat=x / flat=y in this window
    for descriptors, hits, tick in steps:
        if tick:
            clock.advance(1.0)
            used.clear()
        before = [(await limiter.should_rate_limit(p)).statuses[0].limit_remaining for p in probes]
        out = await limiter.should_rate_limit(req("d", *[desc(*d) for d in descriptors], hits=hits))
        after = [(await limiter.should_rate_limit(p)).statuses[0].limit_remaining for p in probes]
        if out.code is Code.OVER_LIMIT:
            assert after == before
        else:
            for d in descriptors:  # a repeated descriptor charges each time
                if d[0].startswith("flat="):
                    used[d[0]] += hits or 1
        assert all(used[f] <= FLAT_LIMIT for f in ("flat=x", "flat=y"))
        assert after[1:] == [FLAT_LIMIT - used["flat=x"], FLAT_LIMIT - used["flat=y"]]


class TestAllOrNothingProperty:
    # The backend fixture only names the store kind; each example opens its own store.
    def test_counters_move_only_for_admitted_requests(
        self, backend: str, open_store: Callable[[], Store]
    ) -> None:
        """Over any request sequence: a rejected request changes no remaining, and each flat
        counter has admitted exactly limit - remaining hits in its window, never more."""

        @settings(
            max_examples=EXAMPLES[backend],
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(steps_lists)
        def check(steps: list[Step]) -> None:
            async def run() -> None:
                store = open_store()
                try:
                    await _check(store, steps)
                finally:
                    await store.close()

            asyncio.run(run())

        check()
