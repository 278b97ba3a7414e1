"""Redis-only: a cap's division at scale (issue 41). A Lua script blocks every other command on
its Redis while it runs, so no admit.lua call may do work that grows with the clients of a
cap; the rows are read outside the script (store/redis/division.py). Memory has no script.
"""

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fairlimit.core import sharing
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.sharing import FORCES, ROW_FIELDS, SPLIT, STALE, Row
from fairlimit.store.redis import division, division_rows, script
from fairlimit.store.redis.keys import slot_groups
from fairlimit.store.redis.script import ADMIT, NEED_LEVEL
from helpers import desc, load_text, req
from redis_servers import RedisProcess

pytestmark = pytest.mark.behaviour

T0 = 1_700_000_000.0
OUTLAST = 10.0  # bounds a wait for background work without timing it
# Commands a test or the store sends itself (not from inside a script).
_OUTSIDE = frozenset({"evalsha", "eval", "hscan", "info", "sadd", "expire", "script|load", "hello"})

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100000000}
    fair_share: {active_clients: 100}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 1000000}
"""

Factory = Callable[..., Awaitable[Any]]


@pytest.fixture
def matcher(tmp_path: Path) -> Matcher:
    return Matcher(load_text(tmp_path, CONFIG).config)


def client_plan(matcher: Matcher, client: str) -> Plan:
    return make_plan(req("edge", desc("route=public", f"client_id={client}")), matcher)


def _stats(server: RedisProcess) -> dict[str, int]:
    with server.client() as client:
        stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _inside(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The commands run between two snapshots that no client sent: those of scripts."""
    grown = {k: after[k] - before.get(k, 0) for k in after if k not in _OUTSIDE}
    return {k: v for k, v in grown.items() if v}


def _size(reply: object) -> int:
    """Elements in a (nested) script reply."""
    if isinstance(reply, list):
        return sum(_size(x) for x in reply)
    return 1


async def _clients(store: Any, matcher: Matcher, n: int, at: float) -> None:
    """``n`` clients ask once each at ``at`` (in batches: one pipeline each)."""
    for first in range(0, n, 200):
        plans = [client_plan(matcher, f"c{i}") for i in range(first, min(n, first + 200))]
        outcomes = await asyncio.gather(*(store.admit(p, at) for p in plans))
        assert all(o.admitted for o in outcomes)


async def _call(store: Any, plan: Plan, at: float, given: dict[str, Any]) -> Any:
    """admit.lua for ``plan`` at ``at``, as the store calls it (may lock, ``given``)."""
    (g,) = slot_groups(plan, "fairlimit:", False)
    args = script.admit_args(plan, g, repr(at), (True, 250), given)
    return await store._scripts.admit(keys=script.keys(ADMIT, g), args=args)


class TestScriptCallsAtScale:
    """Redis-only: what one admit.lua call does, as the clients of a cap grow 100-fold."""

    async def _measure(self, store: Any, server: RedisProcess, matcher: Matcher, n: int
                       ) -> tuple[dict[str, int], ...]:  # fmt: skip
        """The commands inside the hand-back of a due division, inside the call given the
        division, and inside the next request's call, at a cap of ``n`` clients."""
        await _clients(store, matcher, n, T0)
        later = T0 + 1.3  # a new period: the cap's division is due
        plan = client_plan(matcher, "c0")
        (g,) = slot_groups(plan, "fairlimit:", False)
        snapshots = [_stats(server)]
        reply = await _call(store, plan, later, {})
        snapshots.append(_stats(server))
        assert int(reply[0]) == NEED_LEVEL
        assert _size(reply) == 2 + 9  # NEED_LEVEL, now, one cap's nine fields: no rows
        now, (back,) = division.hand_backs(reply)
        assert back.indexed == back.clients == n  # the rows are there, and not returned
        assert back.fields == 0  # each client's row is its own hash: none in the rows hash
        share = plan.shares[g.cap_share[0]]
        made = await division.made(store._client, g.cap_keys[0], share, now, back, OUTLAST)
        snapshots.append(_stats(server))
        assert int((await _call(store, plan, later, {g.caps[0]: made}))[0]) == 1
        snapshots.append(_stats(server))
        assert int((await _call(store, client_plan(matcher, "c1"), later, {}))[0]) == 1
        snapshots.append(_stats(server))
        at = snapshots  # the rows were read between the second and the third
        return _inside(at[0], at[1]), _inside(at[2], at[3]), _inside(at[3], at[4])

    async def test_commands_and_reply_of_a_call_do_not_grow_with_the_clients(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """At a cap of 100 and of 10,000 clients, a division due is handed back with the
        same reply size and the same commands inside the script (its rows are not returned:
        the caller reads them), the call that takes the division runs the same
        commands, and so does the next request's call."""
        measured = []
        for n in (100, 10_000):
            # a generous timeout: the clients are written in pipelines of 200 calls
            store = await redis_store_factory(local_cache=0, timeout=OUTLAST)
            try:
                measured.append(await self._measure(store, redis_server, matcher, n))
            finally:
                await store.close()
        small, large = measured
        assert small == large


async def _early_in_a_sub_period(client: Any) -> None:
    """Until Redis's clock is just past the start of a sub-period of the per-second cap
    (SPLIT a period), so that a request's calls fall within one: across a boundary, a new
    division falls due between the hand-back and the request, which then takes a call more
    (a CI run of the Cluster case counted 44 calls for 43)."""
    seconds, micros = await client.time()
    step = 1 / SPLIT
    await asyncio.sleep(step - (seconds + micros / 1e6) % step + 0.005)


class TestBackgroundDivision:
    """Redis-only: a large cap's division made off the request path (memory divides inline,
    in-process)."""

    @pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
    async def test_a_large_caps_division_is_made_in_the_background(
        self, backend: str, matcher: Matcher, request: pytest.FixtureRequest
    ) -> None:
        """On Redis's clock, at a cap of more clients than inline_rows, the request that wins
        a due division's lock is decided by the division in force (the hand-back, then the
        request), and the division is handed in by a background task (a third call): the
        cap's meta then holds a newer division and the lock is gone (one Redis, a Cluster)."""
        factory = request.getfixturevalue(f"{backend.replace('-', '_')}_store_factory")
        store = await factory(clock="redis", inline_rows=10, local_cache=0)
        plan = client_plan(matcher, "c0")
        (g,) = slot_groups(plan, "fairlimit:", backend == "redis-cluster")
        meta, lock = g.cap_keys[0]["meta"], g.cap_keys[0]["lock"]
        client = store._client
        try:
            await _clients(store, matcher, 40, 0.0)
            background = store._divisions.background
            async with asyncio.timeout(OUTLAST):  # a division the clients set off, finished
                while background._tasks:
                    await asyncio.sleep(0.01)
            made = background.made
            first = int(await client.hget(meta, "e") or -1)
            # the division in force made a period ago: the next request finds it due
            await client.hset(meta, "e", str(first - FORCES * SPLIT))
            await client.delete(lock)
            await _early_in_a_sub_period(client)
            trips = store.round_trips
            assert (await store.admit(plan, 0.0)).admitted
            async with asyncio.timeout(OUTLAST):
                while background.made == made:
                    await asyncio.sleep(0.01)
            # the hand-back, the request decided, and the division handed in
            assert store.round_trips == trips + 3
            assert int(await client.hget(meta, "e") or -1) >= first
            assert await client.get(lock) is None
        finally:
            await store.close()

    async def test_a_small_caps_division_is_made_inline(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """At a cap of no more clients than inline_rows, the division is handed in before
        the request is decided (two calls: the hand-back, then the request with the division
        made from the rows read between them), none in the background."""
        store = await redis_store_factory(clock="redis", inline_rows=100, local_cache=0)
        plan = client_plan(matcher, "c0")
        (g,) = slot_groups(plan, "fairlimit:", False)
        meta = g.cap_keys[0]["meta"]
        try:
            await _clients(store, matcher, 40, 0.0)
            with redis_server.client() as client:
                first = int(client.hget(meta, "e") or -1)
                client.hset(meta, "e", str(first - FORCES * SPLIT))
                client.delete(g.cap_keys[0]["lock"])
            await _early_in_a_sub_period(store._client)
            trips = store.round_trips
            assert (await store.admit(plan, 0.0)).admitted
            assert store.round_trips == trips + 2
            with redis_server.client() as client:
                assert int(client.hget(meta, "e") or -1) >= first
            assert store._divisions.background.made == 0
        finally:
            await store.close()


class TestStaleRows:
    """Redis-only: a row is a hash of its own, indexed in the cap's seen set, which lives as
    long as its cap is used (memory drops a row object at a new period)."""

    async def test_a_row_stale_at_a_division_is_dropped_and_a_live_one_kept(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """Client old asks once; new asks STALE + 2 periods later, when the cap's division
        is due: old's row (no history left, its window long gone) is dropped, every field
        of it, as memory drops it; new's row stays, and old asking again starts afresh."""
        store = await redis_store_factory(local_cache=0)
        (g,) = slot_groups(client_plan(matcher, "old"), "fairlimit:", False)
        rows = g.cap_keys[0]["rows"]
        later = T0 + STALE + 2  # periods of 1 s at this per-second cap
        try:
            assert (await store.admit(client_plan(matcher, "old"), T0)).admitted
            assert (await store.admit(client_plan(matcher, "new"), later)).admitted
            async with asyncio.timeout(OUTLAST):
                while await store._client.exists(f"{rows}:old"):
                    await asyncio.sleep(0.01)
            assert await _row_clients(store, rows) == {"new"}
            assert await store._client.hlen(f"{rows}:new") == len(ROW_FIELDS)
            assert (await store.admit(client_plan(matcher, "old"), later)).admitted
        finally:
            await store.close()


def _sent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The commands run between two snapshots (no script runs between them here)."""
    grown = {k: after[k] - before.get(k, 0) for k in after if k not in {"info", "hello"}}
    return {k: v for k, v in grown.items() if v}


async def _hand_back(store: Any, plan: Plan, at: float) -> tuple[float, division.HandBack]:
    reply = await _call(store, plan, at, {})
    assert int(reply[0]) == NEED_LEVEL
    now, (back,) = division.hand_backs(reply)
    return now, back


async def _row_clients(store: Any, rows: str) -> set[str]:
    """The clients with a row of their own at the cap whose rows key is ``rows``."""
    return {key.removeprefix(f"{rows}:") async for key in store._client.scan_iter(f"{rows}:*")}


async def _every_row(store: Any, rows: str) -> list[str]:
    """Every row of the cap, as flat ``<field>:<client>`` pairs (script.rows_of): the rows
    of their own (SCAN, HGETALL) and those in the rows hash (HGETALL)."""
    flat = [x for kv in (await store._client.hgetall(rows)).items() for x in kv]
    for name in await _row_clients(store, rows):
        for field, value in (await store._client.hgetall(f"{rows}:{name}")).items():
            flat += (f"{field}:{name}", value)
    return flat


async def _whole(store: Any, plan: Plan, now: float, back: division.HandBack
                 ) -> script.GivenDivision:  # fmt: skip
    """The division made from every row of the cap, as before the index."""
    (g,) = slot_groups(plan, "fairlimit:", False)
    flat = await _every_row(store, g.cap_keys[0]["rows"])
    return division.divide(plan.shares[g.cap_share[0]], script.rows_of(flat), now, back)


async def _as_an_earlier_version(store: Any, rows: str) -> None:
    """Move every row of its own into the rows hash (``<field>:<client>``): the cap as an
    earlier version left it (its seen index as it is)."""
    for name in await _row_clients(store, rows):
        got = await store._client.hgetall(f"{rows}:{name}")
        await store._client.hset(rows, mapping={f"{f}:{name}": v for f, v in got.items()})
        await store._client.delete(f"{rows}:{name}")
    await store._client.pexpire(rows, 600_000)


class TestRowsReadByADivision:
    """Redis-only: a division reads the rows written in the last two windows (the cap's seen
    index), not every row the cap holds, and makes the division every row would make."""

    async def _division(
        self, store: Any, server: RedisProcess, matcher: Matcher, old: int
    ) -> tuple[dict[str, int], script.GivenDivision, script.GivenDivision]:
        """``old`` clients ask at T0, 150 others at T0 + 10 (ten windows later, one instant:
        a tie in seen); a division due at T0 + 11.3: (the commands it sent, the division
        made, the division every row gives)."""
        await _clients(store, matcher, old, T0)
        later = [client_plan(matcher, f"n{i}") for i in range(150)]
        assert all(o.admitted for o in await asyncio.gather(*(store.admit(p, T0 + 10)
                                                              for p in later)))  # fmt: skip
        plan = later[0]
        (g,) = slot_groups(plan, "fairlimit:", False)
        now, back = await _hand_back(store, plan, T0 + 11.3)
        assert back.indexed == old + 150 and not back.whole
        before = _stats(server)
        made = await division.made(store._client, g.cap_keys[0], plan.shares[g.cap_share[0]],
                                   now, back, OUTLAST)  # fmt: skip
        sent = _sent(before, _stats(server))
        return sent, made, await _whole(store, plan, now, back)

    async def test_the_rows_read_grow_with_the_clients_active_not_with_all_rows(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """With 100 and with 2,000 rows left from ten windows before, a division reads the
        same: the 150 rows written lately (one HMGET each, a few ZRANGE / ZCOUNT steps of
        seen), no HSCAN; and its division is the one every row gives."""
        measured = []
        for old in (100, 2_000):
            store = await redis_store_factory(local_cache=0, timeout=OUTLAST)
            try:
                with redis_server.client() as client:
                    client.flushall()
                sent, made, whole = await self._division(store, redis_server, matcher, old)
            finally:
                await store.close()
            assert made == whole
            assert sent.get("hmget") == 150 and "hscan" not in sent
            measured.append(sent)
        assert measured[0] == measured[1]

    async def test_a_division_cold_by_the_rows_read_finds_an_older_rows_history(
        self, redis_store_factory: Factory, matcher: Matcher
    ) -> None:
        """Client old asked ten periods ago (its history lives STALE periods); new asks now
        for the first time: the rows written lately have no history, old's has, so the
        division is not cold, as every row makes it."""
        store = await redis_store_factory(local_cache=0)
        try:
            assert (await store.admit(client_plan(matcher, "old"), T0)).admitted
            plan = client_plan(matcher, "new")
            (g,) = slot_groups(plan, "fairlimit:", False)
            now, back = await _hand_back(store, plan, T0 + 10)
            made = await division.made(store._client, g.cap_keys[0],
                                       plan.shares[g.cap_share[0]], now, back, OUTLAST)  # fmt: skip
            whole = await _whole(store, plan, now, back)
        finally:
            await store.close()
        assert made == whole
        cold = list(sharing.DIVISION_FIELDS).index("cold")
        assert float(made.values.split(",")[cold]) == 0

    async def test_rows_written_before_the_index_are_read_whole_and_indexed(
        self, redis_store_factory: Factory, matcher: Matcher
    ) -> None:
        """A cap whose seen index holds fewer clients than its rows hash holds rows (written
        by an earlier version, before the index was kept) is read whole, as every row gives
        its division, and each row is then indexed: the next hand-back counts them all."""
        store = await redis_store_factory(local_cache=0, timeout=OUTLAST)
        plan = client_plan(matcher, "c0")
        (g,) = slot_groups(plan, "fairlimit:", False)
        try:
            await _clients(store, matcher, 300, T0)
            await _as_an_earlier_version(store, g.cap_keys[0]["rows"])
            await store._client.delete(g.cap_keys[0]["seen"])
            now, back = await _hand_back(store, plan, T0 + 1.3)
            assert back.whole and back.clients == 300
            made = await division.made(store._client, g.cap_keys[0],
                                       plan.shares[g.cap_share[0]], now, back, OUTLAST)  # fmt: skip
            assert made == await _whole(store, plan, now, back)
            assert await store._client.zcard(g.cap_keys[0]["seen"]) == 300
        finally:
            await store.close()


class TestWalkOfSeen:
    """Redis-only: the walk of a cap's seen index (store/redis/division_rows.walk) steps
    PAGE clients at a time, and a tie of more than a page is read by rank."""

    async def test_every_client_in_the_bounds_is_walked_once_up_and_down(
        self, redis_store_factory: Factory
    ) -> None:
        """Clients d1..d99 at scores 1..99, and 200 clients t* tied at 50: up from 30 the
        walk gives d30..d99 and every t*; down from below 60 to 20, d20..d59 and every t*;
        each once, in steps of at most PAGE."""
        store = await redis_store_factory(local_cache=0)
        key = "fairlimit:walk-test"
        try:
            await store._client.zadd(key, {f"d{i}": float(i) for i in range(1, 100)})
            await store._client.zadd(key, {f"t{i:03d}": 50.0 for i in range(200)})
            tied = {f"t{i:03d}" for i in range(200)}
            for near, far, rev, scores in (("30", "+inf", False, range(30, 100)),
                                           ("(60", "20", True, range(20, 60))):  # fmt: skip
                steps = [s async for s in division_rows.walk(store._client, key, near, far,
                                                              rev, OUTLAST)]  # fmt: skip
                walked = [c for step in steps for c in step]
                assert sorted(walked) == sorted({f"d{i}" for i in scores} | tied)
                assert max(len(step) for step in steps) <= division_rows.PAGE
        finally:
            await store.close()


class TestReadRows:
    """Redis-only: a division reads its clients' rows READ_STEP a call of read_rows.lua,
    and makes of each the row an HMGET of its fields makes (script.row_of), in what a
    division reads of it (sharing.DIVIDED_BY)."""

    async def test_the_rows_read_are_those_an_hmget_of_each_gives(
        self, redis_store_factory: Factory, redis_server: RedisProcess
    ) -> None:
        """75 clients: rows with every field, with some left out (the three a row needs,
        window, limit and weight, among them: no row then), none at all, and one in the
        rows hash of an earlier version; values drawn at random. Each client's row is the
        one row_of makes of an HMGET of its fields, in three calls, and the earlier
        version's row is found there."""
        rng = random.Random(41)
        store = await redis_store_factory(local_cache=0)
        rows, fields = "fairlimit:{read-test}r:cap", list(ROW_FIELDS.values())
        clients = [f"c{i}" for i in range(75)]
        try:
            client = store._client
            for name in clients[:-1]:
                kept = [f for f in fields if rng.random() < 0.9] if rng.random() < 0.5 else fields
                if rng.random() < 0.1:
                    kept = []  # no row of its own
                values = {f: repr(rng.uniform(-5, 5) * 10 ** rng.randint(0, 9)) for f in kept}
                for whole in sharing.WHOLE_FIELDS:  # as the admit script writes them
                    if ROW_FIELDS[whole] in values:
                        values[ROW_FIELDS[whole]] = str(rng.randint(-1, 2_000_000_000))
                if values:
                    await client.hset(division_rows.row_key(rows, name), mapping=values)
            legacy = {f"{f}:{clients[-1]}": str(i + 1) for i, f in enumerate(fields)}
            await client.hset(rows, mapping=legacy)
            expected = {}
            for name in clients[:-1]:
                row = script.row_of(await client.hmget(division_rows.row_key(rows, name), fields))
                if row is not None:
                    expected[name] = row
            old_fields = [f"{f}:{clients[-1]}" for f in fields]
            expected[clients[-1]] = script.row_of(await client.hmget(rows, old_fields))
            assert 50 < len(expected) < 75  # some rows partly written, some none
            await division_rows.read_clients(client, rows, ["nobody"], OUTLAST)  # loaded
            before = _stats(redis_server)
            got = await division_rows.read_clients(client, rows, clients, OUTLAST, legacy=True)
            after = _stats(redis_server)
            assert _values(got) == _values(expected)
            assert after["evalsha"] - before["evalsha"] == 3  # 32, 32 and 11 rows
            assert after["hmget"] - before["hmget"] == 75 + (75 - len(expected) + 1)
        finally:
            await store.close()


def _values(rows: dict[str, Row]) -> dict[str, dict[str, object]]:
    """What a division reads of each row (sharing.DIVIDED_BY: the rest is not read)."""
    read = sharing.DIVIDED_BY
    return {client: {a: getattr(row, a) for a in read} for client, row in rows.items()}


HOURLY = """
domain: edge
descriptors:
  - key: route
    value: hourly
    rate_limit: {unit: hour, requests_per_unit: 100000000}
    fair_share: {active_clients: 100}
    descriptors:
      - key: client_id
        rate_limit: {unit: hour, requests_per_unit: 1000000}
"""


class TestPruneBySeen:
    """Redis-only: prune.lua finds the stale rows by the cap's seen index, oldest first, a
    few a call (memory drops the same rows at a new period)."""

    async def test_the_stale_rows_and_only_they_leave_the_rows_and_the_index(
        self, redis_store_factory: Factory, tmp_path: Path
    ) -> None:
        """At an hourly cap (periods of 1 s): 40 clients asked two windows ago (stale: no
        history, their window gone), hour asked 90 s ago in this window (its history gone,
        its window not: it stays), fresh asks now, and seen holds ghost, a client without a
        row, written before them all. The division fresh's request sets off drops the 40
        (more than PRUNE_STEP: a call drops them a few at a time) and ghost, their rows and
        from seen; hour and fresh stay in both."""
        matcher = Matcher(load_text(tmp_path, HOURLY).config)

        def plan(client: str) -> Plan:
            return make_plan(req("edge", desc("route=hourly", f"client_id={client}")), matcher)

        start = (T0 // 3600 + 1) * 3600  # a window's start
        store = await redis_store_factory(local_cache=0)
        (g,) = slot_groups(plan("fresh"), "fairlimit:", False)
        rows, seen = g.cap_keys[0]["rows"], g.cap_keys[0]["seen"]
        try:
            for i in range(40):
                assert (await store.admit(plan(f"gone{i}"), start - 7200 + 10 + i)).admitted
            await store._client.zadd(seen, {"ghost": start - 7200})
            assert (await store.admit(plan("hour"), start + 10)).admitted
            assert (await store.admit(plan("fresh"), start + 100)).admitted
            async with asyncio.timeout(OUTLAST):
                while await store._client.zcard(seen) > 2:
                    await asyncio.sleep(0.01)
            assert await _row_clients(store, rows) == {"hour", "fresh"}
            assert set(await store._client.zrange(seen, 0, -1)) == {"hour", "fresh"}
        finally:
            await store.close()

    async def test_a_call_drops_its_count_oldest_first_and_says_how_many(
        self, redis_store_factory: Factory, tmp_path: Path
    ) -> None:
        """20 clients asked two windows ago and ghost (in seen, without a row) before them:
        prune.lua asked for 16 drops ghost and the 15 oldest and says 16, then the other 5
        and says 5 (the division's loop goes on while a call drops all it was asked)."""
        matcher = Matcher(load_text(tmp_path, HOURLY).config)
        start = (T0 // 3600 + 1) * 3600
        store = await redis_store_factory(local_cache=0)
        plans = [make_plan(req("edge", desc("route=hourly", f"client_id=gone{i:02d}")), matcher)
                 for i in range(20)]  # fmt: skip
        (g,) = slot_groups(plans[0], "fairlimit:", False)
        keys = [g.cap_keys[0]["rows"], g.cap_keys[0]["seen"]]
        try:
            for i, p in enumerate(plans):
                assert (await store.admit(p, start - 7200 + 10 + i)).admitted
            await store._client.zadd(keys[1], {"ghost": start - 7200})
            args = division.stale(plans[0].shares[0], start + 100)
            step = division.PRUNE_STEP
            assert await store._scripts.prune(keys=keys, args=[*args, step]) == 16
            left = await store._client.zrange(keys[1], 0, -1)
            assert left == [f"gone{i:02d}" for i in range(15, 20)]
            assert await store._scripts.prune(keys=keys, args=[*args, step]) == 5
            assert await store._client.zcard(keys[1]) == 0
            assert await store._client.exists(keys[0]) == 0
        finally:
            await store.close()


class TestRowsOfAnEarlierVersion:
    """Redis-only: an earlier version kept every row of a cap in one hash (``<field>:
    <client>``); a client's row is a hash of its own now. A cap left by an earlier version
    goes on as if it never was: its rows are read there, and moved out when written."""

    async def _run(self, store: Any, matcher: Matcher, left: bool
                   ) -> tuple[dict[str, Any], script.GivenDivision, set[str]]:  # fmt: skip
        """20 clients ask 3 times at T0; the cap is left as an earlier version kept it
        (``left``); c0..c9 ask again at T0 + 0.5 (the same window and period), and a
        division is due at T0 + 1.3: (every row, the division made, the clients whose row
        is still in the rows hash)."""
        plan = client_plan(matcher, "c0")
        (g,) = slot_groups(plan, "fairlimit:", False)
        rows = g.cap_keys[0]["rows"]
        for _ in range(3):
            await _clients(store, matcher, 20, T0)
        if left:
            await _as_an_earlier_version(store, rows)
        await _clients(store, matcher, 10, T0 + 0.5)
        now, back = await _hand_back(store, plan, T0 + 1.3)
        assert back.fields == (10 * len(ROW_FIELDS) if left else 0) and not back.whole
        made = await division.made(store._client, g.cap_keys[0], plan.shares[g.cap_share[0]],
                                   now, back, OUTLAST)  # fmt: skip
        every = script.rows_of(await _every_row(store, rows))
        legacy = {f.partition(":")[2] for f in await store._client.hkeys(rows)}
        state = {name: {f: getattr(row, f) for f in Row.__slots__} for name, row in every.items()}
        return state, made, legacy

    async def test_a_cap_left_by_an_earlier_version_goes_on_as_if_never_left(
        self, redis_store_factory: Factory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """The same requests on a cap left by an earlier version and on one never left so
        give the same rows (c0..c9 counted 4 hits in the window: the 3 accepted before are
        not lost) and the same division; the rows written since are out of the rows hash,
        the others still in it."""
        runs = []
        for left in (False, True):
            with redis_server.client() as client:
                client.flushall()
            store = await redis_store_factory(local_cache=0, timeout=OUTLAST)
            try:
                runs.append(await self._run(store, matcher, left))
            finally:
                await store.close()
        (rows, made, legacy), (rows_left, made_left, legacy_left) = runs
        assert len(rows) == 20 and rows_left == rows
        assert made_left == made
        assert legacy == set() and legacy_left == {f"c{i}" for i in range(10, 20)}
        assert {rows[f"c{i}"]["admitted"] for i in range(10)} == {4}

    async def test_a_release_counts_off_a_row_left_by_an_earlier_version(
        self, redis_store_factory: Factory, matcher: Matcher
    ) -> None:
        """c0 is admitted 3 times at T0; the cap is left as an earlier version kept it; 2 of
        its hits given back (release.lua, as a lease block's unused hits) come off its row in
        the rows hash, and its next request moves the row out with the count it had: 2."""
        from fairlimit.store.redis.script import RELEASE

        store = await redis_store_factory(local_cache=0, timeout=OUTLAST)
        plan = client_plan(matcher, "c0")
        (g,) = slot_groups(plan, "fairlimit:", False)
        rows = g.cap_keys[0]["rows"]
        admitted = ROW_FIELDS["admitted"]
        try:
            for _ in range(3):
                assert (await store.admit(plan, T0)).admitted
            await _as_an_earlier_version(store, rows)
            args = script.release_args(plan, g, repr(T0), block=2)
            await store._scripts.release(keys=script.keys(RELEASE, g), args=args)
            assert await store._client.hget(rows, f"{admitted}:c0") == "1"
            assert (await store.admit(plan, T0)).admitted
            assert await store._client.hget(f"{rows}:c0", admitted) == "2"
            assert not await store._client.exists(rows)  # its one row moved out
        finally:
            await store.close()

    async def test_a_settlement_counts_off_a_row_left_by_an_earlier_version(
        self, redis_store_factory: Factory, tmp_path: Path
    ) -> None:
        """Tenant a reserves 40 tokens under the fair cap; the cap is left as an earlier
        version kept it; the stream's real cost of 10 gives 30 back (settle.lua) off a's row
        in the rows hash, and a's next reservation of 5 moves the row out with 15."""
        from fairlimit.core.request import Descriptor, Request
        from fairlimit.limiter import Limiter
        from helpers import FakeClock

        minute = 1_700_000_040.0
        tokens = """
domain: llm
descriptors:
  - key: provider
    value: llm
    rate_limit: {unit: minute, requests_per_unit: 1000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: tenant
        rate_limit: {unit: minute, requests_per_unit: 100}
        reservation: {max_duration: 120}
"""

        def start(rid: str, estimate: int) -> Request:
            return req("llm", desc("provider=llm", "tenant=a", f"request_id={rid}",
                                   hits=estimate))  # fmt: skip

        store = await redis_store_factory(local_cache=0, timeout=OUTLAST)
        limiter = Limiter(load_text(tmp_path, tokens), store, FakeClock(minute))
        plan = make_plan(req("llm", desc("provider=llm", "tenant=a")), limiter._active.matcher)
        (g,) = slot_groups(plan, "fairlimit:", False)
        rows, admitted = g.cap_keys[0]["rows"], ROW_FIELDS["admitted"]
        try:
            assert (await limiter.should_rate_limit(start("r1", 40))).code.name == "OK"
            await _as_an_earlier_version(store, rows)
            entries = (("provider", "llm"), ("tenant", "a"), ("request_done", "r1"))
            await limiter.should_rate_limit(Request("llm", (Descriptor(entries, None, 10),)))
            assert await store._client.hget(rows, f"{admitted}:a") == "10"
            assert (await limiter.should_rate_limit(start("r2", 5))).code.name == "OK"
            assert await store._client.hget(f"{rows}:a", admitted) == "15"
            assert not await store._client.exists(rows)
        finally:
            await store.close()
