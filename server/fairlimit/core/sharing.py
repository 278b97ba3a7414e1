"""Fairness v2 at a cap: client rows, the period computation, and the per-request rule.

The memory store keeps these values in objects, the Redis script in hash fields; both run the
same closed forms (admit.lua mirrors this module line by line), so both give the same doubles.

Per client a ``Row``: what it was admitted and asked this window (``a``, ``d``), its demand
history (``r`` an EWMA per period, ``q`` the last period's demand), and what it did this
period. Rows are folded lazily, on a client's first touch in a period (``fold``).

Once per period P a cap computes, from every row, the level λ of the *window*: each client's
predicted window demand is its demand so far plus its rate times what is left of the window;
``period_level`` water-fills the capacity over those and sums the reservations R (what each
client may still take within its plan). Per request (``verdict``) a client is admitted within
its plan, paced by the elapsed part of the window when the cap is contended, or else from the
spare: capacity no reservation holds, released linearly over the rest of the window when its
owners do not show up, split by weight among the clients asking for it. See docs/fairness.md.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

from fairlimit.core.fairshare import PeriodDemand, water_level

ALPHA = 0.5  # EWMA weight of the last period's demand
STALE = 64  # periods after which a row's history counts as gone (0.5^64 ~ 5e-20)
EPSILON = 1e-9


class Row:
    """One client at one cap (amounts in hits; ``limit`` and ``weight`` as last seen)."""

    __slots__ = (
        *("a", "d", "dk", "limit", "oo", "pa", "pd", "pk"),
        *("q", "qa", "r", "sp", "weight", "ws"),
    )

    def __init__(self, limit: float, weight: float) -> None:
        self.ws = -1  # the window start a and d belong to
        self.a = self.d = 0.0
        self.pk = -1  # the period pd, pa, sp, oo belong to
        self.pd = self.pa = self.oo = 0.0
        self.sp = 0  # 1 once the client asked for spare this period
        self.r = self.q = self.qa = self.dk = 0.0
        self.limit, self.weight = limit, weight


def history(row: Row, period: int, start: int) -> tuple[float, float, float, float, float]:
    """The row's (r, q, qa, d, a) once folded to ``period`` of the window at ``start``."""
    if row.pk >= period:
        return row.r, row.q, row.qa, row.d, row.a
    gap = period - row.pk
    if gap > STALE:
        r = q = qa = 0.0
    else:
        q, qa = (row.pd, row.pa) if gap == 1 else (0.0, 0.0)
        r = (ALPHA * row.pd + (1 - ALPHA) * row.r) * (1 - ALPHA) ** (gap - 1)
    if row.ws != start:
        return r, q, qa, 0.0, 0.0
    return r, q, qa, row.d, row.a


def fold(row: Row, period: int, start: int) -> bool:
    """Move ``row`` to ``period`` (window ``start``); True on its first touch in the period."""
    if row.pk >= period:
        return False
    row.r, row.q, row.qa, row.d, row.a = history(row, period, start)
    row.pd = row.pa = row.oo = 0.0
    row.sp, row.pk, row.ws = 0, period, start
    row.dk = row.d
    return True


class Clock:
    """Where ``now`` sits for a cap of ``window`` s: period index, window start, φ.

    A plain slotted class, worked out once: one is made per claim of every request.
    """

    __slots__ = ("now", "period", "period_len", "start", "window")

    def __init__(self, window: int, period_len: float, now: float) -> None:
        self.window, self.period_len, self.now = window, period_len, now
        self.period = math.floor(now / period_len)
        self.start = math.floor(now / window) * window

    @property
    def elapsed(self) -> float:
        """φ: the part of the window open by the end of the current period (one P of slack)."""
        return min(1.0, (self.now - self.start + self.period_len) / self.window)

    @property
    def left(self) -> float:
        """The part of what was left of the window at the period's start that is still left."""
        end = self.start + self.window
        return (end - self.now) / (end - self.period * self.period_len)


def predicted(dk: float, r: float, q: float, clock: Clock) -> float:
    """Window demand: ``dk`` so far plus the rate (the largest of the EWMA ``r``, the last
    period's ``q`` and the window's own average) times the periods left."""
    begun = clock.period * clock.period_len
    done = math.floor((begun - clock.start) / clock.period_len + 0.5)
    rate = max(r, q, dk / done if done else 0.0)
    return dk + rate * (clock.start + clock.window - begun) / clock.period_len


def allowance(demand: float, limit: float, share: float) -> float:
    """What a plan lets a client take this window: its predicted demand rounded up (a
    sparse client keeps its next request), its limit, and its share λ·w rounded down."""
    want = float(math.ceil(min(demand, limit) - EPSILON))
    return want if share == math.inf else min(want, float(math.floor(share + EPSILON)))


@dataclass(frozen=True, slots=True)
class PeriodLevel:
    """λ for a period (None: cold start, inf: uncontended), the reservations R and how many
    clients hold one (each keeps a hit of it until the window ends, seen or not)."""

    level: float | None
    reserved: float
    holders: int = 0


def period_level(rows: Iterable[Row], capacity: float, clock: Clock) -> PeriodLevel:
    """Water-fill ``capacity`` over the rows' predicted window demand (rows are not changed).

    Rows with no history and no demand this window take no part. O(n log n); the loop
    inlines ``history`` and ``predicted`` (same operations in the same order, so the same
    doubles): at 100k clients a function call per row is a third of the time.
    """
    period, start, length = clock.period, clock.start, clock.period_len
    begun = period * length
    done = math.floor((begun - start) / length + 0.5)
    span = start + clock.window - begun
    keep = 1 - ALPHA
    demands: list[float] = []
    limits: list[float] = []
    weights: list[float] = []
    admitted: list[float] = []
    add_demand, add_limit = demands.append, limits.append
    add_weight, add_admitted = weights.append, admitted.append
    previous = period - 1
    for row in rows:
        pk = row.pk
        if pk == previous:  # the common case: the row was touched last period
            q = row.pd
            r = ALPHA * q + keep * row.r
        elif pk >= period:
            r, q = row.r, row.q
        elif period - pk > STALE:
            r = q = 0.0
        else:
            q = 0.0
            r = (ALPHA * row.pd + keep * row.r) * keep ** (period - pk - 1)
        if pk >= period or row.ws == start:
            d, a = row.d, row.a
        else:
            d = a = 0.0
        rate = r if r > q else q
        if done and d:
            average = d / done
            rate = average if average > rate else rate
        elif not rate and not d:
            continue
        # whole hits, rounded up as ``allowance`` rounds a plan (so λ leaves room for them):
        # -((ε - x) // 1) is ceil(x - ε) as a float, without a call per row
        add_demand(-((EPSILON - (d + rate * span / length)) // 1))
        add_limit(row.limit)
        add_weight(row.weight)
        add_admitted(a)
    if not demands:
        return PeriodLevel(None, 0.0)
    level = water_level(demands, limits, weights, capacity)
    return PeriodLevel(level, *_reserved(demands, limits, weights, admitted, level))


def _reserved(
    demands: list[float],
    limits: list[float],
    weights: list[float],
    admitted: list[float],
    level: float,
) -> tuple[float, int]:
    """(R, holders): Σ max(0, allowance - admitted), allowance as in ``allowance``
    (inlined), and the number of clients with some of it."""
    ceil, floor = math.ceil, math.floor
    pairs = zip(demands, limits, strict=True)  # demands are whole already
    wants = [d if d < lim else ceil(lim - EPSILON) for d, lim in pairs]
    if level != math.inf:
        shares = [floor(level * w + EPSILON) for w in weights]
        wants = [w if w < s else s for w, s in zip(wants, shares, strict=True)]
    held = [w - a for w, a in zip(wants, admitted, strict=True) if w > a]
    return float(sum(held)), len(held)


def last_period(rows: Iterable[Row], capacity: float, clock: Clock) -> PeriodDemand | None:
    """The period before ``clock``'s: each client's demand and admissions, for the fairness
    figures (kept out of ``period_level``: telemetry asks for it far less often)."""
    demand: list[float] = []
    admitted: list[float] = []
    limits: list[float] = []
    weights: list[float] = []
    for row in rows:
        _, q, qa, _, _ = history(row, clock.period, clock.start)
        if q > 0:
            demand.append(q)
            admitted.append(qa)
            limits.append(row.limit)
            weights.append(row.weight)
    if not demand:
        return None
    scale = clock.window / clock.period_len
    return PeriodDemand(capacity, scale, demand, admitted, limits, weights)


class CapPeriod:
    """A cap's figures for one period: λ and R, and what happened since it began."""

    __slots__ = (
        *("holders", "level", "over", "period", "reserved", "seen_holders"),
        *("seen_reserved", "seen_weight", "spare_weight", "used"),
    )

    def __init__(self, period: int, level: PeriodLevel) -> None:
        self.period = period
        self.level, self.reserved, self.holders = level.level, level.reserved, level.holders
        self.seen_holders = 0  # holders seen this period
        self.seen_reserved = 0.0  # R of the clients seen this period (kept until used)
        self.used = 0.0  # hits admitted within plans this period
        self.over = 0.0  # hits admitted from the spare this period
        self.spare_weight = 0.0  # weights of the clients that asked for spare
        self.seen_weight = 0.0  # weights of the clients seen (the cold-start split)


class ShareClaim:
    """One client's claim at a cap: what it asks and what bounds it (made per request, so
    slotted and not frozen)."""

    __slots__ = ("capacity", "declared", "hits", "limit", "sized", "weight")

    def __init__(
        self, hits: int, limit: float, weight: float, capacity: float, declared: int, sized: bool
    ) -> None:
        self.hits, self.limit, self.weight = hits, limit, weight
        self.capacity = capacity
        self.declared = declared  # active_clients
        self.sized = sized  # capacity >= active_clients x limit: never paced


def plan_of(row: Row, cap: CapPeriod, claim: ShareClaim, clock: Clock) -> float:
    """What the row may take within its plan this window (0 without λ)."""
    if cap.level is None:
        return 0.0
    demand = predicted(row.dk, row.r, row.q, clock)
    return allowance(demand, claim.limit, cap.level * claim.weight)


def touch(row: Row, cap: CapPeriod, claim: ShareClaim, clock: Clock) -> None:
    """A client's first touch in the period: its reservation and weight count as seen."""
    held = plan_of(row, cap, claim, clock) - row.a
    if held > 0:
        cap.seen_reserved += held
        cap.seen_holders += 1
    cap.seen_weight += claim.weight


def verdict(
    row: Row, cap: CapPeriod, claim: ShareClaim, total: int, clock: Clock
) -> tuple[float, bool]:
    """(bound, within): the most the client may hold after this request, and whether the
    request falls within its plan (else it draws on the spare). Registers a spare asker."""
    h, limit, capacity = max(claim.hits, 1), claim.limit, claim.capacity
    phi = 1.0 if claim.sized else clock.elapsed
    if cap.level is None:  # cold start: split by weight among max(clients seen, declared)
        cold = capacity * claim.weight / max(cap.seen_weight, claim.declared)
        return min(limit, cold * phi), True
    fair = limit if cap.level == math.inf else min(limit, cap.level * claim.weight * phi)
    plan = plan_of(row, cap, claim, clock)
    # Within its plan while below it: a request of many hits (tokens) may end past the plan
    # by less than itself, as a sparse client's next request must not wait for the spare.
    if row.a + 1 <= plan and row.a + h <= fair + EPSILON:
        return fair, True
    if not row.sp:
        row.sp = 1
        cap.spare_weight += claim.weight
    # Seen clients keep their reservations until used; the others' is released linearly,
    # but for one hit each: a sparse client's next request finds its place at any instant.
    unseen = max(0.0, cap.reserved - cap.seen_reserved)
    kept = min(unseen, max(unseen * clock.left, float(cap.holders - cap.seen_holders)))
    reserved = max(0.0, cap.seen_reserved - cap.used) + kept
    pace = capacity * phi
    spare = total + h <= min(capacity - reserved, pace) + EPSILON
    pool = cap.over + capacity - reserved - total
    if spare and row.oo + h <= pool * claim.weight / cap.spare_weight + 1 + EPSILON:
        return limit, False
    return min(fair, max(plan, row.a)), False


def charge(row: Row, cap: CapPeriod, hits: int, within: bool) -> None:
    """Count admitted hits in the row and the period's use of plans or of the spare."""
    row.a += hits
    row.pa += hits
    if within:
        cap.used += hits
    else:
        cap.over += hits
        row.oo += hits


def record(row: Row, hits: int) -> None:
    """Count demand (hits asked, admitted or not)."""
    row.d += hits
    row.pd += hits
