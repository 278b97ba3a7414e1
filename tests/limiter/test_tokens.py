"""Token budgets (core/reserve.py): an estimate reserved on the request path by request id,
settled at stream end by the real cost or given back by Envoy's negative hits. On every
backend (memory, Redis, Redis Cluster), with an injected clock."""

import logging
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from fairlimit.core.admission import Code
from fairlimit.core.request import Descriptor, Request
from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, LimiterFactory, desc, load_text, req

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

MINUTE = 1_700_000_040.0  # a minute boundary
TOKENS = """
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
  - key: plain
    value: llm
    rate_limit: {unit: minute, requests_per_unit: 100}
    reservation: {default: 30, max_duration: 120}
  - key: hourly
    value: llm
    rate_limit: {unit: hour, requests_per_unit: 100}
    reservation: {max_duration: 10}
"""


def start(tenant: str, rid: str, estimate: int | None = None) -> Request:
    """The request-path call: the estimate in hits_addend, the id last."""
    return req("llm", desc("provider=llm", f"tenant={tenant}", f"request_id={rid}", hits=estimate))


def done(tenant: str, rid: str, real: int, negative: bool = False) -> Request:
    """The stream-done call: the real cost (or, negative, the hits to give back)."""
    entries = (("provider", "llm"), ("tenant", tenant), ("request_done", rid))
    return Request("llm", (Descriptor(entries, None, real, negative),))


async def used(limiter: Limiter, tenant: str) -> tuple[int, int]:
    """(tenant's remaining, the cap's remaining) by a check that charges nothing."""
    tenant_left = await limiter.should_rate_limit(
        req("llm", desc("provider=llm", f"tenant={tenant}", hits=0))
    )
    cap_left = await limiter.should_rate_limit(req("llm", desc("provider=llm", hits=0)))
    return tenant_left.statuses[0].limit_remaining, cap_left.statuses[0].limit_remaining


@pytest.fixture
def limiter(make_limiter: LimiterFactory, clock: FakeClock) -> Limiter:
    clock.t = MINUTE
    return make_limiter(TOKENS)


class TestReserveThenSettle:
    async def test_the_unused_part_comes_back_at_every_level(self, limiter: Limiter) -> None:
        """60 reserved, 25 used: 25 stay charged at the tenant and at the cap above."""
        assert (await limiter.should_rate_limit(start("a", "r1", 60))).code is Code.OK
        assert await used(limiter, "a") == (40, 940)
        assert (await limiter.should_rate_limit(done("a", "r1", 25))).code is Code.OK
        assert await used(limiter, "a") == (75, 975)

    async def test_a_cost_above_the_estimate_is_charged_as_debt_over_the_limit(
        self, limiter: Limiter
    ) -> None:
        """90 reserved, 130 used: 130 charged although the limit is 100 (the tokens were
        spent); the next reservation is refused."""
        await limiter.should_rate_limit(start("a", "r1", 90))
        await limiter.should_rate_limit(done("a", "r1", 130))
        assert await used(limiter, "a") == (0, 870)
        assert (await limiter.should_rate_limit(start("a", "r2", 1))).code is Code.OVER_LIMIT

    async def test_parallel_reservations_see_each_other(self, limiter: Limiter) -> None:
        """Three streams of 40 against 100: the third is refused while two run, and admitted
        once one settled at 10."""
        assert (await limiter.should_rate_limit(start("a", "r1", 40))).code is Code.OK
        assert (await limiter.should_rate_limit(start("a", "r2", 40))).code is Code.OK
        assert (await limiter.should_rate_limit(start("a", "r3", 40))).code is Code.OVER_LIMIT
        await limiter.should_rate_limit(done("a", "r1", 10))
        assert (await limiter.should_rate_limit(start("a", "r3", 40))).code is Code.OK
        assert await used(limiter, "a") == (10, 910)

    async def test_a_refused_reservation_consumes_nothing_and_settles_nothing(
        self, limiter: Limiter
    ) -> None:
        """150 does not fit in 100: nothing charged; its stream-done call (Envoy sends one
        for a 429 too) gives nothing back."""
        assert (await limiter.should_rate_limit(start("a", "r1", 50))).code is Code.OK
        assert (await limiter.should_rate_limit(start("a", "r2", 60))).code is Code.OVER_LIMIT
        await limiter.should_rate_limit(done("a", "r2", 0))
        assert await used(limiter, "a") == (50, 950)

    async def test_a_settlement_settles_once(self, limiter: Limiter) -> None:
        """A duplicate stream-done call, an unknown id, and another tenant's id change
        nothing."""
        await limiter.should_rate_limit(start("a", "r1", 60))
        await limiter.should_rate_limit(done("a", "r1", 20))
        await limiter.should_rate_limit(done("a", "r1", 0))
        await limiter.should_rate_limit(done("a", "nobody", 0))
        await limiter.should_rate_limit(done("b", "r1", 0))
        assert await used(limiter, "a") == (80, 980)
        assert await used(limiter, "b") == (100, 980)

    async def test_only_the_window_reserved_in_gets_the_refund(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Reserved in one minute, settled in the next: the new minute keeps its budget."""
        await limiter.should_rate_limit(start("a", "r1", 60))
        clock.advance(60)
        await limiter.should_rate_limit(start("a", "r2", 30))
        await limiter.should_rate_limit(done("a", "r1", 0))
        assert await used(limiter, "a") == (70, 970)

    async def test_an_expired_reservation_stays_charged(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Settled within max_duration (10 s) it comes back; settled after, it stays
        charged at its estimate (same hour window both times)."""

        def hourly(rid: str, hits: int, key: str = "request_id") -> Request:
            return req("llm", desc("hourly=llm", f"{key}={rid}", hits=hits))

        await limiter.should_rate_limit(hourly("r1", 30))
        await limiter.should_rate_limit(hourly("r2", 40))
        clock.advance(9.5)
        await limiter.should_rate_limit(hourly("r1", 0, "request_done"))
        clock.advance(1)  # r2 reserved 10.5 s ago
        await limiter.should_rate_limit(hourly("r2", 0, "request_done"))
        check = await limiter.should_rate_limit(req("llm", desc("hourly=llm", hits=0)))
        assert check.statuses[0].limit_remaining == 60

    @pytest.mark.parametrize("algorithm", ["sliding", "gcra", "calendar"])
    async def test_a_reservation_beside_a_shaped_limit_comes_back(
        self, make_limiter: LimiterFactory, clock: FakeClock, algorithm: str
    ) -> None:
        """A request that reserves at one descriptor and counts a sliding, GCRA or
        calendar limit at another: the reservation is kept, so its settlement gives back
        the unused part (the memory store kept none beside such a limit: 60 stayed
        charged for 10 used)."""
        clock.t = MINUTE
        shape = {
            "sliding": "unit: minute, requests_per_unit: 1000, algorithm: sliding",
            "gcra": "unit: minute, requests_per_unit: 6000, algorithm: gcra, burst: 100",
            "calendar": "unit: day, calendar: UTC, requests_per_unit: 1000",
        }[algorithm]
        limiter = make_limiter(
            TOKENS + f"  - key: route\n    rate_limit: {{{shape}}}\n"
        )  # fmt: skip
        first = await limiter.should_rate_limit(
            req("llm", desc("plain=llm", "request_id=r1", hits=60), desc("route=x", hits=1))
        )
        assert first.code is Code.OK
        clock.advance(1)
        await limiter.should_rate_limit(req("llm", desc("plain=llm", "request_done=r1", hits=10)))
        check = await limiter.should_rate_limit(req("llm", desc("plain=llm", hits=0)))
        assert check.statuses[0].limit_remaining == 90


class TestOneRequestIdOneReservation:
    async def test_a_second_reservation_by_an_open_id_is_refused(self, limiter: Limiter) -> None:
        """A 40-token request and a 1-token one by the same id: the second is refused and
        charged nothing; the first settles at its own real cost (was: the 1-token
        settlement gave back 39 of the first's, and the first's own found nothing)."""
        assert (await limiter.should_rate_limit(start("a", "r1", 40))).code is Code.OK
        second = await limiter.should_rate_limit(start("a", "r1", 1))
        assert second.code is Code.OVER_LIMIT
        assert second.statuses[0].code is Code.OVER_LIMIT
        assert await used(limiter, "a") == (60, 960)
        await limiter.should_rate_limit(done("a", "r1", 1))  # the refused one's stream end
        assert await used(limiter, "a") == (99, 999)

    async def test_the_same_id_elsewhere_or_after_settlement_reserves(
        self, limiter: Limiter
    ) -> None:
        """Another tenant's counter keeps its own records; a settled id may reserve again,
        and the new reservation settles on its own."""
        assert (await limiter.should_rate_limit(start("a", "r1", 40))).code is Code.OK
        assert (await limiter.should_rate_limit(start("b", "r1", 40))).code is Code.OK
        await limiter.should_rate_limit(done("a", "r1", 10))
        assert (await limiter.should_rate_limit(start("a", "r1", 30))).code is Code.OK
        await limiter.should_rate_limit(done("a", "r1", 5))
        assert await used(limiter, "a") == (85, 945)

    async def test_an_expired_reservations_id_may_reserve_again(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Past max_duration (10 s) an unsettled id is no longer open: a new reservation by
        it is admitted and settles on its own (the first stays charged at its estimate)."""

        def hourly(rid: str, hits: int, key: str = "request_id") -> Request:
            return req("llm", desc("hourly=llm", f"{key}={rid}", hits=hits))

        assert (await limiter.should_rate_limit(hourly("r1", 30))).code is Code.OK
        clock.advance(9.5)
        assert (await limiter.should_rate_limit(hourly("r1", 5))).code is Code.OVER_LIMIT
        clock.advance(1)
        assert (await limiter.should_rate_limit(hourly("r1", 20))).code is Code.OK
        await limiter.should_rate_limit(hourly("r1", 0, "request_done"))
        check = await limiter.should_rate_limit(req("llm", desc("hourly=llm", hits=0)))
        assert check.statuses[0].limit_remaining == 70


class TestAClientsTokens:
    async def test_charged_reserved_used_and_owed(self, limiter: Limiter, clock: FakeClock
                                                  ) -> None:  # fmt: skip
        """What /tokens shows: two reservations in flight, one settled under its estimate,
        one over it (owed past the limit); a new window starts clean."""
        entries = (("provider", "llm"), ("tenant", "a"))
        await limiter.should_rate_limit(start("a", "r1", 60))
        await limiter.should_rate_limit(start("a", "r2", 30))
        report = await limiter.tokens("llm", entries)
        assert report is not None
        assert report.as_json() == {"rule": "llm/provider=llm/tenant", "limit": 100,
                                    "window_seconds": 60, "charged": 90, "reserved": 90,
                                    "used": 0, "owed": 0, "remaining": 10}  # fmt: skip
        await limiter.should_rate_limit(done("a", "r1", 25))
        report = await limiter.tokens("llm", entries)
        assert report is not None and (report.charged, report.reserved) == (55, 30)
        await limiter.should_rate_limit(done("a", "r2", 130))
        report = await limiter.tokens("llm", entries)
        assert report is not None
        assert {k: report.as_json()[k] for k in ("charged", "reserved", "used", "owed")} == {
            "charged": 155, "reserved": 0, "used": 155, "owed": 55}  # fmt: skip
        clock.advance(60)
        report = await limiter.tokens("llm", entries)
        assert report is not None and (report.charged, report.reserved) == (0, 0)
        assert await limiter.tokens("llm", (("provider", "llm"),)) is None  # no reservation

    async def test_an_unsettled_reservation_of_a_new_window_counts_alone(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Reserved in one minute, another in the next: the new minute's reserved is its own
        reservation only; the late settlement of the first leaves it alone."""
        entries = (("provider", "llm"), ("tenant", "a"))
        await limiter.should_rate_limit(start("a", "r1", 60))
        clock.advance(60)
        await limiter.should_rate_limit(start("a", "r2", 20))
        await limiter.should_rate_limit(done("a", "r1", 5))
        report = await limiter.tokens("llm", entries)
        assert report is not None and (report.charged, report.reserved) == (20, 20)

    async def test_debt_that_opens_a_window_brings_no_reservation_along(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Reserved 60 and 30 in one minute, the 60 settled at 130 in the next, where nothing
        was charged yet: the new minute holds the 70 of debt and nothing reserved (the 30
        is the old minute's)."""
        entries = (("provider", "llm"), ("tenant", "a"))
        await limiter.should_rate_limit(start("a", "r1", 60))
        await limiter.should_rate_limit(start("a", "r2", 30))
        clock.advance(60)
        await limiter.should_rate_limit(done("a", "r1", 130))
        report = await limiter.tokens("llm", entries)
        assert report is not None and (report.charged, report.reserved) == (70, 0)


class TestNegativeHits:
    async def test_a_refund_gives_back_at_most_what_was_reserved(self, limiter: Limiter) -> None:
        """60 reserved, 500 given back: 60 come back, no more (nothing of the 30 another
        request holds), and a second refund changes nothing."""
        await limiter.should_rate_limit(start("a", "r1", 30))
        await limiter.should_rate_limit(start("a", "r2", 60))
        await limiter.should_rate_limit(done("a", "r2", 500, negative=True))
        assert await used(limiter, "a") == (70, 970)
        await limiter.should_rate_limit(done("a", "r2", 500, negative=True))
        assert await used(limiter, "a") == (70, 970)

    async def test_a_partial_refund(self, limiter: Limiter) -> None:
        await limiter.should_rate_limit(start("a", "r1", 60))
        await limiter.should_rate_limit(done("a", "r1", 45, negative=True))
        assert await used(limiter, "a") == (85, 985)

    async def test_unpaired_negative_hits_change_nothing(self, limiter: Limiter) -> None:
        """Negative hits with no request id, or on the request path, answer OK and are never
        charged (before is_negative_hits was read, they were charged as positive hits)."""
        await limiter.should_rate_limit(start("a", "r1", 10))
        no_id = (("provider", "llm"), ("tenant", "a"))
        for request in (
            Request("llm", (Descriptor(no_id, None, 40, True),)),
            Request("llm", (Descriptor((*no_id, ("request_id", "r9")), None, 40, True),)),
            Request("llm", (Descriptor((("other", "x"),), None, 40, True),)),
        ):
            decision = await limiter.should_rate_limit(request)
            assert decision.code is Code.OK
            assert [s.code for s in decision.statuses] == [Code.OK]
        assert await used(limiter, "a") == (90, 990)


class TestEstimates:
    async def test_the_rule_default_then_the_hits_addend(self, limiter: Limiter) -> None:
        """No hits_addend: the rule's default (30); a hits_addend wins over it; 0 is none."""
        plain = desc("plain=llm", "request_id=r1")
        await limiter.should_rate_limit(req("llm", plain))
        await limiter.should_rate_limit(req("llm", desc("plain=llm", "request_id=r2", hits=20)))
        await limiter.should_rate_limit(req("llm", desc("plain=llm", "request_id=r3", hits=0)))
        check = await limiter.should_rate_limit(req("llm", desc("plain=llm", hits=0)))
        assert check.statuses[0].limit_remaining == 100 - 30 - 20 - 30

    async def test_the_clients_recent_average_then_one(self, limiter: Limiter) -> None:
        """No hits_addend and no default: 1 at first, then the average of the real costs
        settled (20, then 20 + 0.2 x (40 - 20) = 24)."""
        await limiter.should_rate_limit(start("a", "r1"))
        assert await used(limiter, "a") == (99, 999)
        await limiter.should_rate_limit(done("a", "r1", 20))
        await limiter.should_rate_limit(start("a", "r2"))
        assert await used(limiter, "a") == (60, 960)
        await limiter.should_rate_limit(done("a", "r2", 40))
        await limiter.should_rate_limit(start("a", "r3"))
        assert await used(limiter, "a") == (100 - 60 - 24, 1000 - 60 - 24)


class TestFairShareInTokens:
    async def test_reservations_count_at_the_cap_and_refunds_leave_it(
        self, limiter: Limiter
    ) -> None:
        """The cap sees reserved hits as the tenant's admitted hits: 40 reserved by a and 40
        by b leave the cap 920; a's refund of 30 brings it to 950."""
        await limiter.should_rate_limit(start("a", "r1", 40))
        await limiter.should_rate_limit(start("b", "r2", 40))
        assert (await used(limiter, "a"))[1] == 920
        await limiter.should_rate_limit(done("a", "r1", 10))
        assert (await used(limiter, "b"))[1] == 950


def _sums(reader: InMemoryMetricReader) -> dict[tuple[str, str], float]:
    """Each fairlimit.tokens.* counter by (name, rule)."""
    data = reader.get_metrics_data()
    out: dict[tuple[str, str], float] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name.startswith("fairlimit.tokens."):
                    for point in metric.data.data_points:
                        rule = str(point.attributes.get("rule")) if point.attributes else ""
                        out[metric.name, rule] = float(point.value)  # type: ignore[attr-defined]
    return out


def _domains(reader: InMemoryMetricReader) -> set[str]:
    """The ``domain`` attributes of fairlimit.tokens.unpaired."""
    data = reader.get_metrics_data()
    return {
        str(point.attributes.get("domain"))
        for resource in (data.resource_metrics if data else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "fairlimit.tokens.unpaired"
        for point in metric.data.data_points
        if point.attributes
    }


class TestMetrics:
    async def test_reserved_refunded_debt_and_unpaired(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """60 then 70 reserved; 35 refunded, 40 of debt; a duplicate settlement and three
        unpaired refunds counted; the unpaired ones logged once per rule; two reservations by
        an open id refused, counted, logged once."""
        reader = InMemoryMetricReader()
        telemetry = Telemetry(MeterProvider(metric_readers=[reader]), TracerProvider())
        limiter = Limiter(load_text(tmp_path, TOKENS), MemoryStore(), FakeClock(MINUTE),
                          telemetry=telemetry)  # fmt: skip
        no_id = Request("llm", (Descriptor((("provider", "llm"), ("tenant", "a")), None, 5, True),))
        with caplog.at_level(logging.WARNING, logger="fairlimit.flows.tokens"):
            await limiter.should_rate_limit(start("a", "r1", 60))
            await limiter.should_rate_limit(done("a", "r1", 25))
            await limiter.should_rate_limit(start("a", "r2", 70))
            for _ in range(2):  # r2 is open: refused, counted, logged once
                await limiter.should_rate_limit(start("a", "r2", 1))
            await limiter.should_rate_limit(done("a", "r2", 110))
            await limiter.should_rate_limit(done("a", "r2", 0))
            for _ in range(3):
                await limiter.should_rate_limit(no_id)
        rule = "llm/provider=llm/tenant"
        assert _sums(reader) == {
            ("fairlimit.tokens.reserved", rule): 130,
            ("fairlimit.tokens.refunded", rule): 35,
            ("fairlimit.tokens.debt", rule): 40,
            ("fairlimit.tokens.unpaired", rule): 4,
            ("fairlimit.tokens.id_open", rule): 2,
        }
        assert [r.getMessage() for r in caplog.records] == [
            "a reservation by a request id that is still open was refused (logged once; "
            f"fairlimit.tokens.id_open counts them): domain llm, rule {rule}",
            "negative hits paired with no reservation were ignored (logged once per rule): "
            f"domain llm, rule {rule}",
        ]

    async def test_negative_hits_of_unknown_domains_are_one_series(self, tmp_path: Path) -> None:
        """Negative hits of 20 domains no file has count under domain "": each was a series
        of its own, any caller's domain an attribute (found by fuzzing, issue 41)."""
        reader = InMemoryMetricReader()
        telemetry = Telemetry(MeterProvider(metric_readers=[reader]), TracerProvider())
        limiter = Limiter(load_text(tmp_path, TOKENS), MemoryStore(), FakeClock(MINUTE),
                          telemetry=telemetry)  # fmt: skip
        entries = (("provider", "llm"), ("tenant", "a"), ("request_done", "r1"))
        for i in range(20):
            await limiter.should_rate_limit(Request(f"x{i}", (Descriptor(entries, None, 5, True),)))
        await limiter.should_rate_limit(Request("llm", (Descriptor(entries, None, 5, True),)))
        assert _domains(reader) == {"", "llm"}

