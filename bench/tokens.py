"""Overspend of a token budget by parallel streams: check-then-charge (hits_addend 0 on the
request path, the real cost charged at stream end, charge_when_over_limit) next to
reserve-then-settle (the estimate reserved by request id, settled with the real cost).

One tenant, a budget of 20 000 tokens an hour, N streams started together (all checked
before any ends), each estimated at ESTIMATE tokens (x-max-tokens; 4000 unless given),
real costs drawn from 500..6000. A real Limiter on the memory store and an injected clock:
the figures are exact, the same on every run with the same seed.
python bench/tokens.py [N] [SEED] [ESTIMATE]
"""

import asyncio
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from fairlimit.config.loader import load
from fairlimit.core.admission import Code
from fairlimit.core.request import Descriptor, Request
from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore

BUDGET = 20_000
ESTIMATE = int(sys.argv[3]) if len(sys.argv) > 3 else 4000
CHARGE_AFTER = """
domain: llm
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 20000, charge_when_over_limit: true}
"""
RESERVE = """
domain: llm
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 20000}
    reservation: {max_duration: 600}
"""


class _Clock:
    def now(self) -> float:
        return 1_699_920_000.0


def _limiter(text: str, folder: Path) -> Limiter:
    path = folder / "llm.yaml"
    path.write_text(text)
    return Limiter(load([path]), MemoryStore(), _Clock())


def _call(entries: tuple[tuple[str, str], ...], hits: int) -> Request:
    return Request("llm", (Descriptor(entries, None, hits),))


async def check_then_charge(costs: list[int], folder: Path) -> tuple[int, int, int]:
    """(streams admitted, tokens they used, the counter after) with today's flow."""
    limiter = _limiter(CHARGE_AFTER, folder)
    admitted = [c for c in costs
                if (await limiter.should_rate_limit(_call((("tenant", "t"),), 0))).code
                is Code.OK]  # fmt: skip
    for cost in admitted:
        await limiter.should_rate_limit(_call((("tenant", "t"),), cost))
    counter = await _counter(limiter)
    return len(admitted), sum(admitted), counter


async def reserve_then_settle(costs: list[int], folder: Path) -> tuple[int, int, int]:
    """(streams admitted, tokens they used, the counter after) reserving by request id."""
    limiter = _limiter(RESERVE, folder)
    admitted: list[tuple[str, int]] = []
    for i, cost in enumerate(costs):
        rid = f"r{i}"
        answer = await limiter.should_rate_limit(_call((("tenant", "t"), ("request_id", rid)),
                                                       ESTIMATE))  # fmt: skip
        if answer.code is Code.OK:
            admitted.append((rid, cost))
    for rid, cost in admitted:
        await limiter.should_rate_limit(_call((("tenant", "t"), ("request_done", rid)), cost))
    return len(admitted), sum(c for _, c in admitted), await _counter(limiter)


async def _counter(limiter: Limiter) -> int:
    """The tenant's counter, read from the store (it may be past the limit)."""
    store = limiter.store
    assert isinstance(store, MemoryStore)
    return sum(c.count for c in store.counters.table.values())


async def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    costs = [random.Random(seed + i).randint(500, 6000) for i in range(n)]
    with tempfile.TemporaryDirectory() as folder:
        before = await check_then_charge(costs, Path(folder))
        after = await reserve_then_settle(costs, Path(folder))
    print(f"{n} parallel streams, budget {BUDGET}, estimate {ESTIMATE} each, seed {seed}")
    print(f"{'flow':<20} {'admitted':>8} {'used':>7} {'counter':>8} {'over budget':>11}")
    for name, (admitted, used, counter) in (("check-then-charge", before),
                                            ("reserve-then-settle", after)):  # fmt: skip
        print(f"{name:<20} {admitted:>8} {used:>7} {counter:>8} {max(0, used - BUDGET):>11}")
    admitted = after[0]
    bound = max(0, after[1] - admitted * ESTIMATE)
    print(f"reserve-then-settle bound: over budget <= (used - reserved)+ = {bound}")


if __name__ == "__main__":
    asyncio.run(main())
