"""The RLQS use case (quota.py): streams, assignments, abandons, and counters shared with RLS."""

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from fairlimit.admin.rlqs import rlqs_report
from fairlimit.core.admission import Code
from fairlimit.core.bucket import bucket_key
from fairlimit.core.quota import HEADROOM, HEADROOM_FLOOR, Blanket, TokenBucket
from fairlimit.errors import StoreUnavailable
from fairlimit.limiter import Limiter
from fairlimit.quota import Abandon, Action, Assign, QuotaService, QuotaStream, Usage
from fairlimit.store.memory import MemoryStore
from helpers import ROOT, FakeClock, LimiterFactory, desc, load_text, req

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 50}
  - key: tenant
    value: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: health
    rate_limit: {unlimited: true}
"""

PER_MINUTE = """
domain: edge
descriptors:
  - key: route
    value: public
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 30}
"""

# a per-minute limit far above the reports: what RLS finds left is what the drip paid
MINUTE_LIMIT = """
domain: edge
descriptors:
  - key: route
    value: public
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 1000}
"""

# a bucket's own limit (the tier's) below a cap whose client level has none
TIERS = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        descriptors:
          - key: tier
            value: free
            rate_limit: {unit: second, requests_per_unit: 10}
          - key: tier
            rate_limit: {unit: second, requests_per_unit: 1000}
"""


def bucket(client: str) -> dict[str, str]:
    return {"client_id": client, "route": "public"}


class Envoy:
    """One stream's view: the last assignment per bucket, and every action received."""

    def __init__(self, service: QuotaService) -> None:
        self.actions: list[Action] = []
        self.service = service
        self.stream: QuotaStream = service.open(self.actions.extend)

    def latest(self, client: str) -> Assign | Abandon:
        wanted = bucket(client)
        return next(a for a in reversed(self.actions) if dict(a.bucket) == wanted)

    def rate(self, client: str) -> float:
        action = self.latest(client)
        assert isinstance(action, Assign) and isinstance(action.strategy, TokenBucket)
        return action.strategy.rate

    async def report(self, usage: Sequence[tuple[str, int, int]], domain: str = "edge") -> None:
        lines = [Usage(bucket(c), a, d) for c, a, d in usage]
        await self.service.report(self.stream, domain, lines)


@pytest.fixture
def limiter(make_limiter: LimiterFactory) -> Limiter:
    return make_limiter(CONFIG)


@pytest.fixture
def service(limiter: Limiter, clock: FakeClock) -> QuotaService:
    return QuotaService(lambda: limiter.loaded, limiter.store, clock.now, abandon_after=10)


async def steady(clock: FakeClock, envoys: Sequence[tuple[Envoy, list[tuple[str, int, int]]]],
                 rounds: int = 3, interval: float = 5.0) -> None:  # fmt: skip
    """Every Envoy reports the same usage each interval, ``rounds`` times."""
    for _ in range(rounds):
        clock.advance(interval)
        for envoy, usage in envoys:
            await envoy.report(usage)


class TestSharedCounters:
    async def test_usage_is_paid_over_the_next_interval(
        self, service: QuotaService, limiter: Limiter, clock: FakeClock
    ) -> None:
        """A report of 100 requests over a 5 s interval reaches the counters at 20/s: after
        one second of drips RLS finds 20 of alice's 50/s used, not 100."""
        envoy = Envoy(service)
        await envoy.report([("alice", 100, 0)])
        await service.drip()
        clock.advance(1.0)
        await service.drip()
        assert service.ledger.owed == pytest.approx(80)
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=alice"))
        )
        assert decision.code is Code.OK and decision.statuses[0].limit_remaining == 29

    async def test_reported_usage_is_charged_where_rls_looks(
        self, service: QuotaService, limiter: Limiter, clock: FakeClock
    ) -> None:
        """50 allowed requests reported over RLQS use up the client's 50/s for RLS too, once
        the drip has paid them."""
        envoy = Envoy(service)
        await envoy.report([("alice", 50, 0)])
        await service.drip()
        clock.advance(5.0)
        await service.drip()
        assert service.ledger.owed == 0
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=alice"))
        )
        assert decision.code is Code.OVER_LIMIT
        other = await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=bob")))
        assert other.code is Code.OK and other.statuses[0].limit_remaining == 49

    async def test_usage_past_a_limit_is_still_recorded(
        self, service: QuotaService, limiter: Limiter
    ) -> None:
        """Envoy let 80 through and its stream closed: the cap counter holds 80 at the next
        drip, so RLS admits 20 more, not 50."""
        envoy = Envoy(service)
        await envoy.report([("alice", 80, 0)])
        envoy.service.close(envoy.stream)
        await service.drip()
        passed = 0
        for _ in range(30):
            decision = await limiter.should_rate_limit(
                req("edge", desc("route=public", "client_id=bob"))
            )
            passed += decision.code is Code.OK
        assert passed == 20

    async def test_a_single_request_reported_is_paid(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """One allowed request, dripped at once (nothing due yet) and over the interval:
        it reaches the counter; a debt of one request is not taken for paid."""
        limiter = make_limiter(MINUTE_LIMIT)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        clock.t = 1_700_000_040.0  # a minute starts
        envoy = Envoy(service)
        await envoy.report([("alice", 1, 0)])
        await service.drip()
        for _ in range(10):
            clock.advance(0.5)
            await service.drip()
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=alice"))
        )
        assert decision.statuses[0].limit_remaining == 1000 - 2

    async def test_a_report_before_the_last_is_paid_pays_both_within_an_interval(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A report of 100 (5 s interval), and 2.5 s later, half of it still owed, another
        of 100: the 150 owed are paid over the next 5 s (30/s), all 200 in the counters by
        7.5 s, none left owed. Paid at the rate of the new report alone (20/s), 50 would
        trail every later report for good, and RLS would find a per-minute limit 50 short
        of what RLQS let through."""
        limiter = make_limiter(MINUTE_LIMIT)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        clock.t = 1_700_000_040.0  # a minute starts: the 7.5 s of payments in one window
        envoy = Envoy(service)
        await envoy.report([("alice", 100, 0)])
        await service.drip()
        reported, paid = 100, []
        for tick in range(1, 16):
            clock.advance(0.5)
            await service.drip()
            paid.append(reported - service.ledger.owed)
            if tick == 5:
                await envoy.report([("alice", 100, 0)])
                reported += 100
                assert service.ledger.owed == pytest.approx(150)
        assert paid == pytest.approx([10, 20, 30, 40, 50, 65, 80, 95, 110, 125, 140, 155, 170,
                                      185, 200])  # fmt: skip
        assert service.ledger.owed == 0 and not service.ledger._debts  # paid off: forgotten
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=alice"))
        )
        assert decision.code is Code.OK and decision.statuses[0].limit_remaining == 1000 - 201


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
class TestStoreDown:
    async def test_a_payment_the_store_refuses_is_logged_and_dropped(
        self, limiter: Limiter, clock: FakeClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The store unavailable at a drip: the assignments go on, the payment is lost to
        the counters (as RLS answers would be under --failure-mode open) with a warning
        that says so and why, and the next drip does not pay it twice."""

        class Down(MemoryStore):
            async def admit(self, plan: object, now: float) -> object:
                raise StoreUnavailable("redis: connection refused")

        service = QuotaService(lambda: limiter.loaded, Down(), clock.now)
        envoy = Envoy(service)
        await envoy.report([("alice", 50, 0)])
        envoy.service.close(envoy.stream)
        with caplog.at_level(logging.WARNING, logger="fairlimit"):
            await service.drip()
        assert [r.getMessage() for r in caplog.records] == [
            "RLQS usage not recorded: backend unavailable: redis: connection refused"
        ]
        assert service.ledger.owed == 0


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
class TestAssignments:
    async def test_first_report_gets_an_assignment_at_once(self, service: QuotaService) -> None:
        """A new bucket is assigned in the reply to its first report, with a TTL of >= 2 s."""
        envoy = Envoy(service)
        await envoy.report([("alice", 1, 0)])
        action = envoy.latest("alice")
        assert isinstance(action, Assign) and action.ttl >= 2
        assert envoy.rate("alice") == pytest.approx(50)  # unmeasured: offered its bound

    async def test_greedy_and_modest_converge_to_max_min(
        self, service: QuotaService, clock: FakeClock
    ) -> None:
        """Two Envoys; greedy asks 200/s, three modest 20/s: greedy is held to 100 - 60 = 40."""
        one, two = Envoy(service), Envoy(service)
        usage = [("greedy", 250, 250), *((f"m{i}", 50, 0) for i in range(3))]
        await steady(clock, [(one, usage), (two, usage)])
        greedy = one.rate("greedy") + two.rate("greedy")
        assert greedy == pytest.approx(40, abs=0.2)
        assert one.rate("m0") == pytest.approx(10 * (1 + HEADROOM) + HEADROOM_FLOOR, abs=0.1)
        assert service.allocation.levels["edge/route=public#1"] == pytest.approx(40)

    async def test_a_closed_stream_hands_its_share_back(
        self, service: QuotaService, clock: FakeClock
    ) -> None:
        """Three greedy clients over two Envoys get 100/3 each; when the Envoy of one of them
        goes, the other two are pushed their own limit of 50 at once."""
        one, two = Envoy(service), Envoy(service)
        await steady(clock, [(one, [("a", 300, 400)]), (two, [("b", 300, 400), ("c", 300, 400)])])
        assert two.rate("b") == pytest.approx(100 / 3, abs=0.2)
        one.service.close(one.stream)
        assert two.rate("b") == pytest.approx(50, abs=0.2)
        assert len(service.streams) == 1

    async def test_λ_moving_pushes_to_the_other_envoys(
        self, service: QuotaService, clock: FakeClock
    ) -> None:
        """A second client's demand on another Envoy shrinks the first one's bucket at once."""
        one, two = Envoy(service), Envoy(service)
        await steady(clock, [(one, [("a", 300, 400)])])
        assert one.rate("a") == pytest.approx(50, abs=0.2)
        await steady(clock, [(two, [("b", 500, 0)]), (one, [("a", 300, 400)])], rounds=2)
        assert two.rate("b") + one.rate("a") <= 100
        assert one.rate("a") == pytest.approx(50, abs=0.2)  # b asks 100/s, a 140/s: 50/50
        await steady(clock, [(two, [("b", 500, 0), ("c", 500, 0)])], rounds=2)
        assert one.rate("a") == pytest.approx(100 / 3, abs=0.2)

    @pytest.mark.parametrize("envoys", [1, 2])
    async def test_a_bucket_held_by_its_own_limit_leaves_the_cap_to_the_others(
        self, make_limiter: LimiterFactory, clock: FakeClock, envoys: int
    ) -> None:
        """At the 100/s cap, a's bucket (tier free: 10/s of its own, no client limit) asks
        80/s, b's 200/s, each from one Envoy or half from each of two: a is assigned its 10
        and b the other 90, not the 50 a max-min over a's unusable 80 would leave it."""
        limiter = make_limiter(TIERS)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        fleet = [Envoy(service) for _ in range(envoys)]
        usage = [("a", 50, 350), ("b", 450, 550)]  # 80/s and 200/s over 5 s
        tiers = {"a": "free", "b": "paid"}

        async def report() -> None:
            for envoy in fleet:
                lines = [Usage(bucket(c) | {"tier": tiers[c]}, a // envoys, d // envoys)
                         for c, a, d in usage]  # fmt: skip
                await envoy.service.report(envoy.stream, "edge", lines)

        await report()
        for _ in range(3):
            clock.advance(5.0)
            await report()
        rates = {"a": 0.0, "b": 0.0}
        for envoy in fleet:
            for client in rates:
                action = next(a for a in reversed(envoy.actions) if a.bucket["client_id"] == client)
                assert isinstance(action, Assign) and isinstance(action.strategy, TokenBucket)
                rates[client] += action.strategy.rate
        assert rates == {"a": pytest.approx(10, abs=0.2), "b": pytest.approx(90, abs=0.2)}
        assert service.allocation.levels["edge/route=public#1"] == pytest.approx(90)

    async def test_a_quiet_client_under_a_per_minute_limit_is_still_assigned(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """30/minute is 0.5/s, below the 1/s headroom floor: a measured demand of 0 is
        assigned the whole 0.5/s (five tokens a 10 s fill), not a failed division."""
        limiter = make_limiter(PER_MINUTE)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        envoy = Envoy(service)
        await envoy.report([("alice", 0, 0)])
        await steady(clock, [(envoy, [("alice", 0, 0)])], rounds=1)
        assert envoy.stream.buckets[bucket_key(bucket("alice"))].demand == 0
        assert envoy.latest("alice").strategy == TokenBucket(2, 5, 10)  # type: ignore[union-attr]

    async def test_idle_buckets_are_abandoned(
        self, service: QuotaService, clock: FakeClock
    ) -> None:
        """A bucket reported with no requests for abandon_after seconds gets an AbandonAction."""
        envoy = Envoy(service)
        await envoy.report([("alice", 1, 0)])
        for _ in range(25):
            clock.advance(0.5)
            await envoy.report([("alice", 0, 0)])
            if isinstance(envoy.latest("alice"), Abandon):
                break
        assert isinstance(envoy.latest("alice"), Abandon)
        assert envoy.stream.buckets == {}

    async def test_blanket_rules_for_unlimited_blocked_and_unknown(
        self, service: QuotaService
    ) -> None:
        """unlimited -> ALLOW_ALL; a zero limit -> DENY_ALL; no matching rule -> ALLOW_ALL."""
        envoy = Envoy(service)
        buckets = [{"health": "x"}, {"tenant": "blocked"}, {"nothing": "here"}]
        await envoy.service.report(envoy.stream, "edge", [Usage(b, 1, 0) for b in buckets])
        got = {tuple(a.bucket.items()): a.strategy for a in envoy.actions if isinstance(a, Assign)}
        assert got == {
            (("health", "x"),): Blanket.ALLOW_ALL,
            (("tenant", "blocked"),): Blanket.DENY_ALL,
            (("nothing", "here"),): Blanket.ALLOW_ALL,
        }

    async def test_shadow_mode_allows_all_and_still_records(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Under --shadow every bucket is ALLOW_ALL, and the usage still reaches the counters."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now, shadow=True)
        envoy = Envoy(service)
        await envoy.report([("alice", 50, 0)])
        envoy.service.close(envoy.stream)
        await service.drip()
        assert envoy.latest("alice").strategy is Blanket.ALLOW_ALL  # type: ignore[union-attr]
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=alice"))
        )
        assert decision.code is Code.OVER_LIMIT

    async def test_ttl_follows_the_reporting_interval(
        self, service: QuotaService, clock: FakeClock
    ) -> None:
        """Envoy 1.40 reports every 5 s: assignments live 15 s. A stream measured (eight
        spacings) to report every 2 s gets 6 s."""
        envoy = Envoy(service)
        await steady(clock, [(envoy, [("alice", 10, 0)])], rounds=2, interval=2.0)
        assert envoy.latest("alice").ttl == 15  # type: ignore[union-attr]
        await steady(clock, [(envoy, [("alice", 10, 0)])], rounds=7, interval=2.0)
        assert envoy.latest("alice").ttl == 6  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
class TestDivisionGap:
    async def test_a_burst_of_new_buckets_costs_one_division(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """With divide_gap, 200 clients subscribing at once get provisional assignments
        (their bound under the levels in force) and one division; the next drip divides."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now, divide_gap=0.2)
        envoy = Envoy(service)
        for i in range(200):
            await envoy.report([(f"c{i}", 1, 0)])
        assert service.divisions == 1
        assert envoy.rate("c0") == pytest.approx(50)  # the first: divided alone
        assert envoy.rate("c199") == pytest.approx(50)  # provisional: the cap's capacity
        clock.advance(0.2)
        await service.drip()
        assert service.divisions == 2
        assert envoy.rate("c199") == pytest.approx(0.5)  # 100/s over 200 unmeasured clients

    async def test_a_closed_stream_is_divided_at_the_next_drip(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """A stream closing within the gap is divided at the next drip, not at once."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now, divide_gap=0.2)
        one, two = Envoy(service), Envoy(service)
        await one.report([("a", 1, 0)])
        clock.advance(0.2)
        await two.report([("b", 1, 0)])
        assert one.rate("a") == pytest.approx(50)
        two.service.close(two.stream)
        assert service.divisions == 2
        clock.advance(0.2)
        await service.drip()
        assert service.divisions == 3

    async def test_a_new_bucket_on_a_second_stream_is_split_between_its_holders(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Within the gap a bucket one stream holds already is subscribed by another: its
        provisional assignment is its bound (alice's 50/s) split between the two, 25/s."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now, divide_gap=0.2)
        one, two = Envoy(service), Envoy(service)
        await one.report([("alice", 1, 0)])
        await two.report([("alice", 1, 0)])
        assert service.divisions == 1
        assert two.rate("alice") == pytest.approx(25)

    async def test_a_known_bucket_reporting_within_the_gap_keeps_its_assignment(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """alice measured at 10/s beside three greedy clients (the cap contended: her bound
        is 30/s) is assigned 10 plus headroom; a report within the gap renews that
        assignment, not her bound."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now, divide_gap=0.2)
        envoy = Envoy(service)
        greedy = [(name, 0, 500) for name in ("bob", "carol", "dave")]
        await steady(clock, [(envoy, [("alice", 50, 0), *greedy])])
        assigned = envoy.rate("alice")
        assert assigned == pytest.approx(10 * (1 + HEADROOM) + HEADROOM_FLOOR, abs=0.1)
        divisions = service.divisions
        clock.advance(0.1)
        await envoy.report([("alice", 5, 0)])
        assert service.divisions == divisions
        assert envoy.rate("alice") == assigned

    async def test_an_abandoned_bucket_does_not_hide_the_next_ones(
        self, clock: FakeClock, limiter: Limiter
    ) -> None:
        """One report within the gap abandons x (idle for abandon_after) and subscribes y:
        x is abandoned and y still gets its provisional assignment."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now,
                               abandon_after=10, divide_gap=0.2)  # fmt: skip
        envoy = Envoy(service)
        await envoy.report([("x", 1, 0)])
        clock.advance(9.95)
        await envoy.report([("x", 0, 0)])
        clock.advance(0.1)
        await envoy.report([("x", 0, 0), ("y", 1, 0)])
        assert isinstance(envoy.latest("x"), Abandon)
        assert envoy.rate("y") == pytest.approx(50)

    async def test_a_stream_closed_twice_is_closed_once(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now, divide_gap=0.2)
        envoy = Envoy(service)
        await envoy.report([("alice", 1, 0)])
        envoy.service.close(envoy.stream)
        envoy.service.close(envoy.stream)
        assert service.streams == {}


TWO_CAPS = """
domain: edge
descriptors:
  - key: route
    value: a
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 60}
  - key: route
    value: b
    rate_limit: {unit: second, requests_per_unit: 80}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 50}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 30}
"""


class TestIncrementalDivision:
    async def test_a_report_re_divides_only_its_regions_and_agrees_with_a_full_division(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """Three Envoys report random usage of buckets under two caps and under none, one
        at a time: after each division the assignments in force are those a division of
        everything from scratch gives, and a report under cap a alone sends the other
        Envoys nothing about cap b."""
        import random

        from fairlimit.core.quota import allocate
        from fairlimit.quota.service import Holder

        limiter = make_limiter(TWO_CAPS)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        sent: list[list[Action]] = [[], [], []]
        streams = [service.open(sent[i].extend) for i in range(3)]
        rnd = random.Random(7)
        buckets = [{"route": r, "client_id": f"{r}{i}"} for r in "ab" for i in range(4)]
        buckets += [{"tenant": f"t{i}"} for i in range(2)]
        for step in range(40):
            clock.advance(1.7)
            stream = streams[step % 3]
            chosen = rnd.sample(buckets, rnd.randint(1, 4))
            usages = [Usage(b, rnd.randint(0, 400), rnd.randint(0, 100)) for b in chosen]
            for box in sent:
                box.clear()
            await service.report(stream, "edge", usages)
            routes = {b.get("route") for b in chosen}
            if routes == {"a"}:  # the others hear nothing of cap b
                for i, box in enumerate(sent):
                    if i != step % 3:
                        assert all(dict(a.bucket).get("route") != "b" for a in box), box
            holders = [
                Holder(s.ident, key, b.target, b.demand, s.interval)
                for s in service.streams.values()
                for key, b in s.buckets.items()
            ]
            full = allocate(holders).strategies
            for s in service.streams.values():
                for key in s.buckets:
                    assert service.allocation.strategies[(s.ident, key)] == full[(s.ident, key)]
        assert service.divisions == 40


def held_counts(service: QuotaService) -> dict[str, int]:
    """How many entries each structure that names a stream's bucket holds."""
    streams = set(service.streams)
    return {
        "subscriptions": sum(len(s.buckets) for s in service.streams.values()),
        "held": service.held,
        "strategies": len(service.allocation.strategies),
        "extra": len(service.allocation.extra),
        # holders of other processes have negative ids
        "closed in the allocation": sum(
            i > 0 and i not in streams for i, _ in service.allocation.strategies
        ),
        "debts": len(service.ledger._debts),
        "remote targets": len(service.remote.targets),
    }


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
class TestBucketCaps:
    async def test_new_buckets_past_the_caps_are_refused_and_the_rest_kept(
        self, limiter: Limiter, clock: FakeClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Caps of 3 buckets a stream and 5 a process: the first Envoy's report of 5 new
        buckets has its first 3 tracked; the other 2 are not, and are sent a new bucket's
        assignment (their own limit, 50/s: the cap of 100/s not divided yet), first in the
        response; the second Envoy has 2 of its 4 tracked (the process's room), the others
        sent their share at the level then in force; each
        refusal is logged once per stream, naming the cap's flag, however many reports
        repeat it, and each report renews every assignment."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now,
                               max_buckets_per_stream=3, max_buckets=5)  # fmt: skip
        one, two = Envoy(service), Envoy(service)
        mine = [f"a{i}" for i in range(5)]
        await one.report([(c, 1, 0) for c in mine])
        assert [a.bucket["client_id"] for a in one.actions][:2] == ["a3", "a4"]
        assert {a.bucket["client_id"] for a in one.actions} == set(mine)
        assert one.rate("a3") == one.rate("a4") == pytest.approx(50)
        assert len(one.stream.buckets) == 3 and one.stream.refused == 2
        await two.report([(f"b{i}", 1, 0) for i in range(4)])
        assert {a.bucket["client_id"] for a in two.actions} == {"b0", "b1", "b2", "b3"}
        assert service.held == 5 and two.stream.refused == 2
        # the level the first report's division found (three buckets, unmeasured, each
        # wanting its 50/s of the 100/s cap): 33.3/s, a newcomer's share
        assert two.rate("b3") == pytest.approx(33.3)
        for _ in range(3):  # periodic reports: the held buckets and the others renewed
            clock.advance(5.0)
            one.actions.clear()
            await one.report([(c, 1, 0) for c in mine])
            assert {a.bucket["client_id"] for a in one.actions} == set(mine)
            assert all(isinstance(a, Assign) for a in one.actions)
            # its share under the levels the divisions found (a newcomer's bound), at most
            # its own 50/s: never unlimited
            assert 0 < one.rate("a4") <= 50
            assert len(one.stream.buckets) == 3
        told = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(told) == 2, told
        assert "stream 1" in told[0] and "--rlqs-max-buckets-per-stream" in told[0]
        assert "stream 2" in told[1] and "(--rlqs-max-buckets)" in told[1]

    async def test_a_refused_bucket_is_taken_once_there_is_room(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """A process full with one Envoy's buckets: another's new bucket is refused (not
        tracked, sent its own limit) until the first Envoy's stream closes; reported again
        then, it is tracked."""
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now,
                               max_buckets=2)  # fmt: skip
        one, two = Envoy(service), Envoy(service)
        await one.report([("a0", 1, 0), ("a1", 1, 0)])
        await two.report([("b0", 1, 0)])
        assert two.rate("b0") == pytest.approx(50) and two.stream.refused == 1
        assert not two.stream.buckets
        one.service.close(one.stream)
        clock.advance(5.0)
        await two.report([("b0", 1, 0)])
        assert two.rate("b0") == pytest.approx(50) and two.stream.refused == 0
        assert len(two.stream.buckets) == 1

    async def test_a_refused_bucket_is_counted_in_the_metric(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """fairlimit.rlqs.refused_buckets counts each report's refused new buckets by cap."""
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from fairlimit.telemetry.quota import QuotaTelemetry

        reader = InMemoryMetricReader()
        telemetry = QuotaTelemetry(MeterProvider(metric_readers=[reader]))
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now,
                               telemetry=telemetry, max_buckets_per_stream=1)  # fmt: skip
        envoy = Envoy(service)
        await envoy.report([("a", 1, 0), ("b", 1, 0), ("c", 1, 0)])
        clock.advance(5.0)
        await envoy.report([("a", 1, 0), ("b", 1, 0), ("c", 1, 0)])
        data = reader.get_metrics_data()
        assert data is not None
        points = [
            (dict(p.attributes or {}), p.value)
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == "fairlimit.rlqs.refused_buckets"
            for p in m.data.data_points  # type: ignore[union-attr]
        ]
        assert points == [({"domain": "edge", "cap": "stream"}, 4)]


# one cap of 100000/s over clients of 50/s: room for a thousand buckets and more
CAPPED_MANY = (ROOT / "descriptors" / "rlqs" / "many-clients.yaml").read_text()


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
class TestChunkedReports:
    async def test_the_loop_turns_while_a_big_report_is_taken(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A report of 1,000 new buckets yields to the event loop between its chunks and the
        steps of its division: a task beside it runs meanwhile (it ran only after the whole
        report before), and the assignments are those of a division from scratch."""
        from fairlimit.core.quota import allocate
        from fairlimit.quota.service import CHUNK, Holder

        limiter = make_limiter(CAPPED_MANY)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        envoy = Envoy(service)
        turns = 0
        done = False

        async def beside() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(beside())
        await asyncio.sleep(0)
        before = turns
        await envoy.report([(f"c{i}", 1, 0) for i in range(1000)])
        during = turns - before
        done = True
        await task
        assert during >= 1000 // CHUNK
        assert len(envoy.actions) == 1000
        holders = [Holder(envoy.stream.ident, key, b.target, b.demand, envoy.stream.interval)
                   for key, b in envoy.stream.buckets.items()]  # fmt: skip
        assert service.allocation.strategies == allocate(holders).strategies

    @pytest.mark.parametrize("turns", [0, 1, 2, 3, 5, 8, 13, 30])
    async def test_a_stream_closing_in_the_middle_leaves_nothing(
        self, make_limiter: LimiterFactory, clock: FakeClock, turns: int
    ) -> None:
        """One Envoy's report of 600 new buckets is under way (taken in chunks, then
        divided in steps) when another Envoy's stream and then its own close, after any
        number of turns of the loop: nothing of either is left (the report takes no more
        lines, a division in steps stops), and the third Envoy's assignments are those of
        a division from scratch."""
        from fairlimit.core.quota import allocate
        from fairlimit.quota.service import Holder

        limiter = make_limiter(CAPPED_MANY)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        big, other, third = Envoy(service), Envoy(service), Envoy(service)
        await other.report([(f"o{i}", 5, 0) for i in range(50)])
        await third.report([(f"t{i}", 5, 0) for i in range(50)])
        clock.advance(1.0)
        task = asyncio.create_task(big.report([(f"b{i}", 5, 0) for i in range(600)]))
        for _ in range(turns):
            await asyncio.sleep(0)
        other.service.close(other.stream)
        for _ in range(turns):
            await asyncio.sleep(0)
        big.service.close(big.stream)
        await task
        clock.advance(5.0)
        await service.drip()
        counts = held_counts(service)
        assert counts["subscriptions"] == counts["held"] == 50
        assert counts["closed in the allocation"] == 0
        assert counts["strategies"] == 50 and counts["debts"] <= 50
        s = third.stream
        holders = [Holder(s.ident, key, b.target, b.demand, s.interval)
                   for key, b in s.buckets.items()]  # fmt: skip
        assert service.allocation.strategies == allocate(holders).strategies
        assert {k: b.strategy for k, b in s.buckets.items()} == {
            key: service.allocation.strategies[(s.ident, key)] for key in s.buckets
        }


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
class TestMemoryOnClose:
    async def test_a_closed_streams_buckets_leave_every_structure(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """Two Envoys with 300 buckets each (usage owed, assignments, extra headroom): when
        one closes, within the division gap as the server runs, its buckets go from the
        stream and its entries from the allocation at once (they stayed until the next
        division), and from the usage ledger at the next drip; when both have, every count
        is back to zero, /rlconfig lists no stream and the gauges no bucket."""
        limiter = make_limiter(CAPPED_MANY)
        service = QuotaService(lambda: limiter.loaded, limiter.store, clock.now,
                               divide_gap=0.2)  # fmt: skip
        one, two = Envoy(service), Envoy(service)
        for _ in range(3):
            clock.advance(5.0)
            await one.report([(f"a{i}", 20, 0) for i in range(300)])
            await two.report([(f"b{i}", 20, 0) for i in range(300)])
        counts = held_counts(service)
        assert counts["held"] == counts["strategies"] == 600
        assert counts["extra"] == counts["debts"] == 600
        one.service.close(one.stream)
        assert one.stream.buckets == {}
        counts = held_counts(service)
        assert counts["held"] == counts["strategies"] == counts["extra"] == 300
        assert counts["closed in the allocation"] == 0
        clock.advance(1.0)
        await service.drip()
        assert held_counts(service)["debts"] == 300
        two.service.close(two.stream)
        clock.advance(1.0)
        await service.drip()
        assert set(held_counts(service).values()) == {0}
        assert rlqs_report(service)["streams"] == [] and rlqs_report(service)["caps"] == {}
        assert dict(service.telemetry.figures.buckets) == {}


class TestRemoteTargets:
    async def test_a_peers_gone_buckets_leave_the_remote_targets(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """Process A's Envoy holds 200 buckets; process B, on the same store, maps them
        to targets to divide with them; once A's stream has closed and A has handed in its
        empty report, B forgets their targets."""
        from fairlimit.quota import peers
        from fairlimit.store.memory import MemoryStore

        store = MemoryStore()
        a = QuotaService(lambda: loaded, store, clock.now, consumer="a")
        b = QuotaService(lambda: loaded, store, clock.now, consumer="b")
        loaded = load_text(tmp_path, CAPPED_MANY)
        envoy_a, envoy_b = Envoy(a), Envoy(b)
        await envoy_a.report([(f"a{i}", 20, 0) for i in range(200)])
        await envoy_b.report([("b0", 20, 0)])
        for _ in range(2):
            clock.advance(peers.EXCHANGE_SECONDS)
            await a.drip()
            await b.drip()
        clock.advance(5.0)
        await envoy_b.report([("b0", 20, 0)])  # divided with A's buckets
        assert held_counts(b)["remote targets"] >= 200
        envoy_a.service.close(envoy_a.stream)
        for _ in range(2):
            clock.advance(peers.EXCHANGE_SECONDS)
            await a.drip()
            await b.drip()
        assert held_counts(b)["remote targets"] == 0
        counts = {name: count for name, count in held_counts(a).items() if count}
        # B's bucket, alive, divided here as a remote holder's (assigned nothing here, so
        # nothing of it is kept in the allocation)
        assert counts == {"remote targets": 1}
