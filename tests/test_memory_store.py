"""Memory-store specifics: bounded state. (Redis bounds its keys with TTLs, in test_redis.)"""

import gc
import math
from collections.abc import Callable, Iterator

import pytest

from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, desc, load_text, req

pytestmark = pytest.mark.behaviour

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100000}
    fair_share: {active_clients: 10000}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 10}
"""


class TestExpiry:
    async def test_idle_clients_expire(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """After 5k clients go idle past their windows, the store holds only what is live."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)  # type: ignore[arg-type]
        for i in range(5_000):
            await limiter.should_rate_limit(req("edge", desc("route=public", f"client_id=c{i}")))
        assert len(store) > 5_000
        clock.advance(200)
        await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=new")))
        assert len(store) <= 3  # the new client's counter, the cap counter, the cap state

    async def test_live_counters_survive_expiry_sweeps(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """A sweep never drops a counter whose window is still running."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 60 * 28_333_334  # the start of a minute
        for _ in range(10):
            await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        clock.advance(30)
        out = await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        assert out.statuses[0].limit_remaining == 0 and out.code.name == "OVER_LIMIT"


# A cap per window length, a plain per-client limit and a rule no request here comes near:
# its requests only move the store's clock (each request first sweeps what has expired).
EXPIRY_CONFIG = """
domain: edge
descriptors:
  - key: route
    value: second
    rate_limit: {unit: second, requests_per_unit: 1000}
    fair_share: {active_clients: 10}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: route
    value: minute
    rate_limit: {unit: minute, requests_per_unit: 1000}
    fair_share: {active_clients: 10}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: tick
    rate_limit: {unit: day, requests_per_unit: 1000000}
"""


class TestBoundaries:
    """Held state is dropped at the instant it ends, not one sweep later (injected clock)."""

    async def test_a_counter_is_dropped_the_instant_its_window_ends(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """At the end of a minute, exactly, the minute's counter of another client is gone."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, EXPIRY_CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 60.0 * 28_333_334  # the start of a minute
        await limiter.should_rate_limit(req("edge", desc("user=a")))
        clock.advance(59.5)
        await limiter.should_rate_limit(req("edge", desc("user=b")))
        assert len(store) == 2  # a's window still runs
        clock.advance(0.5)
        await limiter.should_rate_limit(req("edge", desc("user=b")))
        assert len(store) == 1  # b's counter of the new minute

    @pytest.mark.parametrize(
        ("route", "idle"),
        [("second", 64.0), ("minute", 121.0)],
        ids=["second cap: 64 periods of 1 s", "minute cap: two windows and a second"],
    )
    async def test_an_untouched_cap_is_dropped_when_its_idle_time_has_passed(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock, route: str, idle: float
    ) -> None:
        """A cap is kept for max(2 windows + 1 s, 64 periods) after its last request (as the
        Redis keys' TTL), counted from the last request, not the first."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, EXPIRY_CONFIG), store, clock)  # type: ignore[arg-type]
        cap = {"second": "edge/route=second#1", "minute": "edge/route=minute#60"}[route]
        await limiter.should_rate_limit(req("edge", desc(f"route={route}", "client_id=a")))
        clock.advance(50)
        await limiter.should_rate_limit(req("edge", desc(f"route={route}", "client_id=a")))
        last = clock.t
        clock.t = last + idle - 1  # past the idle time counted from the first request
        await limiter.should_rate_limit(req("edge", desc("tick=x")))
        assert set(await store.caps()) == {cap}
        clock.t = last + idle
        await limiter.should_rate_limit(req("edge", desc("tick=x")))
        assert set(await store.caps()) == set()


LEVEL_CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: minute, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 80}
"""


class TestCapReports:
    """caps() reports each held cap as its current period sees it."""

    async def test_the_level_of_the_current_period(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """No λ before any demand, none bounded while demand fits, and two like clients
        over a cap of 100 a minute each get λ = 50 (by symmetry)."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, LEVEL_CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 60.0 * 28_333_334  # the start of a minute
        cap = "edge/route=public#60"
        await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        assert (await store.caps())[cap].level is None  # the period rolled with no demand yet
        clock.advance(1)
        await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        assert (await store.caps())[cap].level == math.inf  # 1 hit a second fits 100 a minute
        for _ in range(30):
            for client in ("a", "b"):
                await limiter.should_rate_limit(
                    req("edge", desc("route=public", f"client_id={client}"))
                )
        clock.advance(1)
        await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        assert (await store.caps())[cap].level == pytest.approx(50.0)


@pytest.fixture
def full_collections() -> Iterator[Callable[[], int]]:
    """Full garbage collections run since the test began; automatic ones are off meanwhile,
    so every one counted was asked for."""
    enabled = gc.isenabled()
    gc.disable()
    start = gc.get_stats()[2]["collections"]
    yield lambda: gc.get_stats()[2]["collections"] - start
    if enabled:
        gc.enable()


class TestGivingMemoryBack:
    """A full collection costs time in proportion to every object the process holds: the
    store runs one when a spike of counters is over, never request after request."""

    async def test_one_collection_after_a_spike_none_in_steady_state(
        self,
        tmp_path: pytest.TempPathFactory,
        clock: FakeClock,
        full_collections: Callable[[], int],
    ) -> None:
        """Steady traffic (a counter expiring among four live ones) runs none; 20 counters
        expiring at once, leaving four, runs one."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, EXPIRY_CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 86_400.0 * 19_675  # the start of a day
        for user in "abcd":
            await limiter.should_rate_limit(req("edge", desc(f"tick={user}")))
        await limiter.should_rate_limit(req("edge", desc("user=a")))
        clock.advance(60)
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("tick=a")))
        assert (len(store), full_collections()) == (4, 0)
        for i in range(20):
            await limiter.should_rate_limit(req("edge", desc(f"user=u{i}")))
        clock.advance(60)
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("tick=a")))
        assert (len(store), full_collections()) == (4, 1)
