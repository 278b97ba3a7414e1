"""Local leases (store/redis/lease.py): the KEYS/ARGV contract of lease.lua and
lease_return.lua, and exactness with two replicas (two RedisStores on one Redis) on an
injected clock: never more admitted than the limit, the limit reached exactly when both
keep asking, a closed replica's unused blocks given back."""

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from fairlimit.core.admission import Code
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan as make_plan
from fairlimit.limiter import Limiter
from fairlimit.store.redis import lease, script
from fairlimit.store.redis.store import RedisStore
from helpers import FakeClock, desc, load_text, req
from redis_servers import RedisProcess, StoreFactory, suite_url

CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 1000}
    fair_share: {active_clients: 4}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
"""
LIMIT = 100
_HEADER = re.compile(r"^-- (KEYS|ARGV) +(head|per counter): (.+)$")
_STRIDE = re.compile(r"^local COUNTER_ARGS = (\d+)$", re.M)


def _header(layout: script.Layout) -> dict[tuple[str, str], tuple[str, ...]]:
    found: dict[tuple[str, str], tuple[str, ...]] = {}
    for line in script.source(layout).splitlines():
        if not line.startswith("--"):
            break
        if m := _HEADER.match(line):
            found[m[1], m[2]] = tuple(m[3].split())
    return found


@pytest.mark.unit
class TestContract:
    @pytest.mark.parametrize("layout", [lease.LEASE, lease.RETURN], ids=lambda x: x.script)
    def test_each_script_opens_with_the_python_layout(self, layout: script.Layout) -> None:
        assert _header(layout) == {
            ("KEYS", "per counter"): ("counter",),
            ("ARGV", "head"): layout.head,
            ("ARGV", "per counter"): layout.counter,
        }

    @pytest.mark.parametrize("layout", [lease.LEASE, lease.RETURN], ids=lambda x: x.script)
    def test_each_script_walks_rows_by_the_python_stride(self, layout: script.Layout) -> None:
        (stride,) = _STRIDE.findall(script.source(layout))
        assert int(stride) == len(layout.counter)

    def test_lease_args_carry_the_named_fields(self, tmp_path: Path) -> None:
        plan = make_plan(req("edge", desc("client_id=a", hits=3)),
                         Matcher(load_text(tmp_path, CONFIG).config))  # fmt: skip
        args: list[Any] = lease.Leases("r1").args(plan, "12.5", 0.0)
        head = dict(zip(lease.LEASE.head, args, strict=False))
        assert head == {"now": "12.5", "replica": "r1"}
        assert args[len(lease.LEASE.head)] == 1
        row = dict(zip(lease.LEASE.counter, args[len(lease.LEASE.head) + 1 :], strict=True))
        assert row == {"limit": LIMIT, "window": 60, "hits": 3, "want": lease.MIN_WANT}

    def test_only_plain_unshadowed_counters_are_eligible(self, tmp_path: Path) -> None:
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        assert lease.eligible(make_plan(req("edge", desc("client_id=a")), matcher))
        capped = make_plan(req("edge", desc("route=public", "client_id=a")), matcher)
        assert not lease.eligible(capped)


@pytest.fixture
def lease_store_factory(redis_server: RedisProcess) -> StoreFactory:
    """RedisStores on the standalone server, flushed once: replicas share what they write."""
    from fairlimit.store.redis import open_redis

    with redis_server.client() as client:
        client.flushall()

    async def make(**options: object) -> object:
        return open_redis(suite_url(redis_server.url, **options))

    return make


async def _replicas(tmp_path: Path, factory: StoreFactory) -> tuple[list[Limiter], FakeClock]:
    """Two limiters, each with its own RedisStore (leases on) on one flushed Redis."""
    clock = FakeClock(1_700_000_000.0)
    loaded = load_text(tmp_path, CONFIG)
    stores = [await factory(leases="on"), await factory(leases="on")]
    return [Limiter(loaded, s, clock) for s in stores], clock  # type: ignore[arg-type]


async def _ask(limiter: Limiter, client: str) -> bool:
    decision = await limiter.should_rate_limit(req("edge", desc(f"client_id={client}")))
    return decision.code is Code.OK


@pytest.mark.behaviour
class TestTwoReplicas:
    async def test_both_asking_reach_the_limit_exactly_with_few_calls(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        replicas, clock = await _replicas(tmp_path, lease_store_factory)
        try:
            admitted = [0, 0]
            for i in range(3 * LIMIT):
                admitted[i % 2] += await _ask(replicas[i % 2], "alice")
            assert sum(admitted) == LIMIT
            assert min(admitted) > 0
            calls = sum(_store(r).round_trips for r in replicas)
            assert calls < 3 * LIMIT  # blocks answered the rest here
            clock.advance(60)  # the next window: old blocks unusable, counter fresh
            assert await _ask(replicas[0], "alice")
        finally:
            for r in replicas:
                await r.store.close()

    async def test_concurrent_requests_take_one_block_at_a_time(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """Bursts of 25 concurrent requests on each replica: blocks are taken by one call
        at a time per counter, so neither replica reserves the limit away from the other;
        the limit is still reached exactly."""
        replicas, _ = await _replicas(tmp_path, lease_store_factory)
        try:
            admitted = [0, 0]
            for burst in range(12):
                side = burst % 2
                answers = await asyncio.gather(
                    *(_ask(replicas[side], "dave") for _ in range(25))
                )
                admitted[side] += sum(answers)
            assert sum(admitted) == LIMIT
            assert min(admitted) > 0
        finally:
            for r in replicas:
                await r.store.close()

    async def test_a_lost_replica_never_lets_the_other_over(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """Replica 0 takes blocks and dies (its blocks lost, nothing given back): replica 1
        admits only what is left; the lost blocks are under-admission, never over."""
        replicas, _ = await _replicas(tmp_path, lease_store_factory)
        try:
            first = [await _ask(replicas[0], "bob") for _ in range(10)]
            lost = sum(b.room for b in _leases(replicas[0]).blocks.values())
            _leases(replicas[0]).blocks.clear()  # the crash: what it held is gone
            rest = [await _ask(replicas[1], "bob") for _ in range(2 * LIMIT)]
            assert all(first) and lost > 0
            assert sum(first) + sum(rest) == LIMIT - lost
        finally:
            for r in replicas:
                await r.store.close()

    async def test_closing_gives_unused_blocks_back(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        replicas, _ = await _replicas(tmp_path, lease_store_factory)
        try:
            first = [await _ask(replicas[0], "carol") for _ in range(10)]
            assert _leases(replicas[0]).blocks  # it holds a block now
            await replicas[0].store.close()
            rest = [await _ask(replicas[1], "carol") for _ in range(2 * LIMIT)]
            assert sum(first) + sum(rest) == LIMIT
        finally:
            await replicas[1].store.close()


def _store(limiter: Limiter) -> RedisStore:
    assert isinstance(limiter.store, RedisStore)
    return limiter.store


def _leases(limiter: Limiter) -> lease.Leases:
    found = _store(limiter)._leases
    assert found is not None
    return found
