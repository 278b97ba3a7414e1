"""A per-request limit override (``limit`` in the descriptor: Envoy Gateway's fromMetadata)
is never answered from what a local cache learned under another limit of the same counter:
the Redis store's over-limit cache, and its lease blocks (core/lease.py). Real Redis, an
injected clock."""

from pathlib import Path

import pytest

from fairlimit.core.admission import Code
from fairlimit.core.rules import RateLimit
from fairlimit.core.units import Unit
from fairlimit.limiter import Limiter
from helpers import FakeClock, desc, load_text, req
from redis_servers import StoreFactory

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

CONFIG = """
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1000}
"""
T0 = 1_700_000_000.0
ROOMY, TIGHT = RateLimit(100, Unit.MINUTE), RateLimit(3, Unit.MINUTE)


async def _codes(limiter: Limiter, limit: RateLimit, n: int) -> list[str]:
    return [code for code, _ in await _answers(limiter, limit, n)]


async def _answers(limiter: Limiter, limit: RateLimit, n: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        decision = await limiter.should_rate_limit(req("edge", desc("tenant=t", limit=limit)))
        out.append((decision.code.name, decision.statuses[0].limit_remaining))
    return out


class TestOverrides:
    async def test_a_block_taken_under_a_roomy_override_does_not_serve_a_tight_one(
        self, redis_store_factory: StoreFactory, clock: FakeClock, tmp_path: Path
    ) -> None:
        """With leases, 100/min takes a block (2 counted, 4 reserved in Redis); then 3/min on
        the same counter goes to Redis, the block's unused hits given back first (since
        issue 41: another shape's block must not count against it), which admits one more
        and refuses the next two, taking nothing: 100/min then has 96 left, as without
        leases. Blocks kept by counter key alone served 3/min from the block: OK at 2, and
        the two refusals after it each took a hit (94 left)."""
        clock.t = T0
        store = await redis_store_factory(leases="on")
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)  # type: ignore[arg-type]
        try:
            assert await _codes(limiter, ROOMY, 2) == ["OK", "OK"]  # the second takes a block
            assert await _codes(limiter, TIGHT, 3) == ["OK"] + ["OVER_LIMIT"] * 2
            roomy = await limiter.should_rate_limit(req("edge", desc("tenant=t", limit=ROOMY)))
            assert (roomy.code, roomy.statuses[0].limit_remaining) == (Code.OK, 96)
        finally:
            await store.close()  # type: ignore[attr-defined]

    async def test_a_refusal_cached_under_a_tight_override_does_not_refuse_a_roomy_one(
        self, redis_store_factory: StoreFactory, clock: FakeClock, tmp_path: Path
    ) -> None:
        """3/min refused at 3 (the over-limit cache learns the counter over, and answers the
        next 3/min itself); 100/min on the same counter is asked of Redis and admitted and
        charged (96, then 95 left), then 3/min is refused again. A cache that kept the
        verdict, not the count, would refuse 100/min too (as upstream's, keyed by the
        counter alone) or answer it without charging it."""
        clock.t = T0
        store = await redis_store_factory()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)  # type: ignore[arg-type]
        try:
            assert await _codes(limiter, TIGHT, 4) == ["OK"] * 3 + ["OVER_LIMIT"]
            trips = store.round_trips  # type: ignore[attr-defined]
            assert await _codes(limiter, TIGHT, 1) == ["OVER_LIMIT"]
            assert store.round_trips == trips  # type: ignore[attr-defined]  # from the cache
            assert await _answers(limiter, ROOMY, 2) == [("OK", 96), ("OK", 95)]
            assert store.round_trips == trips + 2  # type: ignore[attr-defined]
            assert await _codes(limiter, TIGHT, 1) == ["OVER_LIMIT"]
        finally:
            await store.close()  # type: ignore[attr-defined]
