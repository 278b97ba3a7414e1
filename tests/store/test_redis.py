"""Redis-only behaviour: what the shared suite cannot see because memory has no such thing.

Each class says why it is Redis-only. The admission and fairness rules themselves are pinned
by the behaviour suite (test_admission.py, test_fair_share_invariants.py) on every backend.
"""

import asyncio
import dataclasses
import gc
import hashlib
import math
import os
import random
import re
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.core import lease
from fairlimit.core.admission import Code
from fairlimit.core.fairshare import CapReport
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import Descriptor
from fairlimit.core.sharing import STALE
from fairlimit.errors import StoreUnavailable, UnsupportedBackend
from fairlimit.limiter import BREAK_SECONDS, Limiter
from fairlimit.store import open_store
from fairlimit.store.memory import MemoryStore
from fairlimit.store.redis import RedisStore, parse_url, script
from fairlimit.store.redis.packing import PackedSentinelConnection, PackedSSLConnection
from helpers import FakeClock, desc, load_text, req
from redis_servers import (
    SUITE_TIMEOUT,
    RedisClusterProcesses,
    RedisProcess,
    RedisSentinel,
    free_port,
)
from servers import ServerProcess

pytestmark = pytest.mark.behaviour

T0 = 1_700_000_000.0
# Far above any real answer, far below LONG_TIMEOUT: bounds a wait without timing it.
OUTLAST = 10.0
EPS = 1e-6  # Redis TIME's resolution
LONG_TIMEOUT = 60.0


async def _until(condition: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Yield to the loop until ``condition`` holds (background work done); fail after OUTLAST."""
    async with asyncio.timeout(OUTLAST):
        while True:
            met = condition()
            if met if isinstance(met, bool) else await met:
                return
            await asyncio.sleep(0.01)


CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 20, name: public-cap}
    fair_share:
      active_clients: 4
      weights: {heavy: 3}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: route
    value: admin
    rate_limit: {unit: minute, requests_per_unit: 30}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 20}
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: user
    rate_limit: {unit: day, requests_per_unit: 3}
  - key: bypass
    rate_limit: {unit: second, requests_per_unit: 100, replaces: [{name: public-cap}]}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 20}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
"""

Factory = Callable[..., Awaitable[Any]]


@pytest.fixture
def matcher(tmp_path: Path) -> Matcher:
    return Matcher(load_text(tmp_path, CONFIG).config)


def plan_of(matcher: Matcher, *descriptors: Descriptor) -> Plan:
    return make_plan(req("edge", *descriptors), matcher)


def client_plan(matcher: Matcher, client: str, route: str = "public") -> Plan:
    return plan_of(matcher, desc(f"route={route}", f"client_id={client}"))


def evalsha_calls(server: RedisProcess) -> int:
    """EVALSHA calls that ran a script: a NOSCRIPT answer (the first call on a server that
    has not seen the script yet, then EVAL) is a failed call, not a round trip of ours."""
    with server.client() as client:
        stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))


def _approx_report(report: CapReport) -> tuple[object, ...]:
    """A CapReport's values, floats rounded: Redis keeps λ and the figures as decimal text."""

    def rounded(value: object) -> object:
        return round(value, 9) if isinstance(value, float) else value

    figures = report.figures
    fields = () if figures is None else tuple(map(rounded, dataclasses.astuple(figures)))
    return (report.cap, rounded(report.level), report.declared_clients, figures is None, fields)


class TestParityWithMemory:
    """Redis-only: the Lua script is the second copy of the admission rule; here it is
    pinned to the reference (store/memory.py) outcome by outcome, on a random trace."""

    @pytest.mark.parametrize("gap", [STALE - 1, STALE, STALE + 1])
    async def test_a_row_back_after_a_long_silence_is_the_memory_stores(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher,
        gap: int,
    ) -> None:  # fmt: skip
        """A client silent for STALE periods, one fewer or one more: its row's history and
        mass (core/sharing._history: decayed up to STALE, gone past it) are memory's."""
        from fairlimit.core.sharing import ROW_FIELDS, Row
        from fairlimit.store.redis import script
        from fairlimit.store.redis.keys import slot_groups

        _FIELDS = ROW_FIELDS.values()

        store, memory = await redis_store_factory(), MemoryStore()
        plan = client_plan(matcher, "a")
        try:
            for t in (T0, T0 + 0.5, T0 + gap, T0 + gap + 1, T0 + gap + 2):
                await store.admit(plan, t)
                await memory.admit(plan, t)
        finally:
            await store.close()
        (g,) = slot_groups(plan, "fairlimit:", False)
        with redis_server.client() as client:  # the client's row: its own hash
            got = script.row_of(client.hmget(f"{g.cap_keys[0]['rows']}:a", list(_FIELDS)))
        assert got is not None
        want: Row = memory.fair.table[plan.shares[0].cap].rows["a"]
        assert (got.history, got.mass) == pytest.approx((want.history, want.mass))

    async def test_a_window_partly_seen_before_predicts_as_on_memory(
        self, redis_store_factory: Factory, matcher: Matcher
    ) -> None:
        """At the per-minute admin cap (30, clients 20), a asks 26 times through the first
        20 s of a minute and b 10 times; in the next minute their predictions (the part of
        the last minute still inside the sliding one, core/sharing.predicted) give the
        bounds memory gives."""
        store, memory = await redis_store_factory(local_cache=0), MemoryStore()
        start = (T0 // 60 + 1) * 60
        trace = [(start + 0.8 * i, "a") for i in range(26)]
        trace += [(start + 10 + i, "b") for i in range(10)]
        trace.sort()
        trace += [(start + 60 + t, c) for t in (1, 2, 3, 5, 9, 14) for c in "ab"]
        try:
            for t, client in trace:
                plan = client_plan(matcher, client, "admin")
                got, want = await store.admit(plan, t), await memory.admit(plan, t)
                assert (got.admitted, got.counts, got.shared) == (
                    want.admitted, want.counts, want.shared), (t - start, client)  # fmt: skip
                assert got.bounds == pytest.approx(want.bounds), (t - start, client)
        finally:
            await store.close()

    async def test_a_division_another_replica_is_computing_keeps_the_one_in_force(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """A cap's division is due, but another replica holds its lock (computing it): the
        request is decided by the division in force, not handed back, not failed."""
        from fairlimit.core.sharing import FORCES, SPLIT
        from fairlimit.store.redis.keys import slot_groups

        store = await redis_store_factory()
        plan = client_plan(matcher, "a")
        (g,) = slot_groups(plan, "fairlimit:", False)
        try:
            assert (await store.admit(plan, T0)).admitted
            later = T0 + 1.3  # a new period: the division is due
            with redis_server.client() as client:
                epoch = FORCES * math.floor(later * SPLIT / plan.shares[0].period)
                client.set(g.cap_keys[0]["lock"], str(epoch), px=60_000)
            trips = store.round_trips
            assert (await store.admit(plan, later)).admitted
            assert store.round_trips == trips + 1  # no hand-back
        finally:
            await store.close()

    @pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
    async def test_same_outcomes_as_the_memory_store(
        self, backend: str, matcher: Matcher, request: pytest.FixtureRequest
    ) -> None:
        """Every outcome (counts, claims, bounds) equals memory's, with the cache off."""
        factory = request.getfixturevalue(f"{backend.replace('-', '_')}_store_factory")
        store = await factory(local_cache=0)
        memory, rnd, now = MemoryStore(), random.Random(7), T0
        clients = ["a", "b", "heavy", "x{y}", "p/q=r", "}"]
        try:
            for _ in range(400):
                now += rnd.choice([0.0, 0.02, 0.1, 0.3])
                routes = rnd.choices(["public", "admin", "addr"], k=rnd.choice([1, 1, 2]))
                descriptors = [
                    desc(f"remote_address={rnd.choice(clients)}")
                    if r == "addr"
                    else desc(f"route={r}", f"client_id={rnd.choice(clients)}")
                    for r in routes
                ]
                plan = make_plan(req("edge", *descriptors, hits=rnd.choice([0, 1, 2])), matcher)
                got, want = await store.admit(plan, now), await memory.admit(plan, now)
                assert got.now == now  # the caller clock is the store clock here
                assert dataclasses.replace(got, now=None) == want
            want_caps = await memory.caps()

            async def registered() -> bool:  # the registry is written in the background
                return set(await store.caps()) == set(want_caps)

            await _until(registered, "every cap in the registry")
            got_caps = await store.caps()
            assert len(want_caps) >= 2
            for cap, want_report in want_caps.items():
                assert _approx_report(got_caps[cap]) == _approx_report(want_report), cap
        finally:
            await store.close()


def _day_of(server: RedisProcess) -> int:
    """The UTC day (the window of a unit: day limit) by Redis's clock, the machine's too."""
    with server.client() as client:
        seconds, _ = client.time()
    return int(seconds) // 86400


class TestOneClock:
    """Redis-only: replicas share counters only through Redis, whose TIME is their clock."""

    async def test_skewed_replicas_agree_on_the_window(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """Two stores whose callers disagree by a day still count one window together."""
        plan = plan_of(matcher, desc("user=u1"))
        for _ in range(2):  # a run across UTC midnight (Redis TIME's day) is run once more
            window = _day_of(redis_server)
            a = await redis_store_factory(clock="redis")
            b = await redis_store_factory(clock="redis")
            try:
                admitted = [
                    (await store.admit(plan, now)).admitted
                    for store, now in [(a, T0), (b, T0 + 86400.0)] * 4
                ]
            finally:
                await a.close()
                await b.close()
            if _day_of(redis_server) == window:
                break
        assert admitted == [True, True, True] + [False] * 5

    async def test_every_script_runs_by_redis_time(
        self, redis_store_factory: Factory, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """With clock=redis every script reads Redis TIME (clock.lua), whatever its caller
        passes: the admit script's clock, the expiry acquire.lua gives a slot (that clock plus
        max_duration) and the end of demand.lua's report (plus its TTL) each lie between two
        reads of TIME around the call (within a microsecond, for the float sums)."""
        store = await redis_store_factory(clock="redis")
        limiter = Limiter(load_text(tmp_path, TTL_CONFIG), store, FakeClock(T0 - 86400))
        with redis_server.client() as client:

            def now() -> float:
                seconds, micros = client.time()
                return seconds + micros / 1e6

            try:
                before = now()
                outcome = await store.admit(plan_of(limiter._active.matcher, desc("user=u")), T0)
                assert outcome.now is not None and before <= outcome.now <= now()
                before = now()
                assert await _take(limiter, "a", "r1")
                after = now()
                pools = list(client.scan_iter("fairlimit:*}s:*"))
                assert len(pools) == 2  # the cap's and the client's
                for key in pools:
                    assert before - EPS <= client.zscore(key, "r1") - 300 <= after + EPS, key
                before = now()
                await store.exchange_demand("me", "report", T0, 7.5)
                after = now()
                until, _, report = client.hget("fairlimit:rlqs-demand", "me").partition("|")
                assert report == "report" and before - EPS <= float(until) - 7.5 <= after + EPS
            finally:
                await store.close()


class TestDemandExchange:
    """Redis-only: the RLQS demand reports of the processes on one store (demand.lua)."""

    async def test_each_process_reads_the_others_live_reports(
        self, redis_store_factory: Factory, redis_server: RedisProcess
    ) -> None:
        """a reports at T (for 7.5 s), b at T + 1: b reads a's report, a reads b's, neither
        its own. At T + 7.5, a's report has ended: c reads only b's, and a's is gone from the
        hash; a report again is read again."""
        store = await redis_store_factory()
        try:
            assert await store.exchange_demand("a", "ra", T0, 7.5) == {}
            assert await store.exchange_demand("b", "rb", T0 + 1, 7.5) == {"a": "ra"}
            assert await store.exchange_demand("a", "ra2", T0 + 2, 5.5) == {"b": "rb"}
            assert await store.exchange_demand("c", "rc", T0 + 7.5, 7.5) == {"b": "rb"}
            with redis_server.client() as client:
                assert sorted(client.hkeys("fairlimit:rlqs-demand")) == ["b", "c"]
            assert await store.exchange_demand("a", "ra3", T0 + 8, 7.5) == {"b": "rb", "c": "rc"}
        finally:
            await store.close()


ONE_SCRIPT = """
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limits:
          - {unit: second, requests_per_unit: 1000}
          - {unit: minute, requests_per_unit: 10000, algorithm: sliding}
          - {unit: second, requests_per_unit: 100, algorithm: gcra, burst: 200}
"""


class TestScriptCache:
    """Redis-only: the script lives in Redis's script cache, which a failover or SCRIPT
    FLUSH empties."""

    async def test_script_flush_is_reloaded_transparently(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """After SCRIPT FLUSH the next admission reloads the script and counts on."""
        store = await redis_store_factory()
        plan = plan_of(matcher, desc("user=u1"))
        try:
            first = await store.admit(plan, T0)
            with redis_server.client() as client:
                client.script_flush()
            second = await store.admit(plan, T0)
        finally:
            await store.close()
        assert (first.admitted, second.admitted, second.counts) == (True, True, (1,))

    async def test_the_admit_parts_are_one_script_called_once_a_request(
        self, redis_store_factory: Factory, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """The admit script is kept as parts (lua/admit/) and registered joined: after SCRIPT
        FLUSH, a client with a fixed, a sliding and a GCRA limit under a cap asks six times
        at one instant (the first makes the cap's division: a hand-back, one call more);
        Redis then holds one script, whose SHA is that of script.source("admit"), and the
        five later requests, all admitted, ran it once each."""
        store = await redis_store_factory()
        plan = plan_of(Matcher(load_text(tmp_path, ONE_SCRIPT).config),
                       desc("tenant=t", "client_id=a"))  # fmt: skip
        joined = hashlib.sha1(script.source("admit").encode()).hexdigest()
        try:
            with redis_server.client() as client:
                client.script_flush()
            assert (await store.admit(plan, T0)).admitted
            before = evalsha_calls(redis_server)
            outcomes = [await store.admit(plan, T0) for _ in range(5)]
            calls = evalsha_calls(redis_server) - before
        finally:
            await store.close()
        assert all(o.admitted for o in outcomes) and calls == 5
        with redis_server.client() as client:
            assert client.info("memory")["number_of_cached_scripts"] == 1
            assert client.script_exists(joined) == [True]

    def test_a_script_error_is_located_in_the_part_that_raised_it(
        self, redis_server: RedisProcess
    ) -> None:
        """A Redis error names a line of the joined script (user_script:<n>): a counter count
        that is not a number stops the admit script in args.lua's loop over the counters,
        and script.locate names that file and line."""
        with redis_server.client() as client, pytest.raises(redis.ResponseError) as raised:
            client.eval(script.source("admit"), 0, "12.5", "0", "250", "", "0", "x")
        found = re.search(r"user_script:(\d+):", str(raised.value))
        assert found, str(raised.value)
        where, _, line = script.locate("admit", int(found[1])).rpartition(":")
        assert where == "admit/args.lua"
        text = (Path(script.__file__).parent / "lua" / where).read_text().split("\n")
        assert text[int(line) - 1].strip() == "for i = 1, tonumber(ARGV[a]) do"


class TestLocalCache:
    """Redis-only: the memory store answers every request locally anyway; with Redis a
    retry storm must not become a Redis storm."""

    async def test_retry_storm_costs_one_redis_call_per_window(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """Over its own limit, a client's retries reach Redis once, then stay local."""
        store = await redis_store_factory(clock="redis")
        plan = plan_of(matcher, desc("user=storm"))
        before = evalsha_calls(redis_server)
        try:
            outcomes = [await store.admit(plan, 0.0) for _ in range(1000)]
        finally:
            await store.close()
        assert sum(o.admitted for o in outcomes) == 3
        assert store.round_trips == 4  # three admitted, one rejection that teaches the cache
        assert evalsha_calls(redis_server) - before == 4

    async def test_over_its_fair_share_stays_local_until_the_next_period(
        self, redis_store_factory: Factory, matcher: Matcher
    ) -> None:
        """At a weighted-fair-queue cap a client held by its own limit, with room left beside
        it, reaches Redis once per window (a refusal by the fair share is never cached: its
        bound moves with each request at the cap)."""
        store = await redis_store_factory()
        heavy, light = client_plan(matcher, "heavy"), client_plan(matcher, "light")
        per_period: list[int] = []
        try:
            for period in range(3):
                now = T0 + period
                for _ in range(2):
                    await store.admit(light, now)
                trips = store.round_trips
                results = [(await store.admit(heavy, now)).admitted for _ in range(500)]
                per_period.append(store.round_trips - trips - sum(results))
        finally:
            await store.close()
        assert per_period == [1, 1, 1]


TTL_CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: minute, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: route
    value: pool
    concurrency: {max_in_flight: 2, max_duration: 300}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 2, max_duration: 300}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 3}
"""


METER_CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limits:
      - {unit: minute, requests_per_unit: 100, algorithm: sliding}
      - {duration: 10s, requests_per_unit: 5, algorithm: gcra, burst: 4}
"""


async def _take(limiter: Limiter, client: str, rid: str) -> bool:
    """One request in the concurrency pool (an acquire); True when admitted."""
    request = req("edge", desc("route=pool", f"client_id={client}", f"request_id={rid}"))
    return (await limiter.should_rate_limit(request)).code is Code.OK


class TestKeys:
    """Redis-only: memory has no keys; Redis keys must expire and share slots per cap."""

    async def test_every_key_has_a_ttl(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """Counters, caps, demand, level and registry keys all expire."""
        store = await redis_store_factory()
        try:
            for i in range(30):
                for client in ("a", "b", "heavy"):
                    await store.admit(client_plan(matcher, client), T0 + i * 0.2)
                    await store.admit(client_plan(matcher, client, "admin"), T0 + i * 0.2)
                await store.admit(plan_of(matcher, desc("user=u")), T0 + i * 0.2)
            with redis_server.client() as client:  # the registry is written in the background
                await _until(lambda: bool(client.exists("fairlimit:caps")), "the cap registry")
        finally:
            await store.close()
        with redis_server.client() as client:
            ttls = {key: client.pttl(key) for key in client.scan_iter("*")}
        assert len(ttls) > 10
        assert {k: t for k, t in ttls.items() if t <= 0} == {}

    @pytest.mark.parametrize("clock", ["caller", "redis"])
    async def test_each_key_lives_as_long_as_what_it_holds(
        self, redis_store_factory: Factory, redis_server: RedisProcess, tmp_path: Path,
        clock: str,
    ) -> None:  # fmt: skip
        """Each key's TTL, read right after it was written, against what it must outlive: a
        counter its window's end (a second of slack, a minute with the caller's clock, whose
        windows Redis cannot see), a cap's rows and division STALE periods or two windows, a
        concurrency pool's slots their max_duration (300 s) and a second, the refusals at a
        cap DEMAND_MS, the RLQS demand reports twice their TTL. A TTL in the wrong unit (ms
        for s) would lose slots still in flight a second after the last acquire: a 2-in-
        flight cap would admit a third request 1.3 s later."""
        from fairlimit.core import sharing
        from fairlimit.core.units import window_start
        from fairlimit.store.redis.keys import slot_groups

        loaded = load_text(tmp_path, TTL_CONFIG)
        store = await redis_store_factory(clock=clock)
        limiter = Limiter(loaded, store, FakeClock(T0 + 0.5))
        started = time.monotonic()
        expected: dict[str, int] = {}  # key -> PTTL in ms just after it was written
        slack = 60_000 if clock == "caller" else 1000
        try:
            for request in (desc("route=public", "client_id=a"), desc("user=u")):
                plan = plan_of(limiter._active.matcher, request)
                outcome = await store.admit(plan, T0 + 0.5)
                assert outcome.admitted and outcome.now is not None
                now = outcome.now  # the clock the script ran by: Redis TIME, or the caller's
                (g,) = slot_groups(plan, "fairlimit:", False)
                for name, c in zip(g.counter_keys, plan.counters, strict=True):
                    expected[name] = int((window_start(c.window, now) + c.window - now) * 1000)
                    expected[name] += slack
                for kinds, i in zip(g.cap_keys, g.cap_share, strict=True):
                    s = plan.shares[i]
                    keep = max(2 * s.window + 1, sharing.STALE * s.period) * 1000
                    expected[kinds["meta"]] = int(keep)
                    # a row and the seen index: a period and the slack more
                    row_keep = int(keep + s.period * 1000 + slack)
                    expected[f"{kinds['rows']}:{s.client}"] = expected[kinds["seen"]] = row_keep
            for rid in ("r1", "r2"):
                assert await _take(limiter, "a", rid)
            assert not await _take(limiter, "a", "r3")  # the pool's cap: 2 in flight
            await store.exchange_demand("me", "report", T0 + 0.5, 7.5)
            expected["fairlimit:rlqs-demand"] = 15_000
            with redis_server.client() as client:  # the registry is written in the background
                await _until(lambda: bool(client.exists("fairlimit:caps")), "the cap registry")
                expected["fairlimit:caps"] = 86_400_000
                ttls = {key: client.pttl(key) for key in client.scan_iter("*")}
            elapsed = int((time.monotonic() - started) * 1000) + 1
        finally:
            await store.close()
        pools = {k: t for k, t in ttls.items() if re.match(r"fairlimit:\{[^}]*\}[sohw]:", k)}
        assert {k[k.index("}") + 1] for k in pools} == set("sohw"), sorted(ttls)
        for key in pools:
            expected[key] = 1000 if key[key.index("}") + 1] == "w" else 301_000
        assert {k: t for k, t in ttls.items() if k in expected} == {
            k: pytest.approx(t - elapsed / 2, abs=elapsed / 2 + 2) for k, t in expected.items()
        }

    @pytest.mark.parametrize("clock", ["caller", "redis"])
    async def test_a_sliding_or_gcra_key_lives_until_it_counts_nothing(
        self, redis_store_factory: Factory, redis_server: RedisProcess, tmp_path: Path,
        clock: str,
    ) -> None:  # fmt: skip
        """A sliding window's key is kept until its newest sub-window has left the count
        ((part + 21) x window / 20), a GCRA bucket's until it is full again (its theoretical
        arrival time), each with the script's slack; nothing of either outlives that."""
        from fairlimit.core.units import SLIDING_PARTS

        loaded = load_text(tmp_path, METER_CONFIG)
        store = await redis_store_factory(clock=clock)
        slack = 60_000 if clock == "caller" else 1000
        try:
            request = plan_of(Matcher(loaded.config), desc("client_id=a", hits=3))
            # from before the script sets the TTLs to after they are read: the time between
            # the script and the read (the admit's reply too: 3.5 ms on a loaded machine)
            started = time.monotonic()
            outcome = await store.admit(request, T0 + 0.5)
            assert outcome.admitted and outcome.now is not None
            now = outcome.now
            with redis_server.client() as client:
                ttls = {key: client.pttl(key) for key in client.scan_iter("*")}
            elapsed = int((time.monotonic() - started) * 1000) + 1
        finally:
            await store.close()
        sliding, gcra = (next(k for k in ttls if tag in k) for tag in ("#60s", "#10g"))
        part = math.floor(now * SLIDING_PARTS / 60)
        kept = {  # seconds after now
            sliding: (part + SLIDING_PARTS + 1) * 60 / SLIDING_PARTS - now,
            gcra: 3 * 10 / 5,  # 3 hits of a 5-per-10-s bucket: 6 s until it is full
        }
        assert {k: ttls[k] for k in kept} == {
            k: pytest.approx(math.ceil(v * 1000 + slack) - elapsed / 2, abs=elapsed / 2 + 2)
            for k, v in kept.items()
        }

    async def test_slots_given_back_or_expired_leave_no_state(
        self, redis_store_factory: Factory, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """At a concurrency cap, a's slot released and b's expired (reclaimed by the next
        acquires), then those released: no pool key is left, not an owner, not a count of 0
        (a client at 0 would still look like a holder at the cap)."""
        clock = FakeClock(T0)
        store = await redis_store_factory()
        limiter = Limiter(load_text(tmp_path, TTL_CONFIG), store, clock)

        async def done(client: str, rid: str) -> None:
            request = req("edge", desc("route=pool", f"client_id={client}", f"request_done={rid}"))
            assert (await limiter.should_rate_limit(request)).code is Code.OK

        try:
            with redis_server.client() as client:
                held = "fairlimit:{edge/route=pool}h:edge/route=pool#inflight"
                assert await _take(limiter, "a", "r1") and await _take(limiter, "b", "r2")
                assert client.hgetall(held) == {
                    "n:a": "1", "l:a": "2.0", "w:a": "1.0", "n:b": "1", "l:b": "2.0", "w:b": "1.0"
                }  # fmt: skip
                await done("a", "r1")
                clock.advance(300)  # r2's max_duration
                assert await _take(limiter, "a", "r3")  # reclaims r2 at the cap
                assert client.hgetall(held) == {"n:a": "1", "l:a": "2.0", "w:a": "1.0"}
                assert await _take(limiter, "b", "r4")
                await done("a", "r3")
                await done("b", "r4")
                left = {k: client.type(k) for k in client.scan_iter("fairlimit:*}[sohw]:*")}
        finally:
            await store.close()
        assert left == {}

    async def test_a_cap_and_its_clients_share_one_slot(
        self, redis_cluster_store_factory: Factory, redis_cluster: RedisClusterProcesses,
        matcher: Matcher,
    ) -> None:  # fmt: skip
        """Every key of a cap instance carries its tag; braces in values cannot break it."""
        store = await redis_cluster_store_factory()
        clients = ["a", "x{y}", "}", "{", "p/q=r"]
        try:
            for client in clients:
                await store.admit(client_plan(matcher, client), T0)
        finally:
            await store.close()
        keys: list[str] = []
        for node in redis_cluster.nodes:
            with node.client() as client:
                keys += list(client.scan_iter("*"))
        with redis_cluster.nodes[0].client() as client:
            slots = {
                client.execute_command("CLUSTER", "KEYSLOT", k) for k in keys if "route=public" in k
            }
        assert len([k for k in keys if "client_id=" in k]) == len(clients)
        assert len(slots) == 1
        assert all(k.startswith("fairlimit:{edge/route=public}") for k in keys if "route=" in k)

    async def test_braces_and_percent_in_a_cap_value_are_percent_escaped_in_its_tag(
        self, redis_cluster_store_factory: Factory, redis_cluster: RedisClusterProcesses,
        matcher: Matcher,
    ) -> None:  # fmt: skip
        """A cap value's braces and % are percent-escaped (uppercase hex) in its tag: the tag
        Redis hashes is the whole cap path, distinct per value, one slot per cap instance."""
        # by hand from RFC 3986 percent-encoding of %, { and }; "a%7Bb%7D" must not meet "a{b}"
        escaped = {"a{b}": "a%7Bb%7D", "a%7Bb%7D": "a%257Bb%257D", "}{": "%7D%7B", "%": "%25"}
        store = await redis_cluster_store_factory()
        try:
            admitted = [
                (await store.admit(plan_of(matcher, desc(f"tenant={t}", "client_id=c")), T0))
                for t in escaped
            ]
        finally:
            await store.close()
        assert all(a.admitted for a in admitted)
        keys: list[str] = []
        for node in redis_cluster.nodes:
            with node.client() as client:
                keys += [k for k in client.scan_iter("*") if "tenant=" in k]
        tags: dict[str, set[str]] = {}
        slots: dict[str, set[int]] = {}
        with redis_cluster.nodes[0].client() as client:
            for key in keys:
                start = key.index("{") + 1  # Redis hashes from the first { to the next }
                tenant = re.search(r"\}[a-z]+:edge/tenant=(.*?)[/#]", key)
                assert tenant is not None, key
                tags.setdefault(tenant[1], set()).add(key[start : key.index("}", start)])
                slots.setdefault(tenant[1], set()).add(
                    client.execute_command("CLUSTER", "KEYSLOT", key)
                )
        assert tags == {t: {f"edge/tenant={e}"} for t, e in escaped.items()}
        assert all(len(found) == 1 for found in slots.values())

    async def test_on_one_redis_a_client_is_counted_under_one_key_whatever_replaces(
        self, redis_store_factory: Factory, matcher: Matcher
    ) -> None:
        """On one Redis a key is tagged by its own path: a request whose replaces drops the
        client's cap counts the client in the counter the capped requests use."""
        store = await redis_store_factory()
        uncapped = plan_of(matcher, desc("route=public", "client_id=a"), desc("bypass=x"))
        try:
            without_cap = [(await store.admit(uncapped, T0)).admitted for _ in range(10)]
            capped = await store.admit(client_plan(matcher, "a"), T0)
        finally:
            await store.close()
        assert all(without_cap)
        assert not capped.admitted  # the client's 10 per second are spent


class TestSlotGroups:
    """Redis-only: only a Redis Cluster splits one request across slots, so only there must
    a rejected request undo what one slot group reserved."""

    async def test_a_refusal_across_slots_keeps_the_recorded_charges(
        self, redis_cluster_store_factory: Factory, redis_cluster: RedisClusterProcesses,
        tmp_path: Path,
    ) -> None:  # fmt: skip
        """A request over two slots, refused by one: the other slot's undo takes back what
        it charged but its charge_when_over_limit levels, whose charge stays recorded in
        full at the counters and at the client's row at the cap."""
        from fairlimit.core.sharing import ROW_FIELDS
        from fairlimit.store.redis.keys import slot_groups
        from token_configs import TOKENS

        matcher = Matcher(load_text(tmp_path, TOKENS).config)
        store = await redis_cluster_store_factory(local_cache=0)
        both = make_plan(req("llm", desc("provider=openai", "tenant=t", hits=30),
                             desc("plain=x", hits=50)), matcher)  # fmt: skip
        try:
            plain = make_plan(req("llm", desc("plain=x", hits=80)), matcher)
            assert (await store.admit(plain, T0)).admitted
            assert not (await store.admit(both, T0)).admitted
        finally:
            await store.close()
        (capped,) = [g for g in slot_groups(both, "fairlimit:", True) if g.caps]
        found: dict[str, str] = {}
        rows = capped.cap_keys[0]["rows"]
        for node in redis_cluster.nodes:
            with node.client() as client:
                for key in client.scan_iter("*"):  # this node's keys only
                    if key in capped.counter_keys:
                        found[key] = client.hget(key, "n")
                    elif key == f"{rows}:t":  # the client's row, in the cap's slot
                        found["row"] = client.hget(key, ROW_FIELDS["admitted"])
        assert found == {**dict.fromkeys(capped.counter_keys, "30"), "row": "30"}

    async def test_a_rejected_request_across_slots_consumes_nothing(
        self, redis_cluster_store_factory: Factory, matcher: Matcher
    ) -> None:
        """The public group reserves, the admin group rejects: the reservation is released."""
        store = await redis_cluster_store_factory()
        public = desc("route=public", "client_id=c")
        both = plan_of(matcher, public, desc("route=admin", "client_id=c"))
        try:
            for _ in range(20):  # the admin client reaches its (paced) cold-start share
                if not (await store.admit(client_plan(matcher, "c", "admin"), T0)).admitted:
                    break
            trips = store.round_trips
            rejected = await store.admit(both, T0)
            calls = store.round_trips - trips
            after = await store.admit(plan_of(matcher, public), T0)
        finally:
            await store.close()
        assert not rejected.admitted
        assert calls == 3  # two slot groups in parallel, then one release
        assert after.admitted and after.counts == (0, 0) and after.shared == (0,)


class TestFaults:
    """Redis-only: memory cannot become unreachable.

    Each fault is met on both paths a request takes: the exact one (``leases=off``), and
    with a lease block taken before the fault (leases are on by default, issue 41), which
    answers the hits it holds with no Redis call; the request after them meets the fault.
    Without the block taken first, a lease would not show: a plan's first request takes
    none, and its second asks Redis for one."""

    @pytest.mark.parametrize("leases", ["off", "on"])
    async def test_down_then_back_heals_without_a_new_store(
        self, redis_process: RedisProcess, matcher: Matcher, leases: str
    ) -> None:
        """Killed: StoreUnavailable at once (after the hits a block holds, admitted without
        Redis); restarted on the same port: counting goes on."""
        # A refused connection must not wait for the (long) timeout: the calls below finish
        # well inside OUTLAST, which a wait of TIMEOUT each could not.
        url = redis_process.url + f"?clock=caller&timeout={LONG_TIMEOUT}&leases={leases}"
        store = open_store(url)
        plan = plan_of(matcher, desc(ROOMY))
        try:
            held = await _held_after_warming(store, plan, leases)
            redis_process.stop()
            for _ in range(held):  # answered from the block: Redis is not asked
                assert (await asyncio.wait_for(store.admit(plan, T0), OUTLAST)).admitted
            for _ in range(3):
                with pytest.raises(StoreUnavailable):
                    await asyncio.wait_for(store.admit(plan, T0), OUTLAST)
            redis_process.start()
            assert (await store.admit(plan, T0)).counts == (0,)  # nothing persisted: empty
            await store.ping()
        finally:
            await store.close()

    @pytest.mark.parametrize("leases", ["off", "on"])
    async def test_a_hung_server_costs_at_most_the_timeout(
        self, redis_process: RedisProcess, matcher: Matcher, leases: str
    ) -> None:
        """A stopped (not dead) server: each call gives up (at the configured timeout);
        with a lease block, the hits it holds are admitted without Redis, and the request
        after them gives up."""
        store = open_store(redis_process.url + f"?clock=caller&timeout=0.1&leases={leases}")
        plan = plan_of(matcher, desc(ROOMY))
        try:
            held = await _held_after_warming(store, plan, leases)
            assert redis_process.proc is not None
            os.kill(redis_process.proc.pid, signal.SIGSTOP)
            try:
                for _ in range(held):  # answered from the block: a Redis call would wait
                    assert (await asyncio.wait_for(store.admit(plan, T0), OUTLAST)).admitted
                # Without the timeout the call would hang as long as the server is stopped;
                # StoreUnavailable (not wait_for's TimeoutError) says the store gave up itself.
                with pytest.raises(StoreUnavailable):
                    await asyncio.wait_for(store.admit(plan, T0), OUTLAST)
            finally:
                os.kill(redis_process.proc.pid, signal.SIGCONT)
            # The timed-out script was already sent: Redis may run it once it resumes, so
            # the hit may have been counted (and, with leases, the block it asked for
            # reserved, held by nobody until the window ends). Either way the store answers
            # again at once.
            again = await store.admit(plan, T0)
            assert again.admitted and again.counts[0] >= 2 + held, again.counts
            if leases == "off":
                assert again.counts[0] in (2, 3)
        finally:
            await store.close()


ROOMY = "bypass=x"  # 100 a second: room for a lease block (the user's 3 a day holds none)


async def _held_after_warming(store: Any, plan: Plan, leases: str) -> int:
    """Two requests of ``plan`` admitted at T0; the hits of the lease block the second one
    took (a plan's first request takes none), none with leases off."""
    for _ in range(2):
        assert (await store.admit(plan, T0)).admitted
    leasing = store._leasing
    if leases == "off":
        assert leasing is None
        return 0
    held = sum(block.room for block in leasing.leases.blocks.values())
    assert held == lease.MIN_WANT  # a plan's first block
    return held


class TestConnections:
    """Redis-only: TLS and Sentinel are ways of reaching Redis."""

    async def test_sentinel_leads_to_the_master(
        self, redis_sentinel: RedisSentinel, matcher: Matcher
    ) -> None:
        """redis+sentinel://HOST:PORT/SERVICE admits through the master Sentinel names; the
        closed store leaves no connection behind, the Sentinel's own included (collected
        here, an unclosed one fails the test: its ResourceWarning is an error)."""
        url = f"redis+sentinel://127.0.0.1:{redis_sentinel.port}/mymaster?timeout=0.5"
        store = open_store(url)
        plan = plan_of(matcher, desc("user=u1"))
        try:
            admitted = [(await store.admit(plan, 0.0)).admitted for _ in range(4)]
            pool = store._client.connection_pool  # type: ignore[attr-defined]
            assert pool.connection_class is PackedSentinelConnection  # store/redis/packing.py
        finally:
            await store.close()
            del store
            gc.collect()
        assert admitted == [True, True, True, False]

    async def test_tls_with_a_client_certificate(
        self, tls_files: dict[str, Path], tmp_path: Path, matcher: Matcher
    ) -> None:
        """rediss:// verifies the server by ssl_ca_certs and presents ssl_certfile/keyfile."""
        port = free_port()
        server = RedisProcess(
            tmp_path, None, "--tls-port", str(port),
            "--tls-cert-file", str(tls_files["server.crt"]),
            "--tls-key-file", str(tls_files["server.key"]),
            "--tls-ca-cert-file", str(tls_files["ca.crt"]),
        ).start()  # fmt: skip
        # the suite's generous timeout: a TLS handshake on a loaded machine took over 0.5 s
        base = f"rediss://127.0.0.1:{port}/?timeout={SUITE_TIMEOUT}"
        base += f"&ssl_ca_certs={tls_files['ca.crt']}"
        mutual = f"{base}&ssl_certfile={tls_files['client.crt']}"
        mutual += f"&ssl_keyfile={tls_files['client.key']}"
        plan = plan_of(matcher, desc("user=u1"))
        stores = [open_store(mutual), open_store(base)]
        try:
            assert (await stores[0].admit(plan, 0.0)).admitted
            pool = stores[0]._client.connection_pool  # type: ignore[attr-defined]
            assert pool.connection_class is PackedSSLConnection  # store/redis/packing.py
            with pytest.raises(StoreUnavailable) as refused:  # no client certificate
                await stores[1].admit(plan, 0.0)
            # refused by the server, not timed out: TLS 1.3's certificate_required alert, or
            # the connection reset when the server drops it before the client reads the alert
            # (seen once: "Connection reset by peer")
            said = str(refused.value).lower()
            assert "certificate" in said or "reset by peer" in said, refused.value
        finally:
            for store in stores:
                await store.close()
            server.stop()


    async def test_a_script_answered_late_is_not_sent_again(
        self, redis_server: RedisProcess
    ) -> None:
        """Redis busy for 0.35 s (another client's script) answers a script call after the
        client's socket timeout (0.25 s): the call fails or gets its one answer, and the
        script runs once. The client retried on that timeout, sending the script again on a
        new connection, so Redis ran it twice: under load, Envoy Gateway's tests saw a
        request charged twice (a response's cost of 10 counted as 20, the next check
        refused)."""
        busy = (
            "local s = redis.call('TIME') repeat local n = redis.call('TIME') until"
            " (n[1] - s[1]) * 1000000 + (n[2] - s[2]) > tonumber(ARGV[1]) return 1"
        )
        with redis_server.client() as client:
            client.flushall()
        store = open_store(f"{redis_server.url}/?timeout=0.05")
        assert isinstance(store, RedisStore)
        late = store._client  # the client store calls go through, as open_store makes it
        await late.ping()  # connected: the script call is the one thing on its way

        def hold() -> None:
            with redis_server.client() as client:
                client.eval(busy, 0, 350_000)

        holder = asyncio.get_running_loop().run_in_executor(None, hold)
        await asyncio.sleep(0.05)  # the busy script is running
        try:
            await late.eval("return redis.call('INCR', KEYS[1])", 1, "charged")
        except redis.exceptions.TimeoutError:
            pass  # given up: the caller's answer is the failure mode's, the script ran once
        finally:
            await holder
            await store.close()
        with redis_server.client() as client:
            assert client.get("charged") == "1"


class TestPublishedFigures:
    """Redis-only: with one process there is nobody else to publish λ for."""

    async def test_a_replica_reads_the_level_another_computed(
        self, redis_store_factory: Factory, matcher: Matcher
    ) -> None:
        """caps() of an idle replica reports the cap, its λ and figures."""
        busy = await redis_store_factory()
        idle = await redis_store_factory()
        try:
            for second in range(3):
                for _ in range(15):
                    for client in ("a", "b", "heavy"):
                        await busy.admit(client_plan(matcher, client), T0 + second)

            async def published() -> bool:
                return "edge/route=public#1" in await idle.caps()

            await _until(published, "the busy replica's cap in the registry")
            reports = await idle.caps()
        finally:
            await busy.close()
            await idle.close()
        report = reports["edge/route=public#1"]
        assert report.level is not None and report.figures is not None
        assert report.declared_clients == 4 and report.figures.active_clients == 3


class TestUrls:
    """Redis-only: the URL schemes and options of the Redis backends."""

    def test_hosts_credentials_and_options(self) -> None:
        """Several seed nodes, user and password (escaped), timeouts and TLS files."""
        url = parse_url(
            "redis+cluster://me:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002/"
            "?timeout=0.01&max_connections=8&ssl_ca_certs=/ca.pem"
        )
        assert url.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
        assert (url.username, url.password) == ("me", "p@ss")
        assert (url.options.timeout, url.options.max_connections) == (0.01, 8)
        assert url.query["ssl_ca_certs"] == "/ca.pem"

    def test_leases_are_on_unless_switched_off(self) -> None:
        """Leases by default (issue 41); ``?leases=off`` is the exact path."""
        assert parse_url("redis://h").options.leases == "on"
        assert parse_url("redis://h/?leases=off").options.leases == "off"
        assert open_store("redis://h")._leasing is not None  # type: ignore[attr-defined]
        assert open_store("redis://h/?leases=off")._leasing is None  # type: ignore[attr-defined]

    def test_sentinel_names_its_service(self) -> None:
        url = parse_url("redis+sentinel://:secret@s1,s2:26380/mymaster?db=2")
        assert url.hosts == (("s1", 26379), ("s2", 26380))
        assert (url.path, url.password, url.query["db"]) == ("mymaster", "secret", "2")

    @pytest.mark.parametrize(
        ("url", "message"),
        [
            ("redis://h/?tiemout=1", "unknown Redis URL option(s): tiemout"),
            ("redis://h/?timeout=soon", "timeout='soon' is not a float"),
            ("redis://h/?clock=wall", "clock must be redis or caller"),
            ("redis://h:port", "bad Redis host 'h:port'"),
        ],
    )
    def test_bad_urls_say_what_is_wrong(self, url: str, message: str) -> None:
        with pytest.raises(
            UnsupportedBackend, match=message.replace("(", r"\(").replace(")", r"\)")
        ):
            open_store(url)

    async def test_every_scheme_opens_a_redis_store(self) -> None:
        for url in ("redis://h", "rediss://h?ssl_cert_reqs=none", "redis+cluster://h1,h2",
                    "redis+sentinel://s1/mymaster"):  # fmt: skip
            store = open_store(url)
            assert isinstance(store, RedisStore)
            await store.close()


# --- whole servers -------------------------------------------------------------------------

# One active client declared: the cap is sized for it (15 >= 1 x 10), so it is not paced
# over the day and the first client alone gets its whole limit (the cold start divides by
# max(clients seen, active_clients)).
SERVER_CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: day, requests_per_unit: 15}
    fair_share: {active_clients: 1}
    descriptors:
      - key: client_id
        rate_limit: {unit: day, requests_per_unit: 10}
"""
D = ratelimit_pb2.RateLimitDescriptor


def _ask(stub: rls_pb2_grpc.RateLimitServiceStub, client: str) -> int:
    entries = [D.Entry(key="route", value="public"), D.Entry(key="client_id", value=client)]
    message = rls_pb2.RateLimitRequest(domain="edge", descriptors=[D(entries=entries)])
    return int(stub.ShouldRateLimit(message, timeout=5).overall_code)


def _serve(tmp_path: Path, url: str, *args: str) -> ServerProcess:
    config = tmp_path / "edge.yaml"
    config.write_text(SERVER_CONFIG)
    return ServerProcess(["--config", str(config), "--backend", url, *args])


OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT


@pytest.mark.process
class TestReplicas:
    """Redis-only: sharing limits between server processes is what Redis is for."""

    def test_two_servers_hold_one_limit_and_one_cap_together(
        self, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """Alternating between two replicas: client a gets its 10, b the cap's last 5."""
        url = redis_server.url + "?timeout=0.5"
        servers = [_serve(tmp_path, url), _serve(tmp_path, url)]
        try:
            channels = [grpc.insecure_channel(s.target) for s in servers]
            stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in channels]
            for _ in range(2):  # a run across UTC midnight (the day window) is run once more
                window = _day_of(redis_server)
                with redis_server.client() as client:
                    client.flushall()
                a = [_ask(stubs[i % 2], "a") for i in range(12)]
                b = [_ask(stubs[i % 2], "b") for i in range(8)]
                if _day_of(redis_server) == window:
                    break
            for channel in channels:
                channel.close()
        finally:
            codes = [s.stop() for s in servers]
        assert (a.count(OK), b.count(OK)) == (10, 5)
        assert a[-2:] == [OVER, OVER] and codes == [0, 0]

    def test_redis_restart_follows_the_failure_mode_and_heals(
        self, redis_process: RedisProcess, tmp_path: Path
    ) -> None:
        """Redis killed: open answers OK, closed answers UNAVAILABLE; back: both count again."""
        url = redis_process.url + "?timeout=0.25"
        opened = _serve(tmp_path, url, "--failure-mode", "open")
        closed = _serve(tmp_path, url, "--failure-mode", "closed")
        try:
            with (
                grpc.insecure_channel(opened.target) as ch1,
                grpc.insecure_channel(closed.target) as ch2,
            ):
                open_stub = rls_pb2_grpc.RateLimitServiceStub(ch1)
                closed_stub = rls_pb2_grpc.RateLimitServiceStub(ch2)
                assert [_ask(open_stub, "a"), _ask(closed_stub, "a")] == [OK, OK]
                redis_process.stop()
                assert [_ask(open_stub, "a") for _ in range(12)] == [OK] * 12
                with pytest.raises(grpc.RpcError) as failed:
                    _ask(closed_stub, "a")
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                redis_process.start()
                answers = [_ask(closed_stub, "b") for _ in range(11)]
                assert answers == [OK] * 10 + [OVER]
                # the open server's breaker (12 failures in a row) leaves the store alone for
                # BREAK_SECONDS after its last failure: it finds it again within that
                healed = []
                for _ in range(40):
                    healed.append(_ask(open_stub, "b"))
                    if healed[-1] == OVER:
                        break
                    time.sleep(BREAK_SECONDS / 4)
                assert healed[-1] == OVER, healed
            assert opened.process.poll() is None and closed.process.poll() is None
        finally:
            codes = [opened.stop(), closed.stop()]
        assert codes == [0, 0]

    def test_local_failure_mode_keeps_each_replica_to_its_part_and_heals(
        self, redis_process: RedisProcess, tmp_path: Path
    ) -> None:
        """--failure-mode local --replicas 2, Redis killed: each server admits 5 of a
        client's 10 a day, then OVER_LIMIT (not open's OK for all, nor closed's UNAVAILABLE);
        a client Redis had admitted 2 of gets 4 more here. Redis back (empty: no
        persistence): what was admitted alone is written back into it, and Redis decides
        again (a fresh client gets its 10 from one server, not 5). On the exact path
        (``leases=off``): with leases on by default (issue 41) the second "seen" takes a
        block of 4, and how many of them it uses before Redis dies depends on timing (a
        block lasts 0.25 s); what it still holds then counts as used in the local part
        (under-admission, never over), so the counts asserted here would vary."""
        config = tmp_path / "own.yaml"
        config.write_text(OWN_LIMIT_CONFIG)
        url = redis_process.url + "?timeout=0.25&leases=off"
        args = ["--config", str(config), "--backend", url, "--failure-mode", "local",
                "--replicas", "2"]  # fmt: skip
        servers = [ServerProcess(args), ServerProcess(args)]
        day = _day_of(redis_process)
        try:
            with (
                grpc.insecure_channel(servers[0].target) as ch1,
                grpc.insecure_channel(servers[1].target) as ch2,
            ):
                stubs = [rls_pb2_grpc.RateLimitServiceStub(ch1),
                         rls_pb2_grpc.RateLimitServiceStub(ch2)]  # fmt: skip
                assert [_ask_own(stubs[0], "seen") for _ in range(2)] == [OK, OK]
                redis_process.stop()
                alone = [[_ask_own(stub, "x") for _ in range(6)] for stub in stubs]
                assert alone == [[OK] * 5 + [OVER]] * 2
                assert [_ask_own(stubs[0], "seen") for _ in range(5)] == [OK] * 4 + [OVER]
                for server in servers:
                    server.wait_for("limiting locally until the backend is back")
                redis_process.start()
                for i, (server, stub) in enumerate(zip(servers, stubs, strict=True)):
                    for _ in range(40):  # the breaker asks Redis again within BREAK_SECONDS
                        _ask_own(stub, f"probe-{i}")
                        if any("limiting locally ended" in line for line in server.lines):
                            break
                        time.sleep(BREAK_SECONDS / 4)
                    server.wait_for("limiting locally ended")
                assert [_ask_own(stub, "x") for stub in stubs] == [OVER, OVER]
                fresh = [_ask_own(stubs[0], "fresh") for _ in range(11)]
                assert fresh == [OK] * 10 + [OVER]
        finally:
            codes = [s.stop() for s in servers]
        if _day_of(redis_process) != day:
            pytest.skip("the run crossed UTC midnight (the day window)")
        assert codes == [0, 0]


OWN_LIMIT_CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: day, requests_per_unit: 10}
"""


def _ask_own(stub: rls_pb2_grpc.RateLimitServiceStub, client: str) -> int:
    entries = [D.Entry(key="client_id", value=client)]
    message = rls_pb2.RateLimitRequest(domain="edge", descriptors=[D(entries=entries)])
    return int(stub.ShouldRateLimit(message, timeout=5).overall_code)
