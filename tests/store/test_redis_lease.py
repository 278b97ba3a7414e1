"""Lease blocks (core/lease.py) on Redis (lua/admit/lease.lua sizes them, release.lua gives them
back): the rule's parts, the Lua sizing against core.lease.size, and two replicas (two
RedisStores on one Redis) on an injected clock: never more admitted than a limit or a cap,
the limit reached exactly when both keep asking, fair shares at a contended cap as without
leases, the reserved hits counted as demand and given back when unused."""

import asyncio
from pathlib import Path

import pytest

from fairlimit.config.loader import load
from fairlimit.core import lease
from fairlimit.core.admission import Code
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.sharing import ROW_FIELDS
from fairlimit.limiter import Limiter
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from fairlimit.store.redis.keys import slot_groups
from fairlimit.store.redis.leasing import Leasing
from fairlimit.store.redis.refills import Refill, Refills
from fairlimit.store.redis.store import RedisStore
from helpers import FakeClock, desc, load_text, req
from redis_servers import RedisProcess, StoreFactory, suite_url

CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: route
    value: roomy
    rate_limit: {unit: second, requests_per_unit: 100000}
    fair_share: {active_clients: 10}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10000}
  - key: route
    value: contended
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 4}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 100}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: route
    value: minutely
    rate_limit: {unit: minute, requests_per_unit: 6000000}
    fair_share: {active_clients: 10}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10000}
  - key: bulk
    rate_limit: {unit: second, requests_per_unit: 1000000}
  - key: hourly
    rate_limit: {unit: hour, requests_per_unit: 1000000}
  - key: route
    value: shadowed
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 4}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
"""
LIMIT = 100
T0 = 1_700_000_000.0


@pytest.mark.unit
class TestRule:
    def test_plans_under_caps_are_eligible_shadowed_or_uneven_ones_not(self, tmp_path: Path
                                                                       ) -> None:  # fmt: skip
        matcher = Matcher(load_text(tmp_path, CONFIG).config)

        def plan(*descriptors: object) -> object:
            return make_plan(req("edge", *descriptors), matcher)  # type: ignore[arg-type]

        assert lease.eligible(plan(desc("client_id=a")))  # type: ignore[arg-type]
        assert lease.eligible(plan(desc("route=contended", "client_id=a")))  # type: ignore[arg-type]
        assert not lease.eligible(plan(desc("route=shadowed", "client_id=a")))  # type: ignore[arg-type]
        uneven = plan(desc("client_id=a", hits=2), desc("route=roomy", "client_id=a", hits=3))
        assert not lease.eligible(uneven)  # type: ignore[arg-type]
        assert not lease.eligible(plan(desc("nothing=here")))  # type: ignore[arg-type]

    def test_a_shape_names_the_counters_and_the_client_at_each_cap(self, tmp_path: Path) -> None:
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        one = make_plan(req("edge", desc("route=contended", "client_id=a", hits=1)), matcher)
        three = make_plan(req("edge", desc("route=contended", "client_id=a", hits=3)), matcher)
        other = make_plan(req("edge", desc("route=contended", "client_id=b")), matcher)
        assert lease.shape(one) == lease.shape(three) != lease.shape(other)
        assert "a" in lease.shape(one) and one.shares[0].cap in lease.shape(one)

    @pytest.mark.parametrize(
        ("want", "counters", "shares", "block"),
        [
            (8, [49.5], [], 8),  # the consumer's want
            (80, [49.5], [], 49),  # half the counter's room, whole
            (80, [49.5], [6.9999999999], 7),  # the share's room, within EPSILON
            (80, [49.5, 3.0], [20.0], 3),  # the least level
            (80, [0.5], [20.0], 0),  # under one hit: no block
            (80, [49.5], [-1.0], 0),  # past the bound: none
        ],
    )
    def test_a_block_is_the_least_room_whole(
        self, want: int, counters: list[float], shares: list[float], block: int
    ) -> None:
        assert lease.size(want, counters, shares) == block

    def test_a_block_serves_requests_until_it_runs_out_or_expires(self, tmp_path: Path) -> None:
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("route=contended", "client_id=a")), matcher)
        leases = lease.Leases("c1", margin=0.0)
        key = lease.shape(plan)
        from fairlimit.core.admission import Outcome

        granted = Outcome(True, (5, 40), (5,), (30.0,), T0 + 0.1)
        assert leases.keep(plan, key, granted, 2, None, 0.1) is None
        first, second = leases.take(plan, key, 0.11), leases.take(plan, key, 0.12)
        assert first is not None and second is not None
        # each counter and the share as they stood before each request, its own hit counted,
        # admitted at the store's clock (the grant's, moved on by the consumer's)
        assert (first.counts, first.shared, first.bounds) == ((6, 41), (6,), (30.0,))
        assert first.admitted and first.now == pytest.approx(T0 + 0.11, abs=1e-6)
        assert (second.counts, second.shared) == ((7, 42), (7,))
        assert leases.take(plan, key, 0.13) is None  # used up
        leases.keep(plan, key, granted, 3, None, 0.2)
        assert leases.take(plan, key, 0.2 + lease.LEASE_TTL) is None  # expired
        (back,) = leases.expired(0.2 + lease.LEASE_TTL)
        assert back.room == 3 and not leases.blocks

    def test_blocks_with_room_are_handed_back_expired_or_not(self, tmp_path: Path) -> None:
        """What goes back: a replaced block with room, live or expired (once replaced no
        sweep finds it); at a sweep the expired blocks with room, even one hit, the used-up
        ones only forgotten; at shutdown every block with room."""
        from fairlimit.core.admission import Outcome

        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plans = [make_plan(req("edge", desc(f"client_id={c}")), matcher) for c in "abcd"]
        keys = [lease.shape(p) for p in plans]
        granted = Outcome(True, (0,), (), (), T0)
        leases = lease.Leases("c1", margin=0.0)
        leases.keep(plans[0], keys[0], granted, 3, "a1", T0)
        old = leases.keep(plans[0], keys[0], granted, 3, "a2", T0 + lease.LEASE_TTL + 0.01)
        assert old is not None and old.ref == "a1"  # expired, with room: back
        leases.keep(plans[1], keys[1], granted, 0, "b0", T0)
        assert leases.keep(plans[1], keys[1], granted, 2, "b1", T0) is None  # used up: none
        del leases.blocks[keys[1]]
        for plan, key, room in zip(plans[1:], keys[1:], (0, 1, 2), strict=True):
            leases.keep(plan, key, granted, room, key[0], T0 + 0.5)
        swept = leases.expired(T0 + 0.5 + lease.LEASE_TTL)
        assert sorted(b.room for b in swept) == [1, 2, 3]
        assert not leases.blocks
        for plan, key, room in zip(plans, keys, (0, 1, 2, 5), strict=True):
            leases.keep(plan, key, granted, room, key[0], T0 + 1)
        leases.keep(plans[3], keys[3], granted, 4, "d2", T0 + 1.1)  # d's 5 handed back here
        assert sorted(b.room for b in leases.unused()) == [1, 2, 4]
        assert not leases.blocks

    def test_a_block_stops_a_margin_before_its_window_ends(self, tmp_path: Path) -> None:
        """Granted 0.1 s before the window ends, with a margin of 0.01 s: usable for 0.09 s."""
        from fairlimit.core.admission import Outcome

        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("user=u")), matcher)  # 100 a second
        leases = lease.Leases("c1", margin=0.01)
        key = lease.shape(plan)
        leases.keep(plan, key, Outcome(True, (0,), (), (), T0 + 0.9), 5, None, 50.0)
        assert leases.take(plan, key, 50.089) is not None
        assert leases.take(plan, key, 50.09) is None

    @pytest.mark.parametrize(
        ("store_at", "used", "after", "want"),
        [
            (0.5, 10, 0.07, 29),  # 142.9/s over LEASE_SECONDS: 28.6
            (0.9, 10, 0.03, 24),  # 333.3/s until the window ends, 0.07 s: 23.3
            (0.99, 1, 0.005, 1),  # at least one hit
            (0.2, 0, 0.1, 1),  # nothing used: one
        ],
    )
    def test_the_next_want_is_the_rate_used_over_what_is_left(
        self, tmp_path: Path, store_at: float, used: int, after: float, want: int
    ) -> None:
        """The next block asks for the rate its last block was used at, times the least of
        LEASE_SECONDS and the time until the window ends by the store's clock (its grant
        was at ``store_at`` into a second, on a consumer clock 1000.25 s behind)."""
        from fairlimit.core.admission import Outcome

        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("user=u")), matcher)  # windows of a second
        leases = lease.Leases("c1", margin=0.0)
        key = lease.shape(plan)
        base = T0 - 1000.25 + store_at
        leases.keep(plan, key, Outcome(True, (0,), (), (), T0 + store_at), 50, None, base)
        for _ in range(used):
            assert leases.take(plan, key, base) is not None
        assert leases.want(plan, key, base + after) == want

    def test_a_plan_takes_blocks_from_its_second_request_on(self, tmp_path: Path) -> None:
        """No block at a plan's first request, nor after RECENT seconds of quiet (a client
        asking once would give its block back unused: a second store call); asked again
        within RECENT, or just after its block ended, a first block of MIN_WANT."""
        from fairlimit.core.admission import Outcome

        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("user=u")), matcher)
        leases = lease.Leases("c1", margin=0.0)
        key = lease.shape(plan)
        assert leases.want(plan, key, 10.0) == 0
        assert leases.want(plan, key, 10.0 + lease.RECENT) == lease.MIN_WANT
        assert leases.want(plan, key, 11.0 + 2 * lease.RECENT) == 0  # quiet for a while
        leases.keep(plan, key, Outcome(True, (0,), (), (), T0 + 0.1), 3, None, 20.0)
        leases.expired(20.0 + lease.LEASE_TTL)  # its block ended
        assert leases.want(plan, key, 20.01 + lease.LEASE_TTL) == lease.MIN_WANT
        leases.expired(30.0)  # a sweep forgets plans quiet for longer than RECENT
        assert not leases.seen

    def test_a_block_ends_with_the_first_window_it_spans(self, tmp_path: Path) -> None:
        """Granted 0.1 s before the second ends, a block is usable for 0.1 s, not its TTL."""
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("route=contended", "client_id=a")), matcher)
        leases = lease.Leases("c1", margin=0.0)
        key = lease.shape(plan)
        from fairlimit.core.admission import Outcome

        leases.keep(plan, key, Outcome(True, (0, 0), (0,), (9.0,), T0 + 0.9), 5, None, 50.0)
        assert leases.take(plan, key, 50.09) is not None
        assert leases.take(plan, key, 50.1) is None

    def test_the_next_block_keeps_the_rate_of_those_before(self, tmp_path: Path) -> None:
        """A block used at 1,000/s, then one granted 10 ms before its window ended that
        served nothing: 12 ms into the next window its shape still asks for about
        LEASE_SECONDS at 1,000/s (its own idle 12 ms and the rate before for the rest),
        not for one hit, and a block that ended (swept) is sized the same way."""
        from fairlimit.core.admission import Outcome

        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("bulk=b")), matcher)  # windows of a second
        leases = lease.Leases("c1", margin=0.0)
        key = lease.shape(plan)
        leases.keep(plan, key, Outcome(True, (0,), (), (), T0 + 0.79), 500, None, 0.0)
        for _ in range(200):
            assert leases.take(plan, key, 0.1) is not None
        leases.keep(plan, key, Outcome(True, (200,), (), (), T0 + 0.99), 3, None, 0.2)
        # (0 + 1000 x 0.188) / 0.2 hits a second, for 0.2 s (and float rounding, up)
        assert leases.want(plan, key, 0.212) in (188, 189)
        leases.expired(0.212)
        assert not leases.blocks
        assert leases.want(plan, key, 0.212) in (188, 189)

    @pytest.mark.parametrize(
        ("store_at", "want"),
        [
            (0.994, 0),  # 6 ms left, less than the margin's 10: none
            (1.005, 0),  # past the end by the offset, not by the offset less the call's 20 ms
            (1.03, 200),  # past it either way: the next window's LEASE_SECONDS at 1,000/s
        ],
    )
    def test_no_block_while_the_window_may_not_have_ended(
        self, tmp_path: Path, store_at: float, want: int
    ) -> None:
        """A block granted at 0.5 s into a second by a call that took 20 ms: the store's
        clock now is the grant's moved on by the consumer's, or up to 20 ms less. A block
        asked for while the window may still run at the store would be sized by that
        window and end before it is used."""
        from fairlimit.core.admission import Outcome

        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("bulk=b")), matcher)
        leases = lease.Leases("c1", margin=0.01)
        key = lease.shape(plan)
        leases.keep(plan, key, Outcome(True, (0,), (), (), T0 + 0.5), 1000, None, 0.0, 0.02)
        for _ in range(int((store_at - 0.5) * 1000)):  # 1,000/s since the grant
            assert leases.take(plan, key, 0.1) is not None
        assert leases.want(plan, key, store_at - 0.5) == want

    def test_a_request_that_waited_for_its_block_is_admitted_past_its_end(
        self, tmp_path: Path
    ) -> None:
        """A block granted in a window's last moments ends before it is kept; the requests
        that waited for its call since before it was sent are admitted from it (they came
        before its script ran), others are not, and the waiters do not count as its rate."""
        from fairlimit.core.admission import Outcome

        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        plan = make_plan(req("edge", desc("bulk=b")), matcher)
        leases = lease.Leases("c1", margin=0.005)
        key = lease.shape(plan)
        leases.keep(plan, key, Outcome(True, (0,), (), (), T0 + 0.998), 2, None, 50.0)
        block = leases.blocks[key]
        assert block.until < 50.0
        assert leases.take(plan, key, 50.001) is None
        other = lease.Block(None, 60.0, 5, [0], [], (), 50.0, 0.0)
        assert leases.take(plan, key, 50.001, other) is None
        outcome = leases.take(plan, key, 50.001, block)
        assert outcome is not None and outcome.admitted and outcome.counts == (1,)
        assert (block.room, block.used) == (1, 0)


async def _waiting(
    refills: Refills, plan: Plan, n: int
) -> tuple[Refill, list["asyncio.Task[object]"]]:
    """A block call of ``plan``'s shape taken on and sent by one task, and ``n`` requests
    of the shape waiting for it (each left at its wait)."""
    shape = lease.shape(plan)

    async def owner() -> Refill:
        refill, taking, _ = refills.asking(plan, shape, 50.0)
        assert taking and refill.sent
        return refill

    refill = await asyncio.get_running_loop().create_task(owner())
    waiters = [
        asyncio.get_running_loop().create_task(
            refills.wait(plan, shape, lambda: 50.0, lambda: True)
        )
        for _ in range(n)
    ]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    return refill, waiters


@pytest.mark.unit
class TestRefills:
    """store/redis/refills.py: who goes on after a block call of a shape."""

    @pytest.mark.parametrize("call", ["failed", "refused a block", "shared"])
    async def test_a_call_that_could_not_take_a_block_leads_nobody_on(
        self, tmp_path: Path, call: str
    ) -> None:
        """A block call Redis never answered (it failed, or timed out), one that asked for a
        block and was granted none (a contended cap), or one that asked for none because
        another shape charges its levels here: every request that waited for it goes to
        the exact path by itself, and none takes the next call on for the others, each of
        whom would then wait for one such call after another."""
        plan = make_plan(req("edge", desc("bulk=b")), Matcher(load_text(tmp_path, CONFIG).config))
        refills = Refills(lease.Leases("c1"), caller_clock=False)
        refill, waiters = await _waiting(refills, plan, 3)
        if call == "refused a block":  # as Leasing.leased notes it: asked 5 hits, got none
            refill.asked, refill.answered = 5, True
        elif call == "shared":
            refill.shared, refill.answered = True, True
        refills.settle(lease.shape(plan), refill)  # Leasing.leased's finally, raised or not
        assert await asyncio.wait_for(asyncio.gather(*waiters), 5.0) == [None] * 3
        assert not refills  # no call taken on: each makes its own

    async def test_an_answered_call_without_a_block_for_them_leads_one_on(
        self, tmp_path: Path
    ) -> None:
        """The same call answered, with no block (a shape's first request asks for none):
        one of its waiters takes the next call on, asking for all of them, and the others
        wait for that one."""
        plan = make_plan(req("edge", desc("bulk=b")), Matcher(load_text(tmp_path, CONFIG).config))
        refills = Refills(lease.Leases("c1"), caller_clock=False)
        shape = lease.shape(plan)
        refill, waiters = await _waiting(refills, plan, 3)
        assert refill.asked == 0
        refill.answered = True
        refills.settle(shape, refill)
        for _ in range(20):  # loop passes until the first goes (3 here), then a few more
            await asyncio.sleep(0)
            if any(w.done() for w in waiters):
                break
        for _ in range(5):
            await asyncio.sleep(0)
        gone = [w for w in waiters if w.done()]
        assert len(gone) == 1 and gone[0].result() is None  # it goes to make the call
        following = refills._out[shape]
        assert following is not refill and following.owner is gone[0]
        assert following.early == 2 * plan.counters[0].hits  # the two waiting for it
        refills.settle(shape, following)  # that call fails: they go on by themselves
        assert await asyncio.wait_for(asyncio.gather(*waiters), 5.0) == [None] * 3


@pytest.fixture
def lease_store_factory(redis_server: RedisProcess) -> StoreFactory:
    """RedisStores on the standalone server, flushed once: replicas share what they write."""
    from fairlimit.store.redis import open_redis

    with redis_server.client() as client:
        client.flushall()

    async def make(**options: object) -> object:
        return open_redis(suite_url(redis_server.url, **options))

    return make


async def _replicas(
    tmp_path: Path, factory: StoreFactory, n: int = 2, **options: object
) -> tuple[list[Limiter], FakeClock]:
    """``n`` limiters, each with its own RedisStore (leases on) on one flushed Redis."""
    clock = FakeClock(T0)
    loaded = load_text(tmp_path, CONFIG)
    stores = [await factory(leases="on", **options) for _ in range(n)]
    return [Limiter(loaded, s, clock) for s in stores], clock  # type: ignore[arg-type]


async def _ask(limiter: Limiter, client: str, route: str = "") -> bool:
    entries = (f"route={route}", f"client_id={client}") if route else (f"client_id={client}",)
    decision = await limiter.should_rate_limit(req("edge", desc(*entries)))
    return decision.code is Code.OK


def _store(limiter: Limiter) -> RedisStore:
    assert isinstance(limiter.store, RedisStore)
    return limiter.store


def _leasing(limiter: Limiter) -> Leasing:
    found = _store(limiter)._leasing
    assert found is not None
    return found


def _leases(limiter: Limiter) -> lease.Leases:
    return _leasing(limiter).leases


async def _burst(limiter: Limiter, redis_server: RedisProcess, entry: str, n: int) -> int:
    """The script calls ``n`` concurrent requests of the descriptor ``entry`` (key=value)
    make, all admitted, after a first one (no block at a first request)."""
    key, value = entry.split("=")
    assert await _ask_key(limiter, key, value)
    with redis_server.client() as admin:
        admin.config_resetstat()
    answers = await asyncio.gather(*(_ask_key(limiter, key, value) for _ in range(n)))
    assert all(answers)
    return _evalsha_calls(redis_server)


def _evalsha_calls(redis_server: RedisProcess) -> int:
    """EVALSHA calls made since the stats were reset (one failing NOSCRIPT, before the
    script is loaded, is not a call made)."""
    with redis_server.client() as client:
        evalsha = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(evalsha.get("calls", 0)) - int(evalsha.get("failed_calls", 0))


async def _close(limiters: list[Limiter]) -> None:
    for limiter in limiters:
        await limiter.store.close()


@pytest.mark.behaviour
class TestPlainCounters:
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
            await _close(replicas)

    async def test_clients_asking_once_make_one_script_call_each(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """40 clients asking once each, then closing: one EVALSHA per request and nothing
        to give back (a first block each, unused, was a release call more per client)."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        with redis_server.client() as client:
            client.config_resetstat()
        try:
            for i in range(40):
                assert await _ask(replica, f"once-{i}")
                clock.advance(0.01)
            assert not _leases(replica).blocks
        finally:
            await _close([replica])
        with redis_server.client() as client:
            evalsha = client.info("commandstats").get("cmdstat_evalsha", {})
        # a first EVALSHA may fail with NOSCRIPT before the script is loaded: not a call made
        assert int(evalsha["calls"]) - int(evalsha.get("failed_calls", 0)) == 40, evalsha

    async def test_concurrent_requests_take_one_block_at_a_time(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """Bursts of 25 concurrent requests on each replica: blocks are taken by one call
        at a time per plan, so neither replica reserves the limit away from the other; the
        limit is still reached exactly."""
        replicas, clock = await _replicas(tmp_path, lease_store_factory)
        try:
            admitted = [0, 0]
            for burst in range(12):
                side = burst % 2
                answers = await asyncio.gather(*(_ask(replicas[side], "dave") for _ in range(25)))
                admitted[side] += sum(answers)
                clock.advance(lease.LEASE_TTL)  # blocks expire and go back between bursts
            assert sum(admitted) == LIMIT
            assert min(admitted) > 0
        finally:
            await _close(replicas)

    async def test_a_burst_waits_for_one_block_call_asking_for_all_of_it(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """40 concurrent requests of a client whose first block (MIN_WANT hits) is being
        taken: two script calls for them (the call that takes the first block; one more
        for the requests the block left, asking for their hits), not one each."""
        (replica,), _ = await _replicas(tmp_path, lease_store_factory, 1)
        try:
            assert await _burst(replica, redis_server, "bulk=burst", 40) == 2
        finally:
            await _close([replica])

    async def test_a_burst_at_a_windows_end_makes_two_admission_calls(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """On Redis's clock, with a margin longer than the window (every block ends before
        it is granted, as in a window's last moments): 30 concurrent requests make two
        admission calls, the first request's (taking a first block, of MIN_WANT hits,
        which ends before it is granted) and one for the 28 that waited for it: they are
        admitted from its block, granted after they came; and one call gives the first
        block back. Redis counts each admitted hit (an hour's window: a second's counter
        read after the run may have expired, its hits with it)."""
        (replica,), _ = await _replicas(tmp_path, lease_store_factory, 1, clock="redis")
        _leases(replica).margin = 7200.0
        try:
            assert await _burst(replica, redis_server, "hourly=late", 30) == 3
            assert not _leases(replica).blocks or all(
                b.room == 0 for b in _leases(replica).blocks.values()
            )
        finally:
            await _close([replica])
        with redis_server.client() as client:  # the counter of each window the run saw
            counted = [int(client.hget(k, "n") or 0) for k in client.keys("*hourly=late*")]
        assert sum(counted) == 31

    async def test_requests_waiting_on_a_call_never_made_go_on(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """A client over its limit (100 a minute), known over here: a burst of 20 is
        refused by the over-limit cache, the request that would have taken its block call
        on included; none waits for that call (each would hang until its deadline)."""
        (replica,), _ = await _replicas(tmp_path, lease_store_factory, 1)

        async def run() -> None:
            admitted = [await _ask(replica, "over") for _ in range(LIMIT + 5)]
            assert sum(admitted) == LIMIT
            assert not any(await asyncio.gather(*(_ask(replica, "over") for _ in range(20))))

        try:
            await asyncio.wait_for(run(), 10.0)
            assert not _leasing(replica)._refills
        finally:
            await _close([replica])

    async def test_requests_cancelled_anywhere_leave_no_call_to_wait_for(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """Bursts of 30 concurrent requests of one client, all cancelled (their caller's
        deadline) after 0 to 59 loop passes, then after 0.1 to 6 ms: at any point of
        their way, waiting for a block call, taking one on, making it. After each burst
        no block call is left out for the next requests to wait for, and the next request
        is answered (a call left out would hold every later request of the client until
        its deadline)."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        leasing = _leasing(replica)

        async def burst(passes: int, seconds: float) -> None:
            asks = [asyncio.create_task(_ask_key(replica, "bulk", "cut")) for _ in range(30)]
            for _ in range(passes):
                await asyncio.sleep(0)
            await asyncio.sleep(seconds)
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
            assert not leasing._refills, (passes, seconds)
            assert await asyncio.wait_for(_ask_key(replica, "bulk", "cut"), 5.0)
            clock.advance(0.3 if passes % 3 == 0 else 0.01)  # blocks end now and then

        try:
            for passes in range(60):
                await burst(passes, 0.0)
            for tenths in range(1, 61):
                await burst(0, tenths / 10_000)
        finally:
            await _close([replica])

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
            await _close(replicas)

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


@pytest.mark.behaviour
class TestWindows:
    @pytest.mark.parametrize(("key", "window"), [("user", 1), ("client_id", 60)])
    async def test_a_block_taken_late_in_a_window_serves_nothing_in_the_next(
        self, tmp_path: Path, lease_store_factory: StoreFactory, key: str, window: int
    ) -> None:
        """Two replicas, a plain limit of 100 a second (or a minute): 80 requests spread
        over a window's last second (blocks are taken until its end), then 400 in the next
        window's first second, and so on: every window admits its 80, then exactly its 100.
        A block used past the end of the window that charged it (kept LEASE_TTL, or a whole
        window, from when it was taken) would admit the next window's 100 on top."""
        replicas, clock = await _replicas(tmp_path, lease_store_factory)
        clock.t = (T0 // 60 + 1) * 60 - 1.0  # a second before a minute ends
        admitted: dict[int, int] = {}
        turn = 0
        try:
            for n in (80, 400, 80, 400, 400):
                for _ in range(n):
                    ok = await _ask_key(replicas[turn % 2], key, "w")
                    turn += 1
                    at = int(clock.t // window)
                    admitted[at] = admitted.get(at, 0) + ok
                    clock.advance(1 / n)
        finally:
            await _close(replicas)
        if window == 1:
            assert list(admitted.values()) == [80, 100, 80, 100, 100]
        else:  # the last second of a minute, then the next minute's first four seconds
            assert list(admitted.values()) == [80, 100]

    async def test_a_block_given_back_after_its_window_leaves_the_next_alone(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """Replica 0 takes a block at the roomy cap late in a second; in the next second
        replica 1 admits the client, then replica 0's sweep gives its expired block back:
        the unused hits went with the window they were charged in, so the client's row for
        the new second still counts every hit admitted or held in it."""
        replicas, clock = await _replicas(tmp_path, lease_store_factory)
        clock.t = T0 + 0.7
        try:
            for _ in range(30):
                assert await _ask(replicas[0], "x", "roomy")
                clock.advance(0.002)
            assert sum(b.room for b in _leases(replicas[0]).blocks.values()) > 0
            clock.t = T0 + 1.05
            for _ in range(5):
                assert await _ask(replicas[1], "x", "roomy")
            clock.t = T0 + 1.25  # past replica 0's next sweep
            assert await _ask(replicas[0], "x", "roomy")
            held = sum(b.room for r in replicas for b in _leases(r).blocks.values()
                       if b.until > clock.t)  # fmt: skip
            row = _row(redis_server, replicas[0], "roomy", "x")
        finally:
            await _close(replicas)
        assert row["admitted"] == row["period_admitted"] == 5 + 1 + held  # a period: 1 s


async def _ask_key(limiter: Limiter, key: str, value: str) -> bool:
    decision = await limiter.should_rate_limit(req("edge", desc(f"{key}={value}")))
    return decision.code is Code.OK


@pytest.mark.behaviour
class TestRequestHits:
    async def test_a_block_leaves_room_for_the_request_that_takes_it(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """90 of the 100 a minute are used (through a replica without leases); a leasing
        replica's request of 10 hits, asking a first block, is admitted with none: the 10
        left are its own. Sized as if they were still free, its block would hold 4 hits
        past the limit, and its next 1-hit requests would take them: 104 admitted."""
        plain = Limiter(load_text(tmp_path, CONFIG), await lease_store_factory(), FakeClock(T0))
        (leasing,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        clock.t = T0
        try:
            for _ in range(9):
                decision = await plain.should_rate_limit(req("edge", desc("client_id=h", hits=10)))
                assert decision.code is Code.OK
            decision = await leasing.should_rate_limit(req("edge", desc("client_id=h", hits=10)))
            assert decision.code is Code.OK
            more = [await _ask(leasing, "h") for _ in range(5)]
            assert sum(more) == 0, f"{90 + 10 + sum(more)} admitted for a limit of {LIMIT}"
            assert not [b for b in _leases(leasing).blocks.values() if b.room]
        finally:
            await _close([plain, leasing])

    @pytest.mark.parametrize("hits", [3, 7, 10])
    async def test_replicas_never_reserve_past_a_limit(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess,
        hits: int,
    ) -> None:  # fmt: skip
        """Two replicas alternate requests of ``hits`` hits at a plain 100 a minute: after
        every call the counter in Redis (what was admitted and what blocks hold) is within
        the limit, and what both admitted is within it too."""
        replicas, _ = await _replicas(tmp_path, lease_store_factory)
        plan = make_plan(req("edge", desc("client_id=k")), replicas[0]._active.matcher)
        (g,) = slot_groups(plan, "fairlimit:", False)
        admitted, counted = 0, []
        try:
            with redis_server.client() as client:
                for i in range(40):
                    request = req("edge", desc("client_id=k", hits=hits))
                    ok = (await replicas[i % 2].should_rate_limit(request)).code is Code.OK
                    admitted += hits * ok
                    counted.append(int(client.hget(g.counter_keys[0], "n") or 0))
        finally:
            await _close(replicas)
        assert max(counted) <= LIMIT and admitted <= LIMIT
        assert admitted > LIMIT - 2 * hits  # what blocks strand is under two requests' hits


_COUNTS = ("admitted", "asked", "period_admitted", "period_asked")


@pytest.mark.behaviour
class TestGivingBack:
    async def test_an_expired_block_replaced_before_the_sweep_goes_back(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """Plan b's block expires between two sweeps, and b's next request takes a new
        block before the next sweep: the expired block's unused hits still go back (they
        were left charged until the window ended), so the counter holds what was admitted
        and what the live block holds, nothing more."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        plan = make_plan(req("edge", desc("client_id=b")), replica._active.matcher)
        (g,) = slot_groups(plan, "fairlimit:", False)
        try:
            assert await _ask(replica, "a")  # the sweep runs now, next at +LEASE_TTL
            clock.advance(0.1)
            assert await _ask(replica, "b")  # b's block: until +0.35
            clock.advance(0.16)
            assert await _ask(replica, "a")  # the sweep runs (nothing expired), next at +0.51
            clock.advance(0.1)  # b's block expired, the sweep not due
            assert await _ask(replica, "b")
            live = sum(b.room for b in _leases(replica).blocks.values()
                       if b.until > clock.t and "edge/client_id=b#60" in b.ref.plan.counters[0].key)  # type: ignore[attr-defined]  # fmt: skip
            with redis_server.client() as client:
                count = int(client.hget(g.counter_keys[0], "n"))
        finally:
            await _close([replica])
        assert count == 2 + live

    async def test_a_sweep_gives_back_many_blocks_in_one_script_call(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """20 clients each hold a block with room when they expire: the sweep gives them
        all back in one release.lua call (issue 41: one call per block doubled the script
        calls of many warm clients), and each counter holds only what was admitted."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        clients = [f"warm-{i}" for i in range(20)]
        try:
            for client in clients:
                for _ in range(3):  # the second takes a block, the third uses one of it
                    assert await _ask(replica, client)
            held = [b.room for b in _leases(replica).blocks.values()]
            assert len(held) == 20 and min(held) > 0
            clock.advance(lease.LEASE_TTL + 0.01)
            calls = _store(replica).round_trips
            assert await _ask(replica, "late")  # the sweep runs, then its own call
            assert _store(replica).round_trips - calls == 2
            counts = []
            with redis_server.client() as client_:
                for client in clients:
                    plan = make_plan(req("edge", desc(f"client_id={client}")),
                                     replica._active.matcher)  # fmt: skip
                    (g,) = slot_groups(plan, "fairlimit:", False)
                    counts.append(int(client_.hget(g.counter_keys[0], "n")))
        finally:
            await _close([replica])
        assert counts == [3] * 20


def _row(redis_server: RedisProcess, limiter: Limiter, route: str, client: str) -> dict[str, float]:
    """The client's row at the route's cap, as Redis holds it: admitted and asked in the
    window and in the period."""
    request = req("edge", desc(f"route={route}", f"client_id={client}"))
    plan = make_plan(request, limiter._active.matcher)
    (g,) = slot_groups(plan, "fairlimit:", False)
    rows = g.cap_keys[0]["rows"]
    with redis_server.client() as client_:
        raw = client_.hmget(f"{rows}:{client}", [ROW_FIELDS[f] for f in _COUNTS])
    return {f: float(v or 0) for f, v in zip(_COUNTS, raw, strict=True)}


@pytest.mark.behaviour
class TestUnderACap:
    async def test_a_hot_client_under_a_roomy_cap_is_answered_from_blocks(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """1000 requests in a second through one replica: all admitted, from few calls."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        try:
            answers = []
            for _ in range(1000):
                answers.append(await _ask(replica, "hot", "roomy"))
                clock.advance(0.0009)
            assert all(answers)
            assert _store(replica).round_trips <= 100, _store(replica).round_trips
        finally:
            await _close([replica])

    async def test_hot_clients_in_turns_under_one_cap_are_answered_from_blocks(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """Two hot clients in turns under the roomy cap: both charge the cap's total, which
        does not make each other's blocks stale (a block at a cap is bounded by the
        client's share): 1000 requests, all admitted, from few calls."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        try:
            answers = []
            for i in range(1000):
                answers.append(await _ask(replica, f"hot-{i % 2}", "roomy"))
                clock.advance(0.0009)
            assert all(answers)
            assert _store(replica).round_trips <= 150, _store(replica).round_trips
        finally:
            await _close([replica])

    @pytest.mark.parametrize(("route", "also"), [("roomy", ""), ("minutely", ""),
                                                 ("minutely", "user")])  # fmt: skip
    async def test_reserved_hits_are_demand_and_unused_ones_go_back(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess,
        route: str, also: str,
    ) -> None:  # fmt: skip
        """While a block is out, the cap counts it as the client's demand and admissions,
        in the window and in the period; once it expires, the next sweep gives back its
        unused hits: all four come to what the client really asked and was admitted (a cap
        of a second; one of a minute over a client level of a second; and that with a
        plain per-second limit in the same request, its counter after the cap's)."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        descriptors = [desc(f"route={route}", "client_id=x")]
        descriptors += [desc(f"{also}=x")] if also else []
        try:
            for _ in range(30):
                decision = await replica.should_rate_limit(req("edge", *descriptors))
                assert decision.code is Code.OK
                clock.advance(0.002)
            out = sum(b.room for b in _leases(replica).blocks.values())
            assert out > 0
            row = _row(redis_server, replica, route, "x")
            assert row == dict.fromkeys(_COUNTS, 30 + out)
            clock.advance(lease.LEASE_TTL)
            assert await _ask(replica, "y", route)  # another plan: the sweep runs
            assert _row(redis_server, replica, route, "x") == dict.fromkeys(_COUNTS, 30)
        finally:
            await _close([replica])

    async def test_a_block_over_two_caps_goes_back_to_both(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """A request under two caps at once (the roomy and the minutely route): its block is
        reserved at both, and its unused hits go back to both client rows."""
        (replica,), clock = await _replicas(tmp_path, lease_store_factory, 1)
        both = req(
            "edge", desc("route=roomy", "client_id=x"), desc("route=minutely", "client_id=x")
        )
        try:
            for _ in range(30):
                assert (await replica.should_rate_limit(both)).code is Code.OK
                clock.advance(0.002)
            out = sum(b.room for b in _leases(replica).blocks.values())
            assert out > 0
            for route in ("roomy", "minutely"):
                assert _row(redis_server, replica, route, "x") == dict.fromkeys(_COUNTS, 30 + out)
            clock.advance(lease.LEASE_TTL)
            assert await _ask(replica, "y", "roomy")  # another plan: the sweep runs
            for route in ("roomy", "minutely"):
                assert _row(redis_server, replica, route, "x") == dict.fromkeys(_COUNTS, 30)
        finally:
            await _close([replica])

    async def test_the_script_sizes_each_block_as_the_rule_says(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """The admit script's block for each of 60 calls (two consumers, wants from 1 to 60,
        requests of 1 to 13 hits, a roomy cap and a plain counter of 100 a minute filling
        up) equals core.lease.size of the call's own reply: the counters as they stood, the
        holders, the client's admitted count and bound, each less the request's hits."""
        replicas, clock = await _replicas(tmp_path, lease_store_factory)
        try:
            sizes = []
            for i in range(60):
                replica = replicas[i % 2]
                store = _store(replica)
                route = "roomy" if i % 3 == 0 else ""
                entries = (f"route={route}", "client_id=z") if route else ("client_id=z",)
                hits = (1, 4, 9, 2, 13)[i % 5]  # a block leaves room for the request's own
                plan = make_plan(req("edge", desc(*entries, hits=hits)), replica._active.matcher)
                (g,) = slot_groups(plan, "fairlimit:", False)
                consumer = _leases(replica).consumer
                holders = []
                with redis_server.client() as client:
                    for name, c in zip(g.counter_keys, plan.counters, strict=True):
                        held = client.hgetall(name)
                        ws = f"{(clock.t // c.window) * c.window:.0f}"
                        current = held.get("s") == ws
                        others = sum(1 for k, v in held.items() if k.startswith("L:")
                                     and k != f"L:{consumer}" and v == ws)  # fmt: skip
                        holders.append(1 + others if current else 1)
                want = i + 1
                seen = await store._run(plan, g, repr(clock.t), (consumer, want))
                rooms = [(c.limit - n - c.hits) / (2 * k) for c, n, k in
                         zip(plan.counters, seen.counts, holders, strict=True)]  # fmt: skip
                shares = [min(b, w) - a - s.hits for s, a, b, w in
                          zip(plan.shares, seen.shared, seen.bounds, seen.wanted,
                              strict=True)]  # fmt: skip
                expected = lease.size(want, rooms, shares) if seen.admitted else 0
                assert seen.block == expected, (i, seen)
                sizes.append(seen.block)
                clock.advance(0.013)
            assert len(set(sizes)) > 5  # the wants and the rooms both bound some
            assert 0 in sizes  # the plain counter ran out of room
        finally:
            await _close(replicas)


async def _contend(limiters: list[Limiter], clock: FakeClock, seconds: int) -> dict[str, list[int]]:
    """A greedy client at 200/s and a modest one at 20/s at the contended cap (100/s), each
    request through the next limiter in turn, 5 ms ticks: admitted per client per second."""
    admitted: dict[str, list[int]] = {"greedy": [0] * seconds, "modest": [0] * seconds}
    turn = 0
    for tick in range(seconds * 200):
        second = tick // 200
        asks = ["greedy"] + (["modest"] if tick % 10 == 0 else [])
        for client in asks:
            limiter = limiters[turn % len(limiters)]
            turn += 1
            admitted[client][second] += await _ask(limiter, client, "contended")
        clock.advance(0.005)
    return admitted


@pytest.mark.behaviour
class TestFairness:
    async def test_no_block_is_reserved_at_a_contended_cap(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """At the contended cap (not sized for its clients) blocks are reserved only while
        nobody is held and the cap has history: none in its first window, none once the
        greedy client is held; the modest client's blocks come back when it is."""
        replicas, clock = await _replicas(tmp_path, lease_store_factory, 1)
        (replica,) = replicas
        try:
            for _ in range(100):  # the first window: no history, no blocks
                await _ask(replica, "greedy", "contended")
                clock.advance(0.009)
            assert not _leases(replica).blocks
            clock.advance(1.0)
            for _ in range(30):  # the greedy client alone, open (30 in 0.3 s, under 100)
                await _ask(replica, "greedy", "contended")
                clock.advance(0.01)
            assert _leases(replica).blocks
            for _ in range(300):  # flat out: held, and no block while held
                await _ask(replica, "greedy", "contended")
                clock.advance(0.001)
            assert not [b for b in _leases(replica).blocks.values() if b.room and b.until > clock.t]
        finally:
            await _close(replicas)

    async def test_a_contended_cap_is_shared_as_without_leases(
        self, tmp_path: Path, lease_store_factory: StoreFactory
    ) -> None:
        """Two leasing replicas give the greedy and the modest client what the memory store
        gives them, second by second: blocks are reserved only while the cap is not
        contended, within each client's predicted want."""
        replicas, clock = await _replicas(tmp_path, lease_store_factory)
        try:
            leased = await _contend(replicas, clock, 5)
        finally:
            await _close(replicas)
        memory_clock = FakeClock(T0)
        store: Store = MemoryStore()
        reference = await _contend(
            [Limiter(load_text(tmp_path, CONFIG), store, memory_clock)], memory_clock, 5
        )
        assert reference == {"greedy": [80] * 5, "modest": [20] * 5}
        assert leased == reference


@pytest.mark.behaviour
class TestOnACluster:
    async def test_one_slot_plans_lease_and_plans_across_slots_keep_the_exact_path(
        self, tmp_path: Path, redis_cluster_store_factory: StoreFactory
    ) -> None:
        """On a Redis Cluster a descriptor's keys share one slot, so its plan is leased (a
        plain counter's limit reached exactly, a client under a cap answered from blocks);
        a request whose descriptors sit in two slots keeps the exact two-phase path."""
        clock = FakeClock(T0)
        store = await redis_cluster_store_factory(leases="on")
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)  # type: ignore[arg-type]
        try:
            answers = [await _ask(limiter, "eve") for _ in range(2 * LIMIT)]
            assert sum(answers) == LIMIT
            assert _store(limiter).round_trips < LIMIT
            calls = _store(limiter).round_trips
            assert all([await _ask(limiter, "eve", "roomy") for _ in range(20)])
            assert _store(limiter).round_trips < calls + 10  # from blocks
            calls = _store(limiter).round_trips
            both = req("edge", desc("route=roomy", "client_id=fay"), desc("client_id=fay"))
            for _ in range(5):
                assert (await limiter.should_rate_limit(both)).code is Code.OK
            assert _store(limiter).round_trips >= calls + 10  # two slots, each call exact
        finally:
            await store.close()  # type: ignore[attr-defined]


UPSTREAM = """
domain: up
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: path
    rate_limit: {unit: second, requests_per_unit: 1000}
"""


MERGE = """
domain: up
descriptors:
  - key: user
    rate_limit: {unit: day, requests_per_unit: 3}
  - key: every
    rate_limit: {unit: day, requests_per_unit: 40}
"""


def _upstream_request(client: str = "x") -> object:
    return req("up", desc(f"client_id={client}"), desc("path=/a"))


async def _upstream_limiter(
    tmp_path: Path, factory: StoreFactory, clock: FakeClock, **options: object
) -> Limiter:
    """A limiter under upstream's semantics (every level counts a refused hit)."""
    path = tmp_path / "up.yaml"
    path.write_text(UPSTREAM)
    loaded = load([path], charge_over_limit=True)
    return Limiter(loaded, await factory(**options), clock)  # type: ignore[arg-type]


def _counter(redis_server: RedisProcess, limiter: Limiter, prefix: str, index: int) -> int:
    """Counter ``index`` of the upstream request's plan, as Redis holds it (its window's)."""
    plan = make_plan(_upstream_request(), limiter._active.matcher)  # type: ignore[arg-type]
    (g,) = slot_groups(plan, prefix, False)
    with redis_server.client() as client:
        return int(client.hget(g.counter_keys[index], "n") or 0)


@pytest.mark.behaviour
class TestRefusedHitsCharged:
    """Where refused hits are charged (upstream's semantics: ``charge_when_over_limit`` on
    every level), plans take blocks too; a refusal the over-limit cache answers here owes
    its hits, which reach the counters at the sweep, before the plan's next script call,
    and on close."""

    async def test_same_answers_and_counts_as_without_leases_with_few_calls(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """A client at 100 a minute, beside a path at 1000 a second, asks 600 times in 4.7 s
        (100 admitted, 500 refused): with and without leases every answer is the same (code
        and remaining of each status), and once closed each counter in Redis holds every hit
        asked in its window (600 for the minute, 88 for the last second); with leases from
        far fewer script calls."""
        answers: dict[str, list[object]] = {}
        counts: dict[str, tuple[int, int]] = {}
        calls: dict[str, int] = {}
        for leases in ("off", "on"):
            clock = FakeClock((T0 // 60 + 1) * 60 + 1)
            prefix = f"{leases}:"
            limiter = await _upstream_limiter(tmp_path, lease_store_factory, clock,
                                              leases=leases, key_prefix=prefix)  # fmt: skip
            seen = []
            try:
                for _ in range(600):
                    decision = await limiter.should_rate_limit(_upstream_request())  # type: ignore[arg-type]
                    statuses = tuple((s.code, s.limit_remaining) for s in decision.statuses)
                    seen.append((decision.code, statuses))
                    clock.advance(1 / 128)  # exact in binary: no second gets one too many
                calls[leases] = _store(limiter).round_trips
            finally:
                await limiter.store.close()
            answers[leases] = seen
            counts[leases] = (_counter(redis_server, limiter, prefix, 0),
                              _counter(redis_server, limiter, prefix, 1))  # fmt: skip
        assert [a[0] for a in answers["off"]].count(Code.OK) == 100
        assert answers["on"] == answers["off"]
        assert counts["on"] == counts["off"] == (600, 88)
        assert calls["off"] == 600 and calls["on"] < 100, calls

    async def test_closing_counts_the_refused_hits_still_owed(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """Refusals answered here owe their hits; closing (a drain) counts them in Redis."""
        clock = FakeClock((T0 // 60 + 1) * 60 + 1)
        limiter = await _upstream_limiter(tmp_path, lease_store_factory, clock,
                                          leases="on", key_prefix="drain:")  # fmt: skip
        try:
            for _ in range(130):
                await limiter.should_rate_limit(_upstream_request())  # type: ignore[arg-type]
                clock.advance(0.001)
            owed = _leasing(limiter).owed
            assert sum(d.hits for d in owed.debts.values()) > 0
        finally:
            await limiter.store.close()
        assert _counter(redis_server, limiter, "drain:", 0) == 130
        assert _counter(redis_server, limiter, "drain:", 1) == 130

    async def test_clients_asking_once_make_one_script_call_each(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """40 clients asking once each under upstream's semantics, then closing: one EVALSHA
        per request, nothing given back and nothing owed."""
        clock = FakeClock(T0)
        limiter = await _upstream_limiter(tmp_path, lease_store_factory, clock, leases="on")
        with redis_server.client() as client:
            client.config_resetstat()
        try:
            for i in range(40):
                decision = await limiter.should_rate_limit(_upstream_request(f"once-{i}"))  # type: ignore[arg-type]
                assert decision.code is Code.OK
                clock.advance(0.01)
            assert not _leases(limiter).blocks
        finally:
            await limiter.store.close()
        with redis_server.client() as client:
            stats = client.info("commandstats")
        evalsha = stats.get("cmdstat_evalsha", {})
        made = int(evalsha["calls"]) - int(evalsha.get("failed_calls", 0))
        assert made + int(stats.get("cmdstat_eval", {}).get("calls", 0)) == 40, stats

    async def test_refused_hits_owed_for_an_ended_window_stay_out_of_the_next(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """Refusals answered here in one second owe the path's per-second counter; in the
        next second another replica starts that counter's new window, then this one pays:
        the new second counts only its own two hits (the minute counts all 122)."""
        start = (T0 // 60 + 1) * 60 + 1
        clock = FakeClock(start)
        leasing = await _upstream_limiter(tmp_path, lease_store_factory, clock,
                                          leases="on", key_prefix="end:")  # fmt: skip
        other = await _upstream_limiter(tmp_path, lease_store_factory, clock,
                                        leases="off", key_prefix="end:")  # fmt: skip
        try:
            for _ in range(120):
                await leasing.should_rate_limit(_upstream_request())  # type: ignore[arg-type]
                clock.advance(0.001)
            owed = _leasing(leasing).owed
            assert owed.debts
            clock.t = start + 1.0
            for limiter in (other, leasing):
                decision = await limiter.should_rate_limit(_upstream_request())  # type: ignore[arg-type]
                assert decision.code is Code.OVER_LIMIT
        finally:
            await _close([leasing, other])
        assert _counter(redis_server, leasing, "end:", 0) == 122
        assert _counter(redis_server, leasing, "end:", 1) == 2

    async def test_a_request_larger_than_its_block_uses_what_the_block_holds(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """A check of 0 hits, then a charge of 30, four times (a response's cost charged
        after it, as Envoy Gateway does), at 100 a minute: with and without leases the same
        answers (30, 60 and 90 pass, 120 is refused and counted, the check after it is
        over) and the same counts. A charge larger than what its block holds uses the
        block; counted on top of it, the block's hits refused the third charge."""
        answers: dict[str, list[object]] = {}
        counts: dict[str, int] = {}
        for leases in ("off", "on"):
            clock = FakeClock((T0 // 60 + 1) * 60 + 1)
            prefix = f"big-{leases}:"
            limiter = await _upstream_limiter(tmp_path, lease_store_factory, clock,
                                              leases=leases, key_prefix=prefix)  # fmt: skip
            seen = []
            try:
                for hits in (0, 30) * 4 + (0,):
                    request = req("up", desc("client_id=x", hits=hits), desc("path=/a", hits=hits))
                    decision = await limiter.should_rate_limit(request)
                    statuses = tuple((s.code, s.limit_remaining) for s in decision.statuses)
                    seen.append((hits, decision.code, statuses))
                    clock.advance(0.01)
            finally:
                await limiter.store.close()
            answers[leases] = seen
            counts[leases] = _counter(redis_server, limiter, prefix, 0)
        assert [code for _, code, _ in answers["off"]] == [Code.OK] * 7 + [Code.OVER_LIMIT] * 2
        assert answers["on"] == answers["off"]
        assert counts["on"] == counts["off"] == 120

    async def test_two_shapes_charging_one_counter_see_each_others_hits(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """The path's counter is charged by two shapes, a client's request and the path's
        alone (as Envoy Gateway's two policies call for one HTTP request), 300 times in
        turns: with and without leases the same answers, each status's remaining included
        (a block of one shape, seen through its own requests only, told a remaining that
        missed the other shape's hits: Envoy Gateway's merge test saw 19 left for 15)."""
        answers: dict[str, list[object]] = {}
        for leases in ("off", "on"):
            clock = FakeClock((T0 // 60 + 1) * 60 + 1)
            prefix = f"two-{leases}:"
            limiter = await _upstream_limiter(tmp_path, lease_store_factory, clock,
                                              leases=leases, key_prefix=prefix)  # fmt: skip
            seen = []
            try:
                for i in range(300):
                    request = _upstream_request() if i % 3 else req("up", desc("path=/a"))
                    decision = await limiter.should_rate_limit(request)  # type: ignore[arg-type]
                    statuses = tuple((s.code, s.limit_remaining) for s in decision.statuses)
                    seen.append((decision.code, statuses))
                    clock.advance(1 / 1024)
            finally:
                await limiter.store.close()
            answers[leases] = seen
        assert answers["on"] == answers["off"]

    async def test_three_shapes_charging_one_counter_count_no_block_twice(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """Three plans charging one counter, on an injected clock, as a rule every request
        counts beside clients' rules (Envoy Gateway's merge test has two such plans at its
        Gateway policy): the counter's own requests take a block; client one, known over,
        is refused here (its hit owed); client two goes to Redis. With and without leases
        the same answers, each status's remaining included, and the same counts. The block
        went stale at one's refusal but was not given back before two's script call (only
        the block of the counter's last charger here, one's, was looked for), so two's
        count held the block's unused hits (3 fewer left than there were); and one's
        refusal, told from what was known of the counter, missed the hit the block had
        just admitted (one more left than there was)."""
        path = tmp_path / "merge.yaml"
        path.write_text(MERGE)
        loaded = load([path], charge_over_limit=True)
        one, two = (req("up", desc(f"user={u}"), desc("every=x")) for u in ("one", "two"))
        alone = req("up", desc("every=x"))
        # (request, seconds to the next): one reaches its limit at Redis, the path's
        # requests past RECENT of that take a block, then one (refused here) and two
        steps = [(one, 0.001)] * 4 + [(alone, 0.3), (alone, 0.01), (alone, 0.001),
                                      (alone, 0.001), (one, 0.001), (two, 0.001),
                                      (alone, 0.3), (two, 0.001), (alone, 0.001)]  # fmt: skip
        answers: dict[str, list[object]] = {}
        counts: dict[str, tuple[int, ...]] = {}
        for leases in ("off", "on"):
            clock = FakeClock((T0 // 86400 + 1) * 86400 + 1)
            prefix = f"merge-{leases}:"
            limiter = Limiter(loaded, await lease_store_factory(leases=leases, key_prefix=prefix),  # type: ignore[arg-type]
                              clock)  # fmt: skip
            seen = []
            try:
                for request, gap in steps:
                    decision = await limiter.should_rate_limit(request)  # type: ignore[arg-type]
                    statuses = tuple((s.code, s.limit_remaining) for s in decision.statuses)
                    seen.append((decision.code, statuses))
                    clock.advance(gap)
            finally:
                await limiter.store.close()
            answers[leases] = seen
            plan = make_plan(one, limiter._active.matcher)  # type: ignore[arg-type]
            (g,) = slot_groups(plan, prefix, False)
            with redis_server.client() as client:
                counts[leases] = tuple(int(client.hget(k, "n") or 0) for k in g.counter_keys)
        assert [code for code, _ in answers["off"]] == [Code.OK] * 3 + [Code.OVER_LIMIT] + [
            Code.OK] * 4 + [Code.OVER_LIMIT] + [Code.OK] * 4  # fmt: skip
        assert answers["on"] == answers["off"]
        assert counts["on"] == counts["off"] == (5, 13)

    async def test_replicas_never_admit_past_a_limit(
        self, tmp_path: Path, lease_store_factory: StoreFactory, redis_server: RedisProcess
    ) -> None:
        """Two leasing replicas in turns, 400 requests at 100 a minute, every level counting
        refused hits: 100 admitted, never more; each counter in Redis, after both close,
        holds every hit asked (400, and the path's per-second count)."""
        start = (T0 // 60 + 1) * 60 + 1
        clock = FakeClock(start)
        replicas = [await _upstream_limiter(tmp_path, lease_store_factory, clock,
                                            leases="on", key_prefix="two-replicas:")
                    for _ in range(2)]  # fmt: skip
        admitted = 0
        try:
            for i in range(400):
                decision = await replicas[i % 2].should_rate_limit(_upstream_request())  # type: ignore[arg-type]
                admitted += decision.code is Code.OK
                clock.advance(1 / 512)
        finally:
            await _close(replicas)
        assert admitted <= LIMIT
        assert admitted > LIMIT - 10  # what blocks strand is a few hits
        assert _counter(redis_server, replicas[0], "two-replicas:", 0) == 400
