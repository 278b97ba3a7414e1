"""Usage charged after the response (DESIGN section 4): a charge_when_over_limit rule records
a refused charge on every level it touches, and checks stay OVER_LIMIT until the window
ends; every other rule keeps all or nothing. On every backend."""

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fairlimit.config.loader import load
from fairlimit.core.admission import Code
from fairlimit.core.request import Request
from fairlimit.limiter import Limiter
from fairlimit.store.base import Store
from helpers import FakeClock, LimiterFactory, desc, load_text, req
from token_configs import TOKENS

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]


def tenant(name: str, tokens: int) -> Request:
    return req("llm", desc("provider=openai", f"tenant={name}", hits=tokens))


async def remaining(limiter: Limiter, *pairs: str) -> tuple[Code, int]:
    out = await limiter.should_rate_limit(req("llm", desc(*pairs, hits=0)))
    return out.code, out.statuses[0].limit_remaining


class TestChargeWhenOverLimit:
    async def test_a_refused_charge_is_recorded_and_checks_stay_over(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """80 tokens fit, the next 50 do not: recorded anyway (130 of 100), and the check on
        the request path answers OVER_LIMIT until the minute ends."""
        clock.t = 1_700_000_040.0  # a minute boundary: the window is 1_700_000_040 + 60
        limiter = make_limiter(TOKENS)
        assert (await limiter.should_rate_limit(tenant("a", 80))).code is Code.OK
        assert (await limiter.should_rate_limit(tenant("a", 50))).code is Code.OVER_LIMIT
        assert await remaining(limiter, "provider=openai", "tenant=a") == (Code.OVER_LIMIT, 0)
        clock.advance(59)
        assert (await remaining(limiter, "provider=openai", "tenant=a"))[0] is Code.OVER_LIMIT
        clock.advance(1)  # the next minute
        assert await remaining(limiter, "provider=openai", "tenant=a") == (Code.OK, 100)

    async def test_the_cap_above_is_charged_too(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A refused charge moves the provider's cap as well: 80 + 50 of its 1000 are gone."""
        clock.t = 1_700_000_040.0
        limiter = make_limiter(TOKENS)
        await limiter.should_rate_limit(tenant("a", 80))
        await limiter.should_rate_limit(tenant("a", 50))
        assert await remaining(limiter, "provider=openai") == (Code.OK, 870)

    async def test_other_rules_keep_all_or_nothing(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """Without the option a charge that does not fit is refused and consumes nothing."""
        clock.t = 1_700_000_040.0
        limiter = make_limiter(TOKENS)
        plain = req("llm", desc("plain=x", hits=80))
        assert (await limiter.should_rate_limit(plain)).code is Code.OK
        over = req("llm", desc("plain=x", hits=50))
        assert (await limiter.should_rate_limit(over)).code is Code.OVER_LIMIT
        assert await remaining(limiter, "plain=x") == (Code.OK, 20)

    async def test_a_refusal_by_another_descriptor_keeps_the_recorded_charge(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A request whose plain descriptor is over is refused whole; its tenant's charge
        (charge_when_over_limit) is recorded anyway, at the tenant and the cap above: on a
        Redis Cluster the two sit in two slots, and the undo of the slot that charged
        leaves those levels as charged."""
        clock.t = 1_700_000_040.0
        limiter = make_limiter(TOKENS)
        assert (
            await limiter.should_rate_limit(req("llm", desc("plain=x", hits=80)))
        ).code is Code.OK
        both = req("llm", desc("provider=openai", "tenant=t", hits=30), desc("plain=x", hits=50))
        assert (await limiter.should_rate_limit(both)).code is Code.OVER_LIMIT
        assert await remaining(limiter, "provider=openai", "tenant=t") == (Code.OK, 70)
        assert await remaining(limiter, "plain=x") == (Code.OK, 20)


TENANT_ONLY = """
domain: llm
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 100, charge_when_over_limit: true}
"""


class TestWithLeases:
    """Redis-only: local leases (?leases=on) admit plain counters without Redis; a
    charge_when_over_limit counter must still reach Redis when refused, so it is never leased."""

    async def test_a_refused_charge_reaches_redis_with_leases_on(
        self, redis_store_factory: Callable[..., Awaitable[Any]], tmp_path: Path
    ) -> None:
        """80 then 50 tokens with leases on: the check after them is OVER_LIMIT."""
        store = await redis_store_factory(leases="on")
        clock = FakeClock(1_700_000_040.0)
        limiter = Limiter(load_text(tmp_path, TENANT_ONLY), store, clock)
        try:
            charge = [req("llm", desc("tenant=a", hits=h)) for h in (80, 50)]
            codes = [(await limiter.should_rate_limit(r)).code for r in charge]
            check = await limiter.should_rate_limit(req("llm", desc("tenant=a", hits=0)))
        finally:
            await store.close()
        assert codes == [Code.OK, Code.OVER_LIMIT] and check.code is Code.OVER_LIMIT


def upstream_limiter(text: str, store: Store, clock: FakeClock, tmp_path: Path) -> Limiter:
    """A limiter whose rules charge as envoyproxy/ratelimit does unless they say otherwise
    (``--charge-when-over-limit true``: xDS configs, upstream's environment)."""
    path = tmp_path / "upstream.yaml"
    path.write_text(text)
    return Limiter(load([path], charge_over_limit=True), store, clock)


HOURLY = """
domain: edge
descriptors:
  - key: route
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: tokens
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: second
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: small
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: big
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: quota
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: other_quota
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: kept
    rate_limit: {unit: hour, requests_per_unit: 10, charge_when_over_limit: false}
"""


def charge(key: str, hits: int) -> Request:
    return req("edge", desc(f"{key}=x", hits=hits))


async def check(limiter: Limiter, key: str) -> tuple[Code, int]:
    out = await limiter.should_rate_limit(req("edge", desc(f"{key}=x", hits=0)))
    return out.code, out.statuses[0].limit_remaining


class TestUpstreamCharges:
    """``charge_over_limit``: every hit counts, as in envoyproxy/ratelimit (its default,
    STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=false), on every backend."""

    async def test_a_charge_past_the_limit_counts(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """1000/h charged +600 twice: the second is OVER_LIMIT and counted, so the next
        check is OVER_LIMIT too (Envoy Gateway's cost.response)."""
        limiter = upstream_limiter(HOURLY, store, clock, tmp_path)
        first = await limiter.should_rate_limit(charge("route", 600))
        second = await limiter.should_rate_limit(charge("route", 600))
        assert (first.code, first.statuses[0].limit_remaining) == (Code.OK, 400)
        assert (second.code, second.statuses[0].limit_remaining) == (Code.OVER_LIMIT, 0)
        assert await check(limiter, "route") == (Code.OVER_LIMIT, 0)

    async def test_a_token_quota_is_spent_by_the_response(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """Envoy AI Gateway: 10 tokens an hour, a check with 0 hits, then 20 tokens charged
        after the response: the next check is OVER_LIMIT."""
        limiter = upstream_limiter(HOURLY, store, clock, tmp_path)
        assert await check(limiter, "tokens") == (Code.OK, 10)
        await limiter.should_rate_limit(charge("tokens", 20))
        assert await check(limiter, "tokens") == (Code.OVER_LIMIT, 0)

    async def test_over_limit_says_nothing_is_left(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """20/s, +15 then +7: OVER_LIMIT with limit_remaining 0, as upstream answers."""
        clock.t = 1_700_000_000.0  # a second's start: both in one window
        limiter = upstream_limiter(HOURLY, store, clock, tmp_path)
        await limiter.should_rate_limit(charge("second", 15))
        refused = await limiter.should_rate_limit(charge("second", 7))
        assert (refused.code, refused.statuses[0].limit_remaining) == (Code.OVER_LIMIT, 0)

    async def test_every_descriptor_of_a_refused_request_is_charged(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """(small) is over, (big) is not: upstream still charges (big), every time, the
        over-limit cache included (Redis answers a known-over counter locally)."""
        limiter = upstream_limiter(HOURLY, store, clock, tmp_path)
        both = req("edge", desc("small=x"), desc("big=x"))
        codes = [(await limiter.should_rate_limit(both)).code for _ in range(4)]
        assert codes == [Code.OK] + [Code.OVER_LIMIT] * 3
        assert await check(limiter, "big") == (Code.OK, 96)

    async def test_a_quota_over_with_others_in_is_charged_once(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """A quota_mode descriptor over its limit while another quota is not: the request
        is OK, and each counter moves by its hits once."""
        limiter = upstream_limiter(HOURLY, store, clock, tmp_path)
        await limiter.should_rate_limit(charge("quota", 10))
        parts = [desc("quota=x", hits=5), desc("other_quota=x", hits=5), desc("big=x", hits=5)]
        answer = await limiter.should_rate_limit(req("edge", *parts))
        assert answer.code is Code.OK
        assert [s.code for s in answer.statuses] == [Code.OVER_LIMIT, Code.OK, Code.OK]
        assert await check(limiter, "big") == (Code.OK, 95)
        assert await check(limiter, "other_quota") == (Code.OK, 5)

    async def test_a_rule_that_says_false_keeps_all_or_nothing(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """charge_when_over_limit: false on the rule wins: the refused charge consumes
        nothing, and OVER_LIMIT carries what is still left."""
        limiter = upstream_limiter(HOURLY, store, clock, tmp_path)
        await limiter.should_rate_limit(charge("kept", 8))
        refused = await limiter.should_rate_limit(charge("kept", 5))
        assert (refused.code, refused.statuses[0].limit_remaining) == (Code.OVER_LIMIT, 2)
        assert await check(limiter, "kept") == (Code.OK, 2)

    async def test_a_descriptor_under_a_fair_share_cap_keeps_all_or_nothing(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """Under upstream's semantics a fair_share cap is still never charged by refusals:
        a client over its own 5 an hour retries 20 times, and the cap of 10 still admits
        the other client's 5 (charged when refused, the retries would have filled it)."""
        limiter = upstream_limiter(CAPPED, store, clock, tmp_path)
        for _ in range(25):
            await limiter.should_rate_limit(req("edge", desc("route=api", "client=greedy")))
        other = [
            (await limiter.should_rate_limit(req("edge", desc("route=api", "client=calm")))).code
            for _ in range(5)
        ]
        assert other == [Code.OK] * 5

    async def test_refusals_at_a_cap_are_never_charged_to_the_clients_own_limit(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """A client under a cap of 6 a minute, its own limit 100 an hour, asks every 3 s for
        10 minutes: each minute admits at least one and no more than the cap, the rest
        refused at the cap. Its own counter charged with those refusals too (20 a minute),
        it would be locked out for the rest of the hour after 5 minutes."""
        clock.t = 1_700_000_040.0  # a minute's start
        limiter = upstream_limiter(CAPPED_PER_MINUTE, store, clock, tmp_path)
        asked = req("edge", desc("route=api", "client=busy"))
        admitted = []
        for _ in range(10):
            codes = []
            for _ in range(20):  # one every 3 s
                codes.append((await limiter.should_rate_limit(asked)).code)
                clock.advance(3)
            admitted.append(codes.count(Code.OK))
        assert all(1 <= n <= 6 for n in admitted), admitted


CAPPED_PER_MINUTE = """
domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {unit: minute, requests_per_unit: 6}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client
        rate_limit: {unit: hour, requests_per_unit: 100}
"""

CAPPED = """
domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {unit: hour, requests_per_unit: 10}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client
        rate_limit: {unit: hour, requests_per_unit: 5}
"""


class TestFairlimitsDefault:
    async def test_a_refused_charge_consumes_nothing(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """fairlimit's own default: +7 refused on 20/s after +15 leaves 5, and says so."""
        clock.t = 1_700_000_000.0
        limiter = make_limiter(HOURLY)
        await limiter.should_rate_limit(charge("second", 15))
        refused = await limiter.should_rate_limit(charge("second", 7))
        assert (refused.code, refused.statuses[0].limit_remaining) == (Code.OVER_LIMIT, 5)
        assert await check(limiter, "second") == (Code.OK, 5)


GCRA_DAILY = """
domain: llm
descriptors:
  - key: tenant
    rate_limit: {unit: day, requests_per_unit: 1, algorithm: gcra, charge_when_over_limit: true}
"""


class TestGcraChargedFarAhead:
    async def test_a_bucket_in_debt_for_millions_of_years_stays_over_limit(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """Two refused charges of 1e9 (the most Envoy sends) on 1 a day put the bucket
        ~5.5 million years ahead: every answer after is OVER_LIMIT with that reset, the
        store stays healthy. Found by fuzzing accepted configs (issue 41): on Redis the
        key's TTL, past 1e17 ms, made PEXPIRE fail the script; the calls were counted as the
        backend's failures and answered by the failure mode (OK)."""
        clock.t = 1_700_000_000.0
        limiter = make_limiter(GCRA_DAILY)
        for hits in (10**9, 10**9, 1, 0):
            decision = await limiter.should_rate_limit(req("llm", desc("tenant=a", hits=hits)))
            assert decision.code is Code.OVER_LIMIT, hits
        assert decision.statuses[0].duration_until_reset > 1.7e14
        assert limiter.backend_healthy
        other = await limiter.should_rate_limit(req("llm", desc("tenant=b", hits=1)))
        assert other.code is Code.OK
