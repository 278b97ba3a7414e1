"""Fair share in tokens: four tenants reserve estimates and settle real costs at a contended
token cap; per settled window each gets within 5% of its weighted max-min share of tokens
(tests/maxmin.py, the exact solver). A real Limiter on an injected tick clock, on memory
and Redis."""

from collections import defaultdict
from dataclasses import dataclass

import pytest

from fairlimit.core.admission import Code
from fairlimit.core.request import Descriptor, Request
from fairlimit.limiter import Limiter
from helpers import FakeClock, LimiterFactory
from maxmin import maxmin

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

EPOCH = 1_699_920_000.0  # a day boundary: second 0 starts a minute
CAPACITY, LIMIT, WINDOW = 12_000, 20_000, 60
CONFIG = f"""
domain: llm
descriptors:
  - key: provider
    value: llm
    rate_limit: {{unit: minute, requests_per_unit: {CAPACITY}}}
    fair_share: {{active_clients: 2, weights: {{a: 2}}}}
    descriptors:
      - key: tenant
        rate_limit: {{unit: minute, requests_per_unit: {LIMIT}}}
        reservation: {{max_duration: 30}}
"""
TICK = 0.05  # seconds
DURATION = 1.0  # each stream's length: its settlement comes this long after admission
WINDOWS = 4


@dataclass(frozen=True)
class Tenant:
    name: str
    rate: float  # streams a second
    estimate: int  # hits_addend on the request path
    real: int  # its real cost
    weight: float = 1.0

    @property
    def demand(self) -> float:
        """Tokens a window it would use unlimited."""
        return self.rate * WINDOW * self.real


TENANTS = (
    Tenant("a", 10, 100, 60, 2.0),  # over-estimates
    Tenant("b", 10, 100, 100),  # exact
    Tenant("c", 5, 100, 40),  # over-estimates a lot
    Tenant("d", 0.25, 80, 100),  # under-estimates (debt), and wants less than its share
)


def _call(tenant: str, key: str, rid: str, hits: int) -> Request:
    entries = (("provider", "llm"), ("tenant", tenant), (key, rid))
    return Request("llm", (Descriptor(entries, None, hits),))


async def _run(limiter: Limiter, clock: FakeClock) -> dict[int, dict[str, int]]:
    """Real tokens admitted per window (by admission time) and tenant."""
    got: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    pending: list[tuple[float, str, str, int]] = []  # (settle at, tenant, id, real)
    sent = dict.fromkeys([t.name for t in TENANTS], 0)
    ticks = int(WINDOWS * WINDOW / TICK)
    for k in range(ticks):
        now = EPOCH + k * TICK
        clock.t = now
        due = [p for p in pending if p[0] <= now + 1e-9]
        pending = [p for p in pending if p[0] > now + 1e-9]
        for _, name, rid, real in due:
            await limiter.should_rate_limit(_call(name, "request_done", rid, real))
        for t in TENANTS:
            for _ in range(int((k + 1) * TICK * t.rate + 1e-9) - int(k * TICK * t.rate + 1e-9)):
                sent[t.name] += 1
                rid = f"{t.name}-{sent[t.name]}"
                decision = await limiter.should_rate_limit(
                    _call(t.name, "request_id", rid, t.estimate)
                )
                if decision.code is Code.OK:
                    got[int(k * TICK // WINDOW)][t.name] += t.real
                    pending.append((now + DURATION, t.name, rid, t.real))
    return got


async def test_tokens_are_shared_by_weighted_max_min(
    make_limiter: LimiterFactory, clock: FakeClock
) -> None:
    limiter = make_limiter(CONFIG)
    got = await _run(limiter, clock)
    fair = maxmin([t.demand for t in TENANTS], [LIMIT] * len(TENANTS),
                  [t.weight for t in TENANTS], CAPACITY)  # fmt: skip
    assert [round(f) for f in fair] == [5250, 2625, 2625, 1500]
    errors = []
    for window in range(1, WINDOWS):  # the first window is the warm-up
        for t, share in zip(TENANTS, fair, strict=True):
            errors.append(abs(got[window][t.name] - share) / share)
    print("\nper window:", {w: dict(v) for w, v in got.items()}, "fair:", fair)
    print(f"largest error {max(errors):.3f}")
    assert max(errors) <= 0.05
