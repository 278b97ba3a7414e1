"""Concurrency caps (issue 16) on every backend, with an injected clock: never more than N in
flight per client or at the cap, a refused acquire holds nothing, expiry reclaims, a release
without its acquire changes nothing, and all or nothing together with the rate limits."""

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from concurrency_calls import CAPPED, done, take, take_alone
from fairlimit.core.admission import Code
from fairlimit.core.concurrency import Claim, SlotOutcome, split
from fairlimit.core.matching import Matcher
from fairlimit.errors import StoreUnavailable
from fairlimit.limiter import Limiter
from fairlimit.settings import FailureMode
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, LimiterFactory, desc, load_text, req

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

# a concurrency cap with no limit of the clients' own: only their fair bound holds them
OPEN_CAP = """
domain: edge
descriptors:
  - key: route
    value: open
    concurrency: {max_in_flight: 3}
    fair_share: {active_clients: 3}
    descriptors:
      - key: client_id
"""


class TestLimits:
    async def test_no_client_holds_more_than_its_max(self, make_limiter: LimiterFactory) -> None:
        """4 per client: the fifth concurrent request is refused, a release lets one more in."""
        limiter = make_limiter(CAPPED)
        assert [await take(limiter, "a", f"r{i}") for i in range(5)] == [True] * 4 + [False]
        await done(limiter, "a", "r0")
        assert [await take(limiter, "a", f"s{i}") for i in range(2)] == [True, False]

    async def test_the_cap_is_never_exceeded(self, make_limiter: LimiterFactory) -> None:
        """Three clients at 4 each under a cap of 6: 6 admitted, each within its own 4."""
        limiter = make_limiter(CAPPED)
        got = {c: sum([await take(limiter, c, f"{c}{i}") for i in range(4)]) for c in "abc"}
        assert sum(got.values()) == 6
        assert all(n <= 4 for n in got.values())

    async def test_random_traffic_keeps_both_limits(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """Random acquires, releases (some of ids never admitted) and time: the slots the
        server admitted and not yet released or expired never pass 4 per client or 6."""
        limiter = make_limiter(CAPPED)
        rng = random.Random(16)
        held: dict[str, tuple[str, float]] = {}  # id -> (client, expiry)
        for step in range(160):
            held = {r: h for r, h in held.items() if h[1] > clock.now()}
            client, rid = rng.choice("abcd"), f"q{step}"
            roll = rng.random()
            if roll < 0.55:
                if await take(limiter, client, rid):
                    held[rid] = (client, clock.now() + 30)
            elif roll < 0.9:
                victim = rng.choice([*held, rid])  # sometimes an id never admitted
                await done(limiter, held.get(victim, (client, 0.0))[0], victim)
                held.pop(victim, None)
            else:
                clock.advance(rng.choice([0.5, 5.0, 31.0]))
            per_client = [c for c, _ in held.values()]
            assert len(held) <= 6
            assert all(per_client.count(c) <= 4 for c in "abcd")


class TestRefusalsAndReleases:
    async def test_a_refused_acquire_holds_nothing(self, make_limiter: LimiterFactory) -> None:
        """A refused request's own stream-done release frees nobody else's slot."""
        limiter = make_limiter(CAPPED)
        assert [await take(limiter, "a", f"r{i}") for i in range(5)] == [True] * 4 + [False]
        await done(limiter, "a", "r4")  # the refused request ends
        assert not await take(limiter, "a", "r5")

    async def test_release_without_acquire_changes_nothing(
        self, make_limiter: LimiterFactory
    ) -> None:
        """Releases of unknown ids, and a second release, leave the count as it was."""
        limiter = make_limiter(CAPPED)
        assert await take(limiter, "a", "r0")
        for rid in ("never", "r0", "r0", "other"):
            await done(limiter, "a", rid)
        assert [await take(limiter, "a", f"s{i}") for i in range(5)] == [True] * 4 + [False]

    async def test_a_duplicate_id_is_refused_and_takes_nothing(
        self, make_limiter: LimiterFactory
    ) -> None:
        """An id already in flight is refused; the first holder keeps its one slot."""
        limiter = make_limiter(CAPPED)
        assert await take(limiter, "a", "same")
        assert not await take(limiter, "a", "same")
        assert [await take(limiter, "a", f"s{i}") for i in range(4)] == [True] * 3 + [False]

    async def test_a_release_gives_back_its_slots_after_one_naming_no_pool(
        self, make_limiter: LimiterFactory
    ) -> None:
        """A stream-done call whose first descriptor names a pool nobody holds still gives
        back the slot its second descriptor names."""
        limiter = make_limiter(CAPPED)
        assert [await take_alone(limiter, "x", r) for r in ("r1", "r2")] == [True, True]
        release = req("edge", desc("client_id=ghost", "request_done=r1"),
                      desc("client_id=x", "request_done=r1"))  # fmt: skip
        assert (await limiter.should_rate_limit(release)).code is Code.OK
        assert await take_alone(limiter, "x", "r3")  # x's pool of 2 had room again

    async def test_expiry_reclaims_leaked_slots(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """Slots never released come back after max_duration; a late release is a no-op."""
        limiter = make_limiter(CAPPED)
        assert [await take(limiter, "a", f"r{i}") for i in range(5)] == [True] * 4 + [False]
        clock.advance(29.5)
        assert not await take(limiter, "a", "early")
        clock.advance(0.5)
        assert [await take(limiter, "a", f"s{i}") for i in range(5)] == [True] * 4 + [False]
        await done(limiter, "a", "r0")  # expired long ago: gives back nothing of s*
        assert not await take(limiter, "a", "t")


class TestSeveralPools:
    async def test_a_request_over_two_caps_takes_both_or_neither(
        self, make_limiter: LimiterFactory
    ) -> None:
        """One request claiming slots under two caps (two slots of a Cluster): when one cap
        refuses, the slot taken at the other is given back."""
        limiter = make_limiter(CAPPED)

        async def both(rid: str) -> bool:
            request = req(
                "edge",
                desc("route=public", "client_id=a", f"request_id={rid}"),
                desc("route=api", "client_id=b", f"request_id={rid}"),
            )
            return (await limiter.should_rate_limit(request)).code is Code.OK

        assert await take(limiter, "x", "x1", "api")
        assert await take(limiter, "y", "y1", "api")
        assert await take(limiter, "z", "z1", "api")  # the api cap (3) is full
        assert [await take(limiter, "a", f"a{i}") for i in range(3)] == [True] * 3
        assert not await both("r1")  # public has room for a, api has none for b
        assert await take(limiter, "a", "a3")  # a's fourth: r1 holds nothing at public
        assert not await take(limiter, "a", "a4")


class TestSeveralIdsInOnePool:
    """Two descriptors of one request with different ids reaching one pool take a slot each."""

    async def test_both_are_taken_when_both_fit_and_neither_when_one_does(
        self, make_limiter: LimiterFactory
    ) -> None:
        """2 in flight per client (3 a minute): with one slot held, two ids are refused and take
        nothing (no slot, no rate hit); once it is released both fit (the third rate hit)."""
        limiter = make_limiter(CAPPED)

        async def two(first: str, second: str) -> bool:
            request = req("edge", desc("client_id=x", f"request_id={first}"),
                          desc("client_id=x", f"request_id={second}"))  # fmt: skip
            return (await limiter.should_rate_limit(request)).code is Code.OK

        assert await take_alone(limiter, "x", "r1")
        assert not await two("c1", "c2")
        decision = await limiter.should_rate_limit(
            req("edge", desc("client_id=x", "request_done=r1"))
        )
        assert decision.code is Code.OK
        assert await two("b1", "b2")
        assert not await take_alone(limiter, "x", "b3")

    async def test_two_ids_at_a_cap_need_two_of_its_slots(
        self, make_limiter: LimiterFactory
    ) -> None:
        """a holds 3 and b 2 of 6: c's request with two ids is refused (7 > 6) and takes
        nothing, in its own new pool either (memory raised a KeyError there); one id fits."""
        limiter = make_limiter(CAPPED)
        assert all([await take(limiter, "a", f"a{i}") for i in range(3)])
        assert all([await take(limiter, "b", f"b{i}") for i in range(2)])
        request = req("edge", desc("route=public", "client_id=c", "request_id=c1"),
                      desc("route=public", "client_id=c", "request_id=c2"))  # fmt: skip
        assert (await limiter.should_rate_limit(request)).code is Code.OVER_LIMIT
        assert await take(limiter, "c", "c3")

    async def test_two_ids_need_two_of_a_clients_fair_slots(
        self, make_limiter: LimiterFactory
    ) -> None:
        """At a cap of 3 in flight (no limit per client), b filled it and a and c were
        refused: with two slots free again, a's fair bound is one of the three, so a request
        with two ids is refused; one id fits."""
        limiter = make_limiter(OPEN_CAP)
        assert all([await take(limiter, "b", f"b{i}", "open") for i in range(3)])
        assert not await take(limiter, "c", "c0", "open")
        assert not await take(limiter, "a", "a0", "open")
        for rid in ("b1", "b2"):
            await done(limiter, "b", rid, "open")
        request = req("edge", desc("route=open", "client_id=a", "request_id=a1"),
                      desc("route=open", "client_id=a", "request_id=a2"))  # fmt: skip
        assert (await limiter.should_rate_limit(request)).code is Code.OVER_LIMIT
        assert await take(limiter, "a", "a3", "open")


class TestAllOrNothingWithRates:
    async def test_a_concurrency_refusal_consumes_no_rate(
        self, make_limiter: LimiterFactory
    ) -> None:
        """3 per minute and 2 in flight: the refused third leaves the third rate hit free."""
        limiter = make_limiter(CAPPED)
        assert [await take_alone(limiter, "x", r) for r in ("a1", "a2", "a3")] == [
            True,
            True,
            False,
        ]
        decision = await limiter.should_rate_limit(
            req("edge", desc("client_id=x", "request_done=a1"))
        )
        assert decision.code is Code.OK
        assert await take_alone(limiter, "x", "a4")  # the rate's third hit
        assert not await take_alone(limiter, "x", "a5")

    async def test_a_rate_refusal_holds_no_slot(self, make_limiter: LimiterFactory) -> None:
        """Cap of 3 slots over 1 request per minute per client: x's refused second request
        leaves its slot free, so y and z both get one."""
        limiter = make_limiter(CAPPED)
        assert await take(limiter, "x", "r1", "api")
        assert not await take(limiter, "x", "r2", "api")  # over its rate
        assert await take(limiter, "y", "r3", "api")
        assert await take(limiter, "z", "r4", "api")
        assert not await take(limiter, "w", "r5", "api")  # the cap is full now


class TestFairShareOfTheCap:
    async def test_a_waiting_client_gets_the_next_free_slot(
        self, make_limiter: LimiterFactory
    ) -> None:
        """a holds 4 and b 2 of 6; c is refused. When a ends one, a may not take it back
        while c wants one (max-min fair: c 1, b 2, a 3), and c gets it."""
        limiter = make_limiter(CAPPED)
        assert all([await take(limiter, "a", f"a{i}") for i in range(4)])
        assert all([await take(limiter, "b", f"b{i}") for i in range(2)])
        assert not await take(limiter, "c", "c0")
        await done(limiter, "a", "a0")
        assert not await take(limiter, "a", "a9")
        assert await take(limiter, "c", "c1")


def _points(reader: InMemoryMetricReader) -> dict[tuple[str, str], float]:
    """(metric name, rule attribute) -> value, for the concurrency instruments."""
    out: dict[tuple[str, str], float] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name.startswith("fairlimit.concurrency."):
                    for point in metric.data.data_points:  # type: ignore[union-attr]
                        assert set(point.attributes or {}) == {"domain", "rule"}
                        rule = str((point.attributes or {})["rule"])
                        out[metric.name, rule] = point.value  # type: ignore[union-attr]
    return out


class TestTheMomentOfExpiry:
    async def test_a_release_when_its_slot_expires_is_late(
        self, store: Store, tmp_path: Path, clock: FakeClock
    ) -> None:  # the store's own calls, on every backend
        """A slot expires at its acquire plus max_duration exactly: a release just before
        gives it back, one at that moment gives nothing back (the slot has expired)."""
        matcher = Matcher(load_text(tmp_path, CAPPED).config)

        def claims(rid: str, done: bool = False) -> tuple[Claim, ...]:
            entries = ("route=public", "client_id=a", f"request_{'done' if done else 'id'}={rid}")
            slots = split(req("edge", desc(*entries)), matcher)
            return slots.release if done else slots.acquire

        start = clock.t
        for rid in ("r0", "r1"):
            assert (await store.acquire(claims(rid), start)).admitted
        assert await store.release(claims("r0", done=True), start + 29.999) == (True, True)
        assert await store.release(claims("r1", done=True), start + 30) == (False, False)


class TestMetrics:
    async def test_in_flight_rejections_and_expiry_per_rule(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """in_flight follows acquires, releases and expiry per pool rule (no client values);
        a release holding nothing moves nothing; refusals and expired slots are counted."""
        reader = InMemoryMetricReader()
        telemetry = Telemetry(MeterProvider(metric_readers=[reader]))
        limiter = make_limiter(CAPPED, telemetry=telemetry)
        cap, own = "edge/route=public", "edge/route=public/client_id"
        assert [await take(limiter, "a", f"r{i}") for i in range(5)] == [True] * 4 + [False]
        await done(limiter, "a", "r0")
        await done(limiter, "a", "never")
        await done(limiter, "stranger", "never")  # a client with no pool of its own at all
        got = _points(reader)
        assert got["fairlimit.concurrency.in_flight", cap] == 3
        assert got["fairlimit.concurrency.in_flight", own] == 3
        assert got["fairlimit.concurrency.rejected", own] == 1
        clock.advance(31)
        assert await take(limiter, "a", "late")
        got = _points(reader)
        assert got["fairlimit.concurrency.expired", own] == 3
        assert got["fairlimit.concurrency.in_flight", own] == 1


class _SlotsDown(MemoryStore):
    """Rates answer; the slot calls fail as a lost backend does."""

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        raise StoreUnavailable("slots down")

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        raise StoreUnavailable("slots down")


class TestBackendDown:
    """One store double for the failure path (the backends above are real)."""

    async def test_failure_mode_decides_when_slots_cannot_be_taken(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """open: the request goes on under its rates, the failure counted; closed: raised.
        A release that fails is left to expiry and never fails the call."""
        loaded = load_text(tmp_path, CAPPED)
        lenient = Limiter(loaded, _SlotsDown(), clock, failure_mode=FailureMode.OPEN)
        assert await take(lenient, "a", "r1")
        assert not lenient.backend_healthy
        await done(lenient, "a", "r1")
        strict = Limiter(loaded, _SlotsDown(), clock, failure_mode=FailureMode.CLOSED)
        with pytest.raises(StoreUnavailable):
            await take(strict, "a", "r1")


class TestReplicas:
    """Redis only: two replicas (two stores) over one Redis share every pool atomically."""

    @pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
    async def test_two_replicas_never_pass_the_limits_together(
        self, kind: str, request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
    ) -> None:
        """Alternating replicas: 4 per client and 6 at the cap in total, and a slot taken on
        one replica is released through the other."""
        factory = request.getfixturevalue(f"{kind.replace('-', '_')}_store_factory")
        first = await factory()
        second = await factory()  # the factory flushes only on creation: create both first
        loaded = load_text(tmp_path, CAPPED)
        replicas = [Limiter(loaded, store, clock) for store in (first, second)]
        try:
            got = [await take(replicas[i % 2], c, f"{c}{i}") for c in "abc" for i in range(4)]
            assert sum(got) == 6 and got[:4] == [True] * 4
            assert not await take(replicas[0], "d", "d0")
            await done(replicas[1], "a", "a0")  # taken through replicas[0]
            assert await take(replicas[0], "d", "d1")
        finally:
            await first.close()
            await second.close()


class TestReleasesArePairedByClient:
    async def test_a_client_cannot_free_another_clients_slot(
        self, make_limiter: LimiterFactory
    ) -> None:
        """At the shared cap (6 in flight), a holds 4 and b 2: b's stream-done call with a's
        request id frees nothing (before, it freed a's slot and a third client got in: 7 in
        flight at a cap of 6); a's own release of it frees it."""
        limiter = make_limiter(CAPPED)
        assert all([await take(limiter, "a", f"a{i}") for i in range(4)])
        assert all([await take(limiter, "b", f"b{i}") for i in range(2)])
        await done(limiter, "b", "a0")  # another client's id
        assert not await take(limiter, "c", "c0")  # the cap is still full
        await done(limiter, "a", "a0")
        assert await take(limiter, "c", "c1")
        assert not await take(limiter, "c", "c2")  # full again: a 3, b 2, c 1
