"""In-process store: fixed-window counters and fair-share caps, idle state expires.

Every ``admit`` runs without awaiting, so on one event loop it is atomic by construction.
Expiry is driven by two heaps of deadlines, so memory stays bounded by the live state.
"""

import heapq
import math
from collections.abc import Mapping, Sequence

from fairlimit.core.admission import Outcome, admits, share_bound
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.fairshare import CapReport, FairnessFigures, PeriodDemand, figures_of, level_of
from fairlimit.core.plan import Plan, Share
from fairlimit.core.units import window_start
from fairlimit.store.slots import MemorySlots

_SHRINK = 4  # compact the counter table once it holds under a quarter of its high mark


class _Counter:
    __slots__ = ("count", "start", "window")

    def __init__(self, start: int, window: int) -> None:
        self.start = start
        self.window = window
        self.count = 0


class _Cap:
    """One cap instance: λ for the current period, demand and admissions per client."""

    __slots__ = (
        "admitted",
        "capacity",
        "declared",
        "demand",
        "figures",
        "last_period",
        "last_seen",
        "level",
        "limits",
        "period",
        "period_admitted",
        "seen_weight",
        "weights",
        "window",
        "window_start",
    )

    def __init__(self, share: Share) -> None:
        self.capacity = share.capacity
        self.window = share.window
        self.declared = share.declared
        self.period = -1
        self.level: float | None = None
        self.figures: FairnessFigures | None = None
        self.last_period: PeriodDemand | None = None  # the inputs of figures, until asked for
        self.demand: dict[str, int] = {}
        self.period_admitted: dict[str, int] = {}
        self.limits: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.seen_weight = 0.0
        self.window_start = -1
        self.admitted: dict[str, int] = {}
        self.last_seen = 0.0

    def roll(self, share: Share, now: float) -> None:
        """Move to the period and window holding ``now``; recompute λ once per period."""
        period = math.floor(now / share.period)
        if period != self.period:
            if period == self.period + 1 and self.demand:
                self._recompute(share)
            else:
                self.level, self.figures, self.last_period = None, None, None
            self.period = period
            self.demand, self.period_admitted = {}, {}
            self.limits, self.weights, self.seen_weight = {}, {}, 0.0
        start = window_start(share.window, now)
        if start != self.window_start:
            self.window_start, self.admitted = start, {}
        self.last_seen = now

    def _recompute(self, share: Share) -> None:
        scale = share.window / share.period
        last = PeriodDemand.of(
            self.capacity, self.demand, self.period_admitted, self.limits, self.weights, scale
        )
        self.level = level_of(last)
        # The figures are for telemetry only: worked out when caps() asks, not in the
        # request that rolls the period (at 100k clients they cost twice λ's time).
        self.figures = None
        self.last_period = last

    def report_figures(self) -> FairnessFigures | None:
        """The last full period's fairness figures (computed on first ask)."""
        if self.last_period is not None:
            self.figures = figures_of(self.last_period)
            self.last_period = None
        return self.figures

    def record(self, share: Share) -> None:
        """Count the client's attempt in this period's demand."""
        if share.client not in self.demand:
            self.demand[share.client] = 0
            self.limits[share.client] = share.client_limit
            self.weights[share.client] = share.weight
            self.seen_weight += share.weight
        self.demand[share.client] += share.hits

    def charge(self, share: Share) -> None:
        """Count an admitted claim in this window and this period."""
        client = share.client
        self.admitted[client] = self.admitted.get(client, 0) + share.hits
        self.period_admitted[client] = self.period_admitted.get(client, 0) + share.hits


class MemoryStore:
    """The default backend: state in this process only."""

    def __init__(self) -> None:
        self._counters: dict[str, _Counter] = {}
        self._caps: dict[str, _Cap] = {}
        self._counter_deadlines: list[tuple[float, str]] = []
        self._cap_deadlines: list[tuple[float, str]] = []
        self._high = 0  # the most counters held since the table was last compacted
        self.slots = MemorySlots()  # concurrency pools (store/slots.py)

    def __len__(self) -> int:
        """How many counters and caps are held (for tests and memory accounting)."""
        return len(self._counters) + len(self._caps)

    def _counter(self, key: str, window: int, now: float) -> _Counter:
        start = window_start(window, now)
        counter = self._counters.get(key)
        if counter is None or counter.start != start:
            counter = _Counter(start, window)
            self._counters[key] = counter
            heapq.heappush(self._counter_deadlines, (start + window, key))
        return counter

    def _cap(self, share: Share, now: float) -> _Cap:
        cap = self._caps.get(share.cap)
        if cap is None:
            cap = _Cap(share)
            self._caps[share.cap] = cap
            heapq.heappush(self._cap_deadlines, (now + 2 * share.window + 1, share.cap))
        cap.roll(share, now)
        return cap

    def _expire(self, now: float) -> None:
        deadlines = self._counter_deadlines
        if deadlines and deadlines[0][0] <= now:
            self._high = max(self._high, len(self._counters))
            while deadlines and deadlines[0][0] <= now:
                _, key = heapq.heappop(deadlines)
                counter = self._counters.get(key)
                if counter is not None and counter.start + counter.window <= now:
                    del self._counters[key]
            if len(self._counters) * _SHRINK < self._high:
                # A dict never gives back the table it grew to: copy what is live into a
                # table of its size, so memory follows the live clients down after a spike.
                self._counters = dict(self._counters)
                self._high = len(self._counters)
        caps = self._cap_deadlines
        while caps and caps[0][0] <= now:
            _, key = heapq.heappop(caps)
            cap = self._caps.get(key)
            if cap is None:
                continue
            idle_until = cap.last_seen + 2 * cap.window + 1
            if idle_until <= now:
                del self._caps[key]
            else:
                heapq.heappush(caps, (idle_until, key))

    async def admit(self, plan: Plan, now: float) -> Outcome:
        self._expire(now)
        counters = [self._counter(c.key, c.window, now) for c in plan.counters]
        counts = tuple([c.count for c in counters])
        if not plan.shares:
            admitted = admits(plan, counts, (), ())
            if admitted:
                for counter, spec in zip(counters, plan.counters, strict=True):
                    counter.count += spec.hits
            return Outcome(admitted, counts, (), ())
        caps = [self._cap(s, now) for s in plan.shares]
        for cap, share in zip(caps, plan.shares, strict=True):
            cap.record(share)  # every claim first: the bounds below see this request's weight
        pairs = list(zip(caps, plan.shares, strict=True))
        shared = tuple([cap.admitted.get(s.client, 0) for cap, s in pairs])
        bounds = tuple([share_bound(s, cap.level, cap.seen_weight) for cap, s in pairs])
        admitted = admits(plan, counts, shared, bounds)
        if admitted:
            for counter, spec in zip(counters, plan.counters, strict=True):
                counter.count += spec.hits
            for cap, share in pairs:
                cap.charge(share)
        return Outcome(admitted, counts, shared, bounds)

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        return self.slots.acquire(claims, now)

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        return self.slots.release(claims, now)

    async def caps(self) -> Mapping[str, CapReport]:
        return {
            key: CapReport(key, cap.level, cap.declared, cap.report_figures())
            for key, cap in self._caps.items()
        }

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._counters.clear()
        self._caps.clear()
        self._counter_deadlines.clear()
        self._cap_deadlines.clear()
        self.slots.clear()
