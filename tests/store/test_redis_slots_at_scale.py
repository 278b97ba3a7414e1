"""Redis-only: a concurrency cap's state at scale (issue 41). A Lua script blocks every other
command on its Redis while it runs, so no acquire.lua call may read a cap whole when its
clients grow: it hands back a bounded part, and each process assembles the cap over its calls
(store/redis/cap_view.py). Memory has no script: its acquire reads its own dicts.
"""

import math
from pathlib import Path
from typing import Any

import pytest

from concurrency_calls import done, take
from fairlimit.core.concurrency import CapDemand, Pool, split
from fairlimit.core.matching import Matcher
from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from fairlimit.store.redis.cap_view import STATE_CHUNK, WHOLE
from fairlimit.store.redis.slots import pool_keys
from helpers import FakeClock, desc, load_text, req
from redis_servers import RedisProcess

pytestmark = pytest.mark.behaviour

T0 = 1_700_000_000.0
HOLDERS = 6  # the cap's max_in_flight: one slot each, the pool full
OUTLAST = 600_000  # ms: the want hash outlives the test (it lives DEMAND_MS from its making)

CAP = f"""
domain: edge
descriptors:
  - key: route
    value: public
    concurrency: {{max_in_flight: {HOLDERS}, max_duration: 300}}
    fair_share: {{active_clients: 2, weights: {{heavy: 2}}}}
    descriptors:
      - key: client_id
        concurrency: {{max_in_flight: 4, max_duration: 300}}
"""
# The commands a test sends itself between two snapshots (not from inside a script).
_OUTSIDE = frozenset({"evalsha", "eval", "info", "hello", "script|load"})


def _stats(server: RedisProcess) -> dict[str, int]:
    with server.client() as client:
        stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _inside(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The commands scripts ran between two snapshots, a hash read whole (HGETALL: a
    listpack) or in a step (HSCAN) counted alike as "read"."""
    grown = {k: after[k] - before.get(k, 0) for k in after if k not in _OUTSIDE}
    out = {k: v for k, v in grown.items() if v and k not in ("hgetall", "hscan")}
    out["read"] = grown.get("hgetall", 0) + grown.get("hscan", 0)
    return out


def _cap_pool(matcher: Matcher, client: str) -> Pool:
    request = req("edge", desc("route=public", f"client_id={client}", "request_id=x"))
    return split(request, matcher).acquire[0].pools[0]


class _Recorded:
    """The replies of a store's acquire.lua calls, as the store got them."""

    def __init__(self, store: Any) -> None:
        self.replies: list[Any] = []
        self._call = store._slots._call
        store._slots._call = self

    async def __call__(self, script: Any, keys: Any, args: Any) -> Any:
        reply = await self._call(script, keys, args)
        self.replies.append(reply)
        return reply


async def _a_cap_of(n: int, store: Any, limiter: Limiter, cluster: bool) -> dict[str, str]:
    """HOLDERS clients hold the cap's slots; w0 is refused, then n - 1 others are written into
    the want hash as acquire.lua wrote w0 (a pipeline, not n script calls); the want hash
    then outlasts the test. Returns the cap's keys."""
    for i in range(HOLDERS):
        assert await take(limiter, f"h{i}", f"r{i}")
    assert not await take(limiter, "w0", "q0")
    keys = pool_keys("fairlimit:", _cap_pool(limiter._active.matcher, "w0"), cluster)
    client = store._client
    await client.pexpire(keys["want"], OUTLAST)  # before its second is up
    written = await client.hgetall(keys["want"])
    assert set(written) - {"g"} == {"r:w0", "l:w0", "w:w0"}  # those the helper writes
    pipe = client.pipeline(transaction=False)
    for first in range(1, n, 500):
        fields: dict[str, str] = {}
        for i in range(first, min(n, first + 500)):
            fields |= {f"r:w{i}": "1", f"l:w{i}": written["l:w0"], f"w:w{i}": written["w:w0"]}
        pipe.hset(keys["want"], mapping=fields)
    await pipe.execute()
    return keys


def _parts(reply: Any) -> int:
    """Fields and values of the cap's state in an acquire.lua reply (the parts of both
    hashes: the rows it read)."""
    ((_, *state),) = reply[4]
    return sum(len(x) for x in state if isinstance(x, list))


def _want_whole(reply: Any) -> bool:
    """Whether an acquire.lua reply hands the cap's want hash back whole (cursor "")."""
    ((_, _, _, _, cursor, *_),) = reply[4]
    return bool(cursor == WHOLE)


async def _truth(store: Any, keys: dict[str, str]) -> dict[str, CapDemand]:
    """The cap's clients as the whole of its hashes give them (HGETALL, read by the test)."""
    held = await store._client.hgetall(keys["held"])
    want = await store._client.hgetall(keys["want"])
    out: dict[str, CapDemand] = {}
    for name in [*held, *want]:
        if name[:2] in ("n:", "r:"):
            c = name[2:]
            terms = held if f"l:{c}" in held else want
            out[c] = CapDemand(int(held.get(f"n:{c}", 0)), int(want.get(f"r:{c}", 0)),
                               float(terms[f"l:{c}"]), float(terms[f"w:{c}"]))  # fmt: skip
    return out


class TestAcquireCallsAtScale:
    """Redis-only: what one acquire.lua call does at a cap, as its refused clients grow
    100-fold."""

    async def _measure(self, store: Any, server: RedisProcess, tmp_path: Path, n: int
                       ) -> tuple[list[dict[str, int]], list[int], list[bool]]:  # fmt: skip
        """The commands inside each of 8 acquires at a full cap with ``n`` clients refused
        in this demand period, the fields of the cap each handed back, and whether each
        handed the want hash back whole."""
        limiter = Limiter(load_text(tmp_path, CAP), store, FakeClock(T0))
        await _a_cap_of(n, store, limiter, cluster=False)
        recorded = _Recorded(store)
        commands = []
        for i in range(8):
            before = _stats(server)
            assert not await take(limiter, "w1", f"p{i}")
            commands.append(_inside(before, _stats(server)))
        replies = recorded.replies
        return commands, [_parts(r) for r in replies], [_want_whole(r) for r in replies]

    async def test_commands_and_rows_of_a_call_do_not_grow_with_the_clients(
        self, redis_store_factory: Any, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """At a full cap with 100 and with 10,000 clients refused in the last second (301 and
        30,001 fields in its want hash), each acquire runs the same commands inside the
        script (two reads of a hash), and hands back a part of the cap's state of a bounded
        size (the held hash whole, and want whole as a listpack at 100, one HSCAN step of
        COUNT STATE_CHUNK at 10,000), not the whole of it."""
        measured = []
        for n in (100, 10_000):
            store = await redis_store_factory(local_cache=0)
            try:
                measured.append(await self._measure(store, redis_server, tmp_path, n))
            finally:
                await store.close()
        (small, small_parts, small_whole), (large, large_parts, large_whole) = measured
        assert small == large
        # 301 fields: a listpack, read whole as before; 30,001: a hashtable, in steps
        assert all(small_whole) and not any(large_whole)
        # A hash Redis keeps as a listpack is read whole (up to its
        # hash-max-listpack-entries: 301 fields here); a larger one in steps of about COUNT
        # (a hint: a bucket may chain several fields; twice is room, not use).
        with redis_server.client() as client:
            name = "hash-max-listpack-entries"
            listpack = int(client.config_get(name)[name])
        bound = 2 * (3 * HOLDERS + max(listpack, 2 * STATE_CHUNK))
        assert max(small_parts) <= bound and max(large_parts) <= bound
        assert large[0]["read"] == 2


def test_the_scripts_step_is_the_views() -> None:
    """acquire.lua's CHUNK is the STATE_CHUNK the view and these tests reckon with."""
    from fairlimit.store.redis import script

    (line,) = [x for x in script.text("acquire").splitlines() if x.startswith("local CHUNK")]
    assert line.split("=")[1].split("--")[0].strip() == str(STATE_CHUNK)


class TestAViewAssembledOverCalls:
    """Redis-only: the cap a process assembles from the parts is the cap's state after at
    most two passes over it (docs/concurrency.md states the lag; memory reads its state)."""

    @pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
    async def test_the_view_is_the_whole_state_within_two_passes(
        self, backend: str, request: pytest.FixtureRequest, tmp_path: Path
    ) -> None:
        """With 1,000 clients refused (3,001 fields), the clients the view holds after
        2 x ceil(fields / STATE_CHUNK) + 2 acquires (two passes of HSCAN steps of at least
        COUNT fields, and the one under way) are the cap's, each as its hashes
        give it, on one Redis and on a Cluster."""
        factory = request.getfixturevalue(f"{backend.replace('-', '_')}_store_factory")
        store = await factory(local_cache=0)
        limiter = Limiter(load_text(tmp_path, CAP), store, FakeClock(T0))
        n = 1_000
        try:
            keys = await _a_cap_of(n, store, limiter, cluster=backend == "redis-cluster")
            fields = 3 * n + 1
            calls = 2 * math.ceil(fields / STATE_CHUNK) + 2
            for i in range(calls):
                assert not await take(limiter, "w1", f"p{i}")
            view = store._slots._caps[_cap_pool(limiter._active.matcher, "w1").key]
            truth = await _truth(store, keys)
        finally:
            await store.close()
        assert len(truth) == n + HOLDERS
        assert view.clients == truth

    async def test_two_replicas_each_assemble_the_whole_state(
        self, redis_store_factory: Any, tmp_path: Path
    ) -> None:
        """Two stores on one Redis (two replicas), taking turns at the cap of 1,000 refused:
        each one's view, read from its own cursor, is the cap's state within two passes of
        its own calls."""
        stores = [await redis_store_factory(local_cache=0) for _ in range(2)]
        loaded = load_text(tmp_path, CAP)
        limiters = [Limiter(loaded, s, FakeClock(T0)) for s in stores]
        n = 1_000
        try:
            keys = await _a_cap_of(n, stores[0], limiters[0], cluster=False)
            calls = 2 * math.ceil((3 * n + 1) / STATE_CHUNK) + 2
            for i in range(calls):
                for j, limiter in enumerate(limiters):
                    assert not await take(limiter, "w1", f"p{i}-{j}")
            key = _cap_pool(limiters[0]._active.matcher, "w1").key
            views = [s._slots._caps[key].clients for s in stores]
            truth = await _truth(stores[0], keys)
        finally:
            for s in stores:
                await s.close()
        assert len(truth) == n + HOLDERS
        # the first replica's view of w1 is of before the second one's last refusal
        assert views[0]["w1"].refused == truth["w1"].refused - 1
        assert views == [truth | {"w1": views[0]["w1"]}, truth]

    async def test_many_holders_are_read_in_steps_too(
        self, redis_store_factory: Any, tmp_path: Path
    ) -> None:
        """At a cap of 300 slots, 200 clients each holding one (601 fields in its held
        hash: a hashtable) and h0 four: after two passes of h0's refused acquires the
        view's holders are the cap's."""
        cap = CAP.replace(f"max_in_flight: {HOLDERS},", "max_in_flight: 300,")
        store = await redis_store_factory(local_cache=0)
        limiter = Limiter(load_text(tmp_path, cap), store, FakeClock(T0))
        pool = _cap_pool(limiter._active.matcher, "h0")
        keys = pool_keys("fairlimit:", pool, False)
        try:
            for i in range(200):
                assert await take(limiter, f"h{i}", f"r{i}")
            assert all([await take(limiter, "h0", f"more{j}") for j in range(3)])
            assert (await store._client.object("encoding", keys["held"])) == "hashtable"
            await store._client.pexpire(keys["want"], OUTLAST)
            calls = 2 * math.ceil(3 * 200 / STATE_CHUNK) + 2
            for i in range(calls):
                assert not await take(limiter, "h0", f"p{i}")  # its own 4 in flight
            view = store._slots._caps[pool.key]
            truth = await _truth(store, keys)
        finally:
            await store.close()
        assert len(truth) == 200 and truth["h0"] == CapDemand(4, calls, 4.0, 1.0)
        assert view.clients == truth


MANY = """
domain: edge
descriptors:
  - key: route
    value: public
    concurrency: {max_in_flight: 40, max_duration: 300}
    fair_share: {active_clients: 10, weights: {heavy: 2}}
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 4, max_duration: 300}
"""


class TestParityWithManyRefused:
    """Memory and Redis give the same answers at a cap with 600 clients refused (1,801
    fields in its want hash: read in parts), the bound worked out from the parts this
    process has read (tests/store/test_backend_parity.py draws at most five clients)."""

    @pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
    async def test_memory_and_redis_agree_with_many_refused(
        self, backend: str, request: pytest.FixtureRequest, tmp_path: Path
    ) -> None:
        """At one instant: h0..h9 fill the cap (4 each of 40), w0..w599 are refused, h0..h4
        give one back, then w0..w9, heavy, h0 and h5 ask; a demand period later (want given
        up on both: on the caller's clock in memory, by deleting the hash in Redis, whose
        want lives a second of Redis's own time) w0..w9 ask again. Every answer agrees."""
        factory = request.getfixturevalue(f"{backend.replace('-', '_')}_store_factory")
        stores = [MemoryStore(), await factory(local_cache=0)]
        clock = FakeClock(T0)
        limiters = [Limiter(load_text(tmp_path, MANY), s, clock) for s in stores]
        want = pool_keys("fairlimit:", _cap_pool(limiters[0]._active.matcher, "w0"),
                         backend == "redis-cluster")["want"]  # fmt: skip
        redis_client = stores[1]._client  # type: ignore[attr-defined]

        async def both(client: str, rid: str, release: bool = False) -> bool:
            answers = []
            for limiter in limiters:
                if release:
                    await done(limiter, client, rid)
                    answers.append(True)
                else:
                    answers.append(await take(limiter, client, rid))
            assert answers[0] == answers[1], (client, rid, answers)
            return answers[0]

        try:
            assert all([await both(f"h{i}", f"h{i}-{j}") for i in range(10) for j in range(4)])
            assert not await both("w0", "w0-0")
            await redis_client.pexpire(want, OUTLAST)  # a second of Redis's time: the test's
            assert not any([await both(f"w{i}", f"w{i}-0") for i in range(1, 600)])
            for i in range(5):
                await both(f"h{i}", f"h{i}-0", release=True)
            assert await redis_client.hlen(want) == 3 * 600 + 1
            after = [await both(c, f"{c}-1") for c in [*(f"w{i}" for i in range(10)),
                                                      "heavy", "h0", "h5"]]  # fmt: skip
            clock.advance(1.5)
            await redis_client.delete(want)
            later = [await both(f"w{i}", f"w{i}-2") for i in range(10)]
        finally:
            await stores[1].close()  # type: ignore[attr-defined]
        assert after == [False] * 13  # 600 refused: every client's bound is under one slot
        assert later == [True] * 5 + [False] * 5  # five slots free, none wanted by others
