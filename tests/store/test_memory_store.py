"""Memory-store specifics: bounded state (Redis bounds its keys with TTLs, in test_redis),
the exact fair split of a concurrency cap at each call, and glibc's malloc kept giving
memory back (its mmap threshold)."""

import asyncio
import ctypes
import gc
import math
import sys
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import pytest

from concurrency_calls import CAPPED, done, take, take_alone
from fairlimit.core.admission import Code
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan
from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from fairlimit.store.reservations import MemoryReservations
from fairlimit.store.sweep import EXPIRE_STEP, _glibc
from fairness_cases import flat_config
from helpers import FakeClock, desc, load_text, req, skip_or_fail
from maxmin import Number, level

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
        await store.swept()  # the call took one step; the background sweep the rest
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


# --- concurrency pools (store/slots.py) -----------------------------------------------------


def _limiter(tmp_path: Path, clock: FakeClock) -> tuple[Limiter, MemoryStore]:
    store = MemoryStore()
    return Limiter(load_text(tmp_path, CAPPED), store, clock), store  # type: ignore[arg-type]


def bound(wants: dict[str, int], client: str) -> Number:
    """``client``'s fair bound at CAPPED's public cap (6 slots, 4 per client, heavy weighs 2)
    by the independent solver: ``min(L, λ·w)`` with λ from each client's slots held plus
    refused (the asking client's request included)."""
    weights = {name: 2 if name == "heavy" else 1 for name in wants}
    lam = level([min(d, 4) for d in wants.values()], list(weights.values()), 6)
    return min(4, lam * weights[client])


class TestLateCalls:
    """A call decided at a time of a window that a later call has already closed here (it
    waited, for a store that did not answer, while others went on)."""

    async def test_a_call_from_a_closed_window_never_restarts_the_next(
        self, tmp_path: Path
    ) -> None:
        """3 a second: 2 in the second, a late one from the second before, then 2 more: the
        late one counts in the running second, whose count goes on (3 admitted, not 5)."""
        config = """
        domain: edge
        descriptors:
          - key: user
            rate_limit: {unit: second, requests_per_unit: 3}
        """
        matcher = Matcher(load_text(tmp_path, config).config)
        charge = plan(req("edge", desc("user=a")), matcher)
        store, second = MemoryStore(), 1_700_000_001.0
        got = [(await store.admit(charge, second + 0.1)).admitted for _ in range(2)]
        got.append((await store.admit(charge, second - 0.2)).admitted)  # the late call
        got += [(await store.admit(charge, second + 0.3)).admitted for _ in range(2)]
        assert got == [True, True, True, False, False]


class TestSlotPools:
    async def test_a_pool_nobody_touches_is_dropped_when_its_slots_expire(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """Any later call reclaims a leaked pool from the instant its last slot expires."""
        limiter, store = _limiter(tmp_path, clock)
        assert await take_alone(limiter, "x", "r1")  # max_duration 10
        clock.advance(10)
        assert await take_alone(limiter, "y", "r2")
        assert len(store.slots) == 1  # y's pool only

    async def test_a_cap_holding_only_refusals_is_dropped_when_they_lapse(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """A cap whose slots all ended is kept while a refusal counts as demand (one second),
        and dropped by any call from then on."""
        limiter, store = _limiter(tmp_path, clock)
        ids = [(c, f"{c}{i}") for c, n in (("a", 4), ("b", 2)) for i in range(n)]
        assert all([await take(limiter, c, rid) for c, rid in ids])
        assert not await take(limiter, "c", "c0")  # the cap is full
        for c, rid in ids:
            await done(limiter, c, rid)
        assert len(store.slots) == 1  # the cap, for c's refusal
        clock.advance(1)
        await done(limiter, "z", "never")
        assert len(store.slots) == 0


class TestFairSplitOfACap:
    """The exact split at each call, by tests/support/maxmin.py. Memory only: Redis splits by
    the cap's state its previous acquire returned, and its refusals lapse by Redis's own clock."""

    async def test_slots_held_count_once(self, tmp_path: Path, clock: FakeClock) -> None:
        """a holds 2, b 3: b's fourth fits (2 + 4 = 6, λ = inf)."""
        limiter, _ = _limiter(tmp_path, clock)
        assert all([await take(limiter, c, f"{c}{i}") for c, n in (("a", 2), ("b", 3))
                    for i in range(n)])  # fmt: skip
        assert bound({"a": 2, "b": 4}, "b") == 4
        assert await take(limiter, "b", "b3")

    async def test_an_ended_slot_no_longer_counts(self, tmp_path: Path, clock: FakeClock) -> None:
        """a took 3 and ended one, b took 3: b's fourth fits (2 + 4 = 6, λ = inf)."""
        limiter, _ = _limiter(tmp_path, clock)
        assert all([await take(limiter, c, f"{c}{i}") for c in "ab" for i in range(3)])
        await done(limiter, "a", "a2")
        assert bound({"a": 2, "b": 4}, "b") == 4
        assert await take(limiter, "b", "b3")

    async def test_each_refusal_adds_one_to_demand(self, tmp_path: Path, clock: FakeClock) -> None:
        """a, holding nothing, refused twice wants 2: b may take its fourth (2 + 4 = 6)."""
        limiter, _ = _limiter(tmp_path, clock)
        ids = [(c, f"{c}{i}") for c, n in (("b", 4), ("c", 2)) for i in range(n)]
        assert all([await take(limiter, c, rid) for c, rid in ids])
        assert [await take(limiter, "a", rid) for rid in ("a0", "a1")] == [False, False]
        for c, rid in (("c", "c0"), ("c", "c1"), ("b", "b0")):
            await done(limiter, c, rid)
        assert bound({"a": 2, "b": 4}, "b") == 4
        assert await take(limiter, "b", "b4")

    async def test_a_holder_refused_wants_its_slots_and_its_refusals(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """a holding 1 and refused twice wants 3: b's fourth waits (λ = 3), a's second fits."""
        limiter, _ = _limiter(tmp_path, clock)
        ids = [(c, f"{c}{i}") for c, n in (("b", 4), ("a", 2)) for i in range(n)]
        assert all([await take(limiter, c, rid) for c, rid in ids])
        assert [await take(limiter, "a", rid) for rid in ("a2", "a3")] == [False, False]
        await done(limiter, "a", "a0")
        await done(limiter, "b", "b0")
        assert bound({"a": 3, "b": 4}, "b") == 3
        assert not await take(limiter, "b", "b4")
        assert bound({"a": 4, "b": 4}, "a") == 3  # b's refusal counts too
        assert await take(limiter, "a", "a4")

    async def test_a_newcomer_may_take_up_to_its_share_and_no_more(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """heavy (weight 2) holds 2 and was refused twice, x holds 2: c's bound is 5/3, so
        two ids of c are refused and one fits (its refusal lowers λ to 3/2)."""
        limiter, _ = _limiter(tmp_path, clock)
        ids = [(c, f"{c}{i}") for c, n in (("heavy", 4), ("x", 2)) for i in range(n)]
        assert all([await take(limiter, c, rid) for c, rid in ids])
        assert [await take(limiter, "heavy", r) for r in ("h4", "h5")] == [False, False]
        await done(limiter, "heavy", "heavy0")
        await done(limiter, "heavy", "heavy1")
        assert bound({"c": 1, "heavy": 4, "x": 2}, "c") == Fraction(5, 3)
        request = req("edge", desc("route=public", "client_id=c", "request_id=c1"),
                      desc("route=public", "client_id=c", "request_id=c2"))  # fmt: skip
        assert (await limiter.should_rate_limit(request)).code is Code.OVER_LIMIT
        assert bound({"c": 2, "heavy": 4, "x": 2}, "c") == Fraction(3, 2)
        assert await take(limiter, "c", "c3")


class TestDemandPeriod:
    """Refusals count as demand for one second from the first one (memory only, as above)."""

    async def _full(self, tmp_path: Path, clock: FakeClock) -> Limiter:
        """x and y hold 3 each of the cap's 6."""
        limiter, _ = _limiter(tmp_path, clock)
        assert all([await take(limiter, c, f"{c}{i}") for c in "xy" for i in range(3)])
        return limiter

    async def test_refusals_lapse_exactly_one_second_after_the_first(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """a refused, y ends one: x's fourth waits for a (1 + 2 + 4 > 6); a second later
        nobody is refused any more and it fits (2 + 4 = 6)."""
        limiter = await self._full(tmp_path, clock)
        assert not await take(limiter, "a", "a0")
        await done(limiter, "y", "y0")
        assert bound({"a": 1, "y": 2, "x": 4}, "x") == 3
        assert not await take(limiter, "x", "x3")
        clock.advance(1)
        assert bound({"y": 2, "x": 4}, "x") == 4
        assert await take(limiter, "x", "x4")

    async def test_a_refusal_as_the_second_ends_counts_in_the_next(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """a refused again exactly a second after its first refusal still waits: x's fourth
        is refused after y ends one, and a takes that slot."""
        limiter = await self._full(tmp_path, clock)
        assert not await take(limiter, "a", "a0")
        clock.advance(1)
        assert not await take(limiter, "a", "a1")
        await done(limiter, "y", "y0")
        assert bound({"a": 1, "y": 2, "x": 4}, "x") == 3
        assert not await take(limiter, "x", "x3")
        assert bound({"a": 2, "y": 2, "x": 4}, "a") == 2
        assert await take(limiter, "a", "a2")


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

    async def test_a_shorter_window_made_after_a_longer_one_is_dropped_when_it_ends(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """A call looks at the store's tables only from the earliest instant something is
        due: a day's counter makes that the day's end, a minute's counter made after it
        brings it forward to the minute's."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, EXPIRY_CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 86_400.0 * 20_000  # the start of a day (and of a minute)
        await limiter.should_rate_limit(req("edge", desc("tick=x")))
        await limiter.should_rate_limit(req("edge", desc("user=a")))
        clock.advance(59.5)
        await limiter.should_rate_limit(req("edge", desc("tick=x")))
        assert len(store) == 2  # a's minute still runs
        clock.advance(0.5)
        await limiter.should_rate_limit(req("edge", desc("tick=x")))
        assert len(store) == 1  # the day's counter alone

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


RESERVED = """
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000}
    reservation: {default: 1, max_duration: 60}
"""


class TestGivingMemoryBack:
    """A full collection costs time in proportion to every object the process holds: the
    store runs one when a spike of counters is over, never request after request."""

    async def test_one_collection_after_a_spike_none_in_steady_state(
        self,
        tmp_path: pytest.TempPathFactory,
        clock: FakeClock,
        full_collections: Callable[[], int],
    ) -> None:
        """Steady traffic (a counter expiring among four live ones) runs none, nor do a
        few clients gone at once (a table that never held COMPACT_FLOOR is a few kilobytes:
        not worth a full collection); 2,000 counters expiring at once, leaving four, run
        one."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, EXPIRY_CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 86_400.0 * 19_675  # the start of a day
        for _ in range(3):  # a few clients a minute, then one: 6 of 7 counters gone
            for i in range(6):
                await limiter.should_rate_limit(req("edge", desc(f"user=few{i}")))
            clock.advance(60)
            await limiter.should_rate_limit(req("edge", desc("user=other")))
            await store.swept()
            clock.advance(60)
        for user in "abcd":
            await limiter.should_rate_limit(req("edge", desc(f"tick={user}")))
        await limiter.should_rate_limit(req("edge", desc("user=a")))
        clock.advance(60)
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("tick=a")))
        await store.swept()
        assert (len(store), full_collections()) == (4, 0)
        for i in range(2_000):
            await limiter.should_rate_limit(req("edge", desc(f"user=u{i}")))
        clock.advance(60)
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("tick=a")))
        assert full_collections() == 0  # not in a call: in the background
        await store.swept()
        assert (len(store), full_collections()) == (4, 1)

    async def test_a_call_expires_one_step_and_the_sweep_the_rest(
        self,
        tmp_path: pytest.TempPathFactory,
        clock: FakeClock,
        full_collections: Callable[[], int],
    ) -> None:
        """5,000 counters end at one instant: the call after drops EXPIRE_STEP of them at
        most and runs no collection; the background sweep drops the rest in steps, calls
        answered between them, then collects once."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, EXPIRY_CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 86_400.0 * 19_675
        for i in range(5_000):
            await limiter.should_rate_limit(req("edge", desc(f"user=u{i}")))
        clock.advance(60)
        await limiter.should_rate_limit(req("edge", desc("tick=a")))
        after_call = len(store)
        assert after_call >= 5_000 - EXPIRE_STEP and full_collections() == 0
        steps = 0
        while len(store) > 1 and steps < 100:  # each turn of the loop: one step at most
            before = len(store)
            await asyncio.sleep(0)
            assert before - len(store) <= EXPIRE_STEP
            steps += 1
        await store.swept()
        assert (len(store), full_collections()) == (1, 1)
        assert steps >= (5_000 - EXPIRE_STEP) // EXPIRE_STEP

    async def test_expired_reservations_go_in_steps_and_the_table_shrinks(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """3,000 reservations never settled: past their max_duration any call (one that
        reserves nothing here) drops a step of them, the sweep the rest, and the table is
        copied to its live size (it kept them all, and its size, until the next
        reservation or settlement came)."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, RESERVED), store, clock)  # type: ignore[arg-type]
        clock.t = 3_600.0 * 472_223  # the start of an hour
        for i in range(3_000):
            await limiter.should_rate_limit(req("edge", desc("user=a", f"request_id=r{i}")))
        full = sys.getsizeof(store.reservations._records)
        clock.advance(61)
        await limiter.should_rate_limit(req("edge", desc("user=b")))
        assert len(store.reservations) >= 3_000 - EXPIRE_STEP
        await store.swept()
        assert len(store.reservations) == 0
        assert sys.getsizeof(store.reservations._records) * 10 < full

    def test_a_reservation_past_its_time_is_gone_before_it_is_dropped(self) -> None:
        """Not yet swept, an expired record settles nothing and its id may reserve again."""
        table = MemoryReservations()
        assert table.keep("k", 5, 0.0, 10.0)
        assert not table.keep("k", 5, 1.0, 10.0)  # the first is kept
        assert table.settle("k", 10.0) is None and len(table) == 1  # expired, not swept
        assert table.keep("k", 7, 10.0, 10.0)
        record = table.settle("k", 11.0)
        assert record is not None and record.hits == 7
        assert table.expire(25.0, 1)  # one of its two deadlines: one more is due
        assert not table.expire(25.0, 1) and len(table) == 0


class _Mallinfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33+): the allocator's own statistics."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


@pytest.fixture
def glibc() -> ctypes.CDLL:
    """The C library; skip (fail under CI) where it is not glibc: the store leaves others be."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        skip_or_fail("not glibc 2.33 or later (mallinfo2)")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _spilled(libc: ctypes.CDLL, size: int) -> int:
    """How many blocks of ``size`` glibc maps, of more than the heap's free bytes hold, all
    held at once: the heap serves what it can, and past that its mmap threshold decides (a
    mapped block goes back to the system on free, a heap one seldom does)."""
    count = libc.mallinfo2().fordblks // size + 2  # the free bytes, the heap's top included
    before = libc.mallinfo2().hblks
    blocks = [libc.malloc(size) for _ in range(count)]
    mapped = libc.mallinfo2().hblks - before
    for block in blocks:
        libc.free(block)
    return int(mapped)


class TestMallocThreshold:
    """A spike of clients frees big mapped tables, which raises glibc's mmap threshold: the
    store keeps it at glibc's initial 128 KiB, so the next spike's tables are mapped too."""

    def test_big_blocks_stay_mapped_after_a_big_one_is_freed(self, glibc: ctypes.CDLL) -> None:
        """After a block bigger than the heap's free bytes (so mapped) is freed and a store
        made, blocks of 512 KiB the heap cannot serve are mapped: at least the two past it."""
        big = glibc.mallinfo2().fordblks + (1 << 20)
        glibc.free(glibc.malloc(big))  # glibc alone would raise its threshold to ``big``
        MemoryStore()
        assert _spilled(glibc, 512 << 10) >= 2

    def test_smaller_blocks_come_from_the_heap(self, glibc: ctypes.CDLL) -> None:
        """Blocks of 120 KiB, more than the heap has free, all come from the heap."""
        MemoryStore()
        assert _spilled(glibc, 120 << 10) == 0

    def test_a_function_the_c_library_lacks_is_none(self) -> None:
        """On another C library the glibc functions are missing: None, and no tuning."""
        assert _glibc("fairlimit_no_such_function") is None
        assert _glibc("malloc") is not None


class TestRowsOfAnEndedWindow:
    """Dropping rows whose history and window are both gone keeps every other row: a row of
    the current window however long silent, a recent row of the window just ended."""

    async def _asks(self, limiter: Limiter, client: str, times: int) -> int:
        """How many of ``times`` one-hit requests of ``client`` are admitted."""
        ok = 0
        for _ in range(times):
            out = await limiter.should_rate_limit(
                req("fair", desc("route=api", f"client_id={client}"))
            )
            ok += out.code is Code.OK
        return ok

    async def test_a_client_silent_past_64_s_keeps_what_it_took_this_window(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """y, seen once two hours ago, is dropped at 79 s; x, silent since 9 s, is kept: x
        and z each ask 400 a second, far more than their 1800 of the hour, so after the
        cap's first second (no history: x takes what it asks within its split) x is paced
        at its share of the elapsed hour; back at 80 s with its history gone it takes the
        rest of its 1800 at once, what it took at 0 s counted (a dropped row would start
        its share afresh)."""
        store = MemoryStore()
        limiter = Limiter(
            load_text(tmp_path, flat_config(3600, "hour", 3600, active=2)), store, clock
        )  # type: ignore[arg-type]
        hour = 3600.0 * 472_223
        clock.t = hour - 3610
        await self._asks(limiter, "y", 1)
        firsts = []
        for second in range(10):
            clock.t = hour + second
            firsts.append(await self._asks(limiter, "x", 400))
            await self._asks(limiter, "z", 400)
        assert level([4_000, 4_000], [1, 1], 3600) == 1800
        assert firsts[0] == 400 and sum(firsts[1:]) == 0  # 1800 x 10 / 3600 = 5 < 400
        for second in (50, 79):
            clock.t = hour + second
            await self._asks(limiter, "z", 50)
        rows = store.fair.table["fair/route=api#3600"].rows
        assert "y" not in rows and "x" in rows
        clock.t = hour + 80
        assert 1399 <= await self._asks(limiter, "x", 1500) <= 1401  # 1800 - 400

    async def test_a_client_busy_as_the_last_window_ended_keeps_its_rate(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """y, seen 125 s ago in the minute before last, is dropped at the minute's start; v
        and w, each asking 40 in the last second of the minute before, are kept and still
        press on a cap of 60 a minute: what they asked then predicts nearly 40 each (spread
        over that minute up to their last request), so the cap is contended at λ near 30."""
        store = MemoryStore()
        limiter = Limiter(
            load_text(tmp_path, flat_config(60, "minute", 60, active=2)), store, clock
        )  # type: ignore[arg-type]
        minute = 60.0 * 28_333_334
        clock.t = minute - 125  # in the minute before last: gone once its history is
        await self._asks(limiter, "y", 1)
        clock.t = minute - 1
        for client in "vw":
            await self._asks(limiter, client, 40)
        clock.t = minute
        await self._asks(limiter, "v", 1)
        clock.t = minute + 1
        await self._asks(limiter, "v", 1)
        assert level([10_000, 10_000], [1, 1], 60) == 30
        assert "y" not in store.fair.table["fair/route=api#60"].rows
        assert 29.0 <= (await store.caps())["fair/route=api#60"].level <= 31.0
