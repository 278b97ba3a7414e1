"""Usage charged after the response (DESIGN section 4): a charge_when_over_limit rule records
a refused charge on every level it touches, and checks stay OVER_LIMIT until the window
ends; every other rule keeps all or nothing. On every backend."""

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fairlimit.core.admission import Code
from fairlimit.core.request import Request
from fairlimit.limiter import Limiter
from helpers import FakeClock, LimiterFactory, desc, load_text, req

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

TOKENS = """
domain: llm
descriptors:
  - key: provider
    value: openai
    rate_limit: {unit: minute, requests_per_unit: 1000, charge_when_over_limit: true}
    fair_share: {active_clients: 2}
    descriptors:
      - key: tenant
        rate_limit: {unit: minute, requests_per_unit: 100, charge_when_over_limit: true}
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 100}
"""


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
