"""``--failure-mode local``: what a process decides alone while the shared store is away.

``Replicas`` (store/replicas.py) says how many processes share the store and this one's
place among them. While the store answers, ``LocalLimits.saw`` keeps the count it showed of
each counter this window. Once it fails, a MemoryStore of this process decides: each plan
``core.parts.scaled`` to this process's part, each counter starting the window at the count
last seen (so a window the outage cuts in two does not start again from zero here). What it
admitted (or charged by ``charge_when_over_limit``) is kept by plan, and when the store
answers again it is written back (``pay``): every level of the plan charged with those hits
as a shadow level (shadow levels never refuse, so the store charges them all), in the
windows still running. Then the local state is dropped: the shared counters hold the
outage's admissions and decide again. A write-back that fails is kept for the next time the
store answers.
"""

import asyncio
import dataclasses
from collections.abc import Sequence

from fairlimit.core.admission import Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.lease import shape
from fairlimit.core.parts import part, scaled, scaled_claims
from fairlimit.core.plan import Counter, Plan
from fairlimit.core.units import bounds, window_start
from fairlimit.errors import StoreUnavailable
from fairlimit.store.base import Store
from fairlimit.store.deadline import DEADLINE
from fairlimit.store.memory import MemoryStore
from fairlimit.store.replicas import Replicas

SEEN_KEPT = 10_000  # counters seen before the table of last-seen counts is first pruned
PAYING = 32  # write-back calls out at once


@dataclasses.dataclass(slots=True)
class _Owed:
    """What this process charged locally under one plan shape, per level: [window start,
    hits] (the first plan of the shape gives the keys and levels)."""

    plan: Plan
    counters: list[list[int]]
    shares: list[list[int]]


def _add(levels: list[list[int]], at: int, start: int, hits: int) -> None:
    level = levels[at]
    if level[0] == start:
        level[1] += hits
    elif level[0] < start:  # a later window: what the one before owed is past paying
        level[0], level[1] = start, hits


def _merge(into: _Owed, back: _Owed) -> None:
    for levels, old in ((into.counters, back.counters), (into.shares, back.shares)):
        for at, (start, hits) in enumerate(old):
            _add(levels, at, start, hits)


def _payment(owed: _Owed, now: float) -> Plan | None:
    """The plan that charges ``owed``'s hits of the windows still running at ``now`` at every
    level, all levels shadow (admitted whatever the counts), or None when nothing is due."""
    due = False
    counters: list[Counter] = []
    for c, (start, hits) in zip(owed.plan.counters, owed.counters, strict=True):
        hits = hits if start == bounds(c.window, c.shape, now)[0] else 0
        due = due or hits > 0
        counters.append(Counter(c.key, c.limit, c.window, hits, True, False, c.shape))
    shares = []
    for s, (start, hits) in zip(owed.plan.shares, owed.shares, strict=True):
        hits = hits if start == window_start(s.window, now) else 0
        shares.append(dataclasses.replace(s, hits=hits, shadow=True, force=False))
    return Plan(owed.plan.descriptors, tuple(counters), tuple(shares)) if due else None


class LocalLimits:
    """The last counts the store showed, and this process's own limits while it is away."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self._seen: dict[str, tuple[int, int, int]] = {}  # key -> (start, end, count)
        self._seen_prune = SEEN_KEPT
        self._store: MemoryStore | None = None
        self._place = (1, 0)
        self._owed: dict[tuple[str, ...], _Owed] = {}
        self.since = 0.0  # when this process started deciding alone
        self.decisions = 0  # decided here since then
        self.admitted = 0
        self.returned_at: float | None = None  # when the store answered again (limiter's)
        self.paid = 0  # plans written back since then
        self.paid_at = 0.0  # when the last write-back was done (limiter's clock)

    @property
    def active(self) -> bool:
        """Whether this process limits alone (from a failure until the write-back is done)."""
        return self._store is not None

    @property
    def place(self) -> tuple[int, int]:
        """(processes, this one's index) while active."""
        return self._place

    @property
    def owes(self) -> bool:
        return bool(self._owed)

    def saw(self, plan: Plan, outcome: Outcome, now: float) -> None:
        """Keep what the store's answer to ``plan`` showed of each counter at ``now``."""
        seen = self._seen
        charged = outcome.admitted
        for c, count in zip(plan.counters, outcome.counts, strict=True):
            if charged or c.force:
                count += c.hits
            start, end = bounds(c.window, c.shape, now)
            known = seen.get(c.key)
            if known is None or known[0] < start or (known[0] == start and known[2] < count):
                seen[c.key] = (start, end, count)
        if len(seen) > self._seen_prune:
            self._seen = {k: v for k, v in seen.items() if v[1] > now}
            self._seen_prune = max(SEEN_KEPT, 2 * len(self._seen))

    def _seed(self, key: str, start: int) -> int:
        known = self._seen.get(key)
        return known[2] if known is not None and known[0] == start else 0

    def begin(self, now: float) -> None:
        """Start deciding alone, at this process's place as last known."""
        self._place = self.replicas.place()
        self._store = MemoryStore(seed=self._seed)
        self.since, self.decisions, self.admitted = now, 0, 0
        self.returned_at, self.paid, self.paid_at = None, 0, now

    def end(self) -> None:
        """Drop the local state (the store is back and holds what was admitted here)."""
        self._store = None
        self._owed = {}
        self.returned_at = None

    def part_of(self, limit: int) -> int:
        """This process's part of ``limit`` while active."""
        return part(limit, *self._place)

    async def admit(self, plan: Plan, now: float) -> tuple[Outcome, Plan]:
        """``plan`` decided here: the outcome and the scaled plan it is an outcome of."""
        if self._store is None:
            self.begin(now)
        assert self._store is not None
        local = scaled(plan, *self._place)
        outcome = await self._store.admit(local, now)
        outcome.now = now  # decided at ``now``: the statuses' reset counts from it
        self.decisions += 1
        self.admitted += outcome.admitted
        self._owe(plan, outcome.admitted, now)
        return outcome, local

    async def check(self, plan: Plan, now: float) -> tuple[Outcome, Plan] | None:
        """While the store is back but the others may not be yet: None when ``plan`` fits in
        this process's part (charged here, not owed: the store is asked next and charges
        it), else the refusal (charged here as any refusal is)."""
        assert self._store is not None
        local = scaled(plan, *self._place)
        outcome = await self._store.admit(local, now)
        if outcome.admitted:
            return None
        self.decisions += 1
        return outcome, local

    def _owe(self, plan: Plan, admitted: bool, now: float) -> None:
        key = shape(plan)
        owed = self._owed.get(key)
        if owed is None:
            owed = self._owed[key] = _Owed(
                plan, [[0, 0] for _ in plan.counters], [[0, 0] for _ in plan.shares]
            )
        for at, c in enumerate(plan.counters):
            if admitted or c.force:
                _add(owed.counters, at, bounds(c.window, c.shape, now)[0], c.hits)
        for at, s in enumerate(plan.shares):
            if admitted or s.force:
                _add(owed.shares, at, window_start(s.window, now), s.hits)

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        """Slots taken here, in pools of this process's part."""
        if self._store is None:
            self.begin(now)
        assert self._store is not None
        return await self._store.acquire(scaled_claims(claims, *self._place), now)

    async def release(self, claims: Sequence[Claim], now: float) -> None:
        """Give back slots taken here (none while not active)."""
        if self._store is not None:
            await self._store.release(claims, now)

    async def pay(self, store: Store, now: float) -> StoreUnavailable | None:
        """Write what was charged here into ``store`` (the windows still running at
        ``now``); returns the first failure. What a failed call owed is owed again (with
        what is charged here meanwhile)."""
        owed, self._owed = self._owed, {}
        due = [(k, o, p) for k, o in owed.items() if (p := _payment(o, now)) is not None]
        token = DEADLINE.set(None)  # a background task: no caller's deadline bounds it
        gate = asyncio.Semaphore(PAYING)

        async def one(payment: Plan) -> None:
            async with gate:
                await store.admit(payment, now)

        try:
            results = await asyncio.gather(*(one(p) for _, _, p in due), return_exceptions=True)
        finally:
            DEADLINE.reset(token)
        failed = None
        for (key, o, _), result in zip(due, results, strict=True):
            if result is None:
                self.paid += 1
                continue
            if not isinstance(result, StoreUnavailable):
                raise result
            failed = failed or result
            again = self._owed.get(key)
            if again is None:
                self._owed[key] = o
            else:
                _merge(again, o)
        return failed
