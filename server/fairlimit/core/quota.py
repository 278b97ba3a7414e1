"""RLQS assignment math: each Envoy's token bucket for a quota bucket, from reported demand.

Every Envoy stream reports, per bucket, the requests it allowed and denied since its last
report; their sum over the span is that Envoy's demand ``d_e`` for the bucket (denied
requests count: a throttled client's demand stays visible). Per bucket, ``D = sum_e d_e``.

1. At each ``fair_share`` cap over the bucket, the cap's clients share its capacity by
   weighted max-min (``fairshare.water_level``, the same water-filling as RLS): a client's
   bound is ``B = min(L, λ·w)`` and its grant ``g = min(D, B)``; a client spread over several
   buckets has them share its grant by demand. A bucket's bound is the least over its caps
   and its own limit.
2. A bucket at its bound (``D >= bound``: *bottlenecked*) has the bound split among its
   Envoys by demand, ``a_e = bound·d_e/D`` (equally when ``D = 0``: a bound below the
   headroom floors of idle Envoys), with a bucket of 0.25 s of its rate: it always has
   requests waiting, so depth would mostly be burst above its share.
3. A bucket below its bound gets, per Envoy, its demand plus headroom,
   ``a_e = d_e·(1 + HEADROOM) + HEADROOM_FLOOR``, so that it can grow (and its arrivals
   jitter) without waiting for a report; if that would pass the bound it is treated as
   bottlenecked. Where its caps have *slack*, capacity the grants leave over
   (``S = C - Σ g``, 0 at a contended cap), it gets more: each cap's slack is split by
   weight among its clients with a bucket below its bound (a client's part evenly among
   those buckets), a bucket takes the least of its parts over its caps (the whole of its
   own limit under none), and its total is ``max(Σ_e a_e, D + part)``, at most its bound;
   what that adds to rule 3 is split evenly among its Envoys. So a client back from an idle
   spell (``d = 0``, ``a_e`` about 1/s) is served up to its bound at once where nobody else
   wants the capacity, not refused until its next report is divided. Its bucket holds half
   a reporting interval of its rate, at most 1 s (as a newcomer's, step 4).
4. A bucket whose demand is not measured yet (its first report) is taken to want its bound,
   split equally among its Envoys: a newcomer is never starved while it is being measured.

So the assigned rates of a cap's buckets sum to at most ``C + H``, ``H`` the headroom: what
the measured buckets below their bound are assigned above their demand (0 when every client
is at its share). The slack only raises ``H`` by capacity nobody is granted: the sum stays
within ``C`` plus rule 3's headroom alone, and a bucket uses any of it only by raising its
demand, which the next report turns into a new λ.

What governs a bucket (its ``Target``: its own limit and the caps above it) comes from the
plan of one request in it (``target_of``), as RLS would charge it.

Past 400 lines: ``allocate`` is the reference that ``quota/division.py`` computes in arrays,
step for step, and is kept in one text to be read beside it.
"""

import enum
import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fairlimit.core.bucket import BucketKey
from fairlimit.core.fairshare import water_level
from fairlimit.core.plan import Plan

HEADROOM = 0.25  # of a below-bound bucket's demand, on top of it
HEADROOM_FLOOR = 1.0  # requests/s added per Envoy, so a tiny demand can still grow
FILL_SECONDS = 10  # Envoy reads fill_interval in whole seconds: 10 s gives 0.1/s steps
SETTLE = 0.03  # a new rate within 3% of the one in force keeps the one in force
STEP = 1000  # buckets (or holders) an ``allocation`` works through between its steps
MAX_DEPTH_SECONDS = 1.0  # a below-bound bucket holds at most this much of its rate
BOUND_DEPTH_SECONDS = 0.25  # a bucket at its bound holds this much of its rate


class Blanket(enum.Enum):
    """A strategy without counting (envoy.type.v3.RateLimitStrategy.BlanketRule)."""

    ALLOW_ALL = 0
    DENY_ALL = 1


@dataclass(frozen=True, slots=True)
class TokenBucket:
    """envoy.type.v3.TokenBucket: ``tokens_per_fill`` per ``fill_seconds``, ``max_tokens`` deep."""

    max_tokens: int
    tokens_per_fill: int
    fill_seconds: int

    @property
    def rate(self) -> float:
        return self.tokens_per_fill / self.fill_seconds


Strategy = Blanket | TokenBucket


@dataclass(frozen=True, slots=True)
class CapClaim:
    """A bucket's claim at one fair-share cap; rates per second."""

    cap: str  # the cap's counter key
    client: str
    capacity: float
    client_limit: float  # math.inf when the client level has no limit
    weight: float


@dataclass(frozen=True, slots=True)
class Target:
    """What governs a bucket: a blanket rule, or its own limit and the caps above it."""

    blanket: Blanket | None
    limit: float = math.inf  # the bucket's own limit per second
    caps: tuple[CapClaim, ...] = ()


class Holder(NamedTuple):
    """One stream's subscription to one bucket, with its last measured demand (a named
    tuple: a division makes one per stream and bucket, tens of thousands at a time)."""

    stream: int
    bucket: BucketKey
    target: Target
    demand: float | None  # requests/s allowed + denied; None before the first measurement
    interval: float  # the stream's reporting interval in seconds


@dataclass(frozen=True, slots=True)
class Allocation:
    """Every holder's strategy, and each cap's water level (for telemetry)."""

    strategies: dict[tuple[int, BucketKey], Strategy]
    levels: dict[str, float]  # λ per cap key; math.inf when uncontended
    headroom: dict[str, float]  # H per cap key: assigned rates above the grants
    extra: dict[tuple[int, BucketKey], float]  # each holder's part of H


def _wants(holders: Sequence[Holder]) -> float:
    """A bucket's demand for the caps: its reported total, or its own limit while unmeasured."""
    if any(h.demand is None for h in holders):
        return holders[0].target.limit
    return min(sum(h.demand or 0.0 for h in holders), holders[0].target.limit)


class _Caps(NamedTuple):
    """What the water-filling leaves: each bucket's bound, and per cap its level, its slack
    (the capacity granted to nobody) and its clients' buckets and weights."""

    bounds: dict[BucketKey, float]
    levels: dict[str, float]
    slack: dict[str, float]
    members: dict[str, dict[str, list[BucketKey]]]
    weights: dict[str, list[float]]  # per cap, its clients' weights in ``members``' order


def _cap_bounds(buckets: dict[BucketKey, list[Holder]]) -> Generator[None, None, _Caps]:
    """Each bucket's bound over its own limit and its caps; λ and slack per cap (in steps)."""
    wants: dict[BucketKey, float] = {}
    bounds: dict[BucketKey, float] = {}
    clients: dict[str, dict[str, list[BucketKey]]] = {}
    claims: dict[tuple[str, str], CapClaim] = {}
    for n, (key, hs) in enumerate(buckets.items(), 1):
        if not n % STEP:
            yield
        target = hs[0].target
        bounds[key] = target.limit
        if len(hs) == 1:  # _wants, for the common case of one stream
            reported = hs[0].demand
            wants[key] = target.limit if reported is None else min(reported, target.limit)
        else:
            wants[key] = _wants(hs)
        for claim in target.caps:
            members = clients.get(claim.cap)
            if members is None:
                members = clients[claim.cap] = {}
            keys = members.get(claim.client)
            if keys is None:
                members[claim.client] = [key]
                claims[(claim.cap, claim.client)] = claim
            else:
                keys.append(key)
    levels: dict[str, float] = {}
    slack: dict[str, float] = {}
    weights: dict[str, list[float]] = {}
    for cap, members in clients.items():
        yield
        names = list(members)
        demand = [sum(wants[k] for k in members[c]) for c in names]
        spec = [claims[(cap, c)] for c in names]
        weights[cap] = [s.weight for s in spec]
        level = water_level(demand, [s.client_limit for s in spec], weights[cap],
                            spec[0].capacity)  # fmt: skip
        levels[cap] = level
        slack[cap] = _slack(level, demand, spec)
        for name, total, claim in zip(names, demand, spec, strict=True):
            client_bound = min(claim.client_limit, level * claim.weight)
            keys = members[name]
            if len(keys) == 1:  # one bucket: its part is the whole (either way below)
                key = keys[0]
                bound = client_bound
                if bound < bounds[key]:
                    bounds[key] = bound
                continue
            even = total <= 0 or math.isinf(total) or math.isinf(client_bound)
            for key in keys:
                part = 1.0 / len(keys) if even else wants[key] / total
                bounds[key] = min(bounds[key], client_bound * part)
    return _Caps(bounds, levels, slack, clients, weights)


def _slack(level: float, demand: Sequence[float], spec: Sequence[CapClaim]) -> float:
    """The capacity of a cap that its grants leave over: none when it is contended (the
    water-filling grants all of it), else what the grants ``min(D, L)`` leave of it."""
    if not math.isinf(level):
        return 0.0
    granted = sum([min(d, s.client_limit) for d, s in zip(demand, spec, strict=True)])
    return max(0.0, spec[0].capacity - granted)


def _headroomed(demand: float) -> float:
    """One Envoy's rate at rule 3: its demand plus headroom."""
    return demand * (1 + HEADROOM) + HEADROOM_FLOOR


def _loose(holders: Sequence[Holder]) -> float | None:
    """A bucket's total at rule 3 (demand plus headroom per Envoy); None while unmeasured."""
    if any(h.demand is None for h in holders):
        return None
    return sum([_headroomed(h.demand or 0.0) for h in holders])


def _rooms(
    buckets: dict[BucketKey, list[Holder]], caps: _Caps
) -> Generator[None, None, dict[BucketKey, float]]:
    """Each below-bound bucket's part of the slack (its *room*, in steps): at each cap, the
    slack split by weight among the clients with a bucket below its bound, a client's part
    evenly among those buckets; the least over its caps (inf under none: its own limit is
    its only bound)."""
    room: dict[BucketKey, float] = {}
    for n, (key, hs) in enumerate(buckets.items(), 1):
        if not n % STEP:
            yield
        bound = caps.bounds[key]
        loose = _loose(hs)
        if 0 < bound < math.inf and loose is not None and loose <= bound:
            room[key] = math.inf
    for cap, members in caps.members.items():
        yield
        below = [[k for k in keys if k in room] for keys in members.values()]
        weight = sum([w for w, keys in zip(caps.weights[cap], below, strict=True) if keys])
        slack = caps.slack[cap]
        for w, keys in zip(caps.weights[cap], below, strict=True):
            for key in keys:
                room[key] = min(room[key], slack * w / weight / len(keys))
    return room


_BUCKETS: dict[tuple[int, int], TokenBucket] = {}  # made once per (depth, tokens per fill)
_BUCKETS_MAX = 65536
UINT32_MAX = 2**32 - 1  # Envoy's max_tokens and tokens_per_fill are uint32


def token_bucket(rate: float, depth: int) -> TokenBucket:
    """The token bucket closest below ``rate`` (0.1/s steps, at least one token a fill, at
    most what Envoy's uint32 fields hold: a rule past about 429.5M/s is assigned that).

    Buckets are immutable and few distinct ones recur, so each is made once (a bounded
    table, cleared when full): a division assigns tens of thousands."""
    per_fill = min(UINT32_MAX, max(1, math.floor(rate * FILL_SECONDS + 1e-9)))
    return token_shape(per_fill, min(UINT32_MAX, max(1, depth)))


def token_shape(per_fill: int, depth: int) -> TokenBucket:
    """The token bucket of ``per_fill`` tokens a fill, ``depth`` deep (both within uint32),
    made once (see ``token_bucket``)."""
    found = _BUCKETS.get((depth, per_fill))
    if found is None:
        if len(_BUCKETS) >= _BUCKETS_MAX:
            _BUCKETS.clear()
        found = _BUCKETS[(depth, per_fill)] = TokenBucket(depth, per_fill, FILL_SECONDS)
    return found


# A strategy as one integer: a blanket rule its value (0 allow all, 1 deny all), a token
# bucket tokens_per_fill << 32 | max_tokens (both at least 1, so at least 2**32), and no
# strategy yet NONE (equal to no other).
ALLOW, DENY, NONE = 0, 1, 2
TOKEN = 1 << 32


def code_of(strategy: Strategy | None) -> int:
    """``strategy`` as its code."""
    if strategy is None:
        return NONE
    if isinstance(strategy, TokenBucket):
        return strategy.tokens_per_fill << 32 | strategy.max_tokens
    return strategy.value


_BY_CODE: dict[int, Strategy] = {}  # strategy_of's, as bounded as _BUCKETS


def strategy_of(code: int) -> Strategy:
    """The strategy of a code (not NONE)."""
    found = _BY_CODE.get(code)
    if found is None:
        if len(_BY_CODE) >= _BUCKETS_MAX:
            _BY_CODE.clear()
        if code < TOKEN:
            found = _BY_CODE[code] = Blanket(code)
        else:
            found = _BY_CODE[code] = token_shape(code >> 32, code & UINT32_MAX)
    return found


def depth_of(rate: float, bottlenecked: bool, interval: float | None) -> int:
    """How many tokens a bucket holds, at least two (two requests close together both pass).

    At the bound, 0.25 s of the rate: enough that the bucket is not full while requests wait
    (a full bucket wastes its fill), little burst when Envoy refills it. Below the bound, half
    a reporting interval of the rate, at most MAX_DEPTH_SECONDS of it: a client under its
    share may burst that much (its headroom covers the refill). Unmeasured (``interval``
    None): MAX_DEPTH_SECONDS of the rate offered.
    """
    if bottlenecked:
        return max(2, math.ceil(rate * BOUND_DEPTH_SECONDS - 1e-9))
    seconds = MAX_DEPTH_SECONDS if interval is None else min(interval / 2, MAX_DEPTH_SECONDS)
    return max(2, math.ceil(rate * seconds - 1e-9))


def _bucket_strategies(
    holders: Sequence[Holder], bound: float, room: float
) -> dict[int, tuple[float, bool]]:
    """(rate, bottlenecked) per stream of one bucket under its bound, ``room`` its part of
    its caps' slack (rule 3)."""
    if len(holders) == 1:  # the common case, the same arithmetic as below
        only = holders[0]
        if only.demand is None:
            return {only.stream: (bound, False)}
        alone = _headroomed(only.demand)
        if alone <= bound:
            total = min(bound, max(alone, only.demand + room))
            return {only.stream: (alone + (total - alone), False)}
        if only.demand <= 0:
            return {only.stream: (bound, True)}
        return {only.stream: (bound * only.demand / only.demand, True)}
    if any(h.demand is None for h in holders):
        return {h.stream: (bound / len(holders), False) for h in holders}
    loose = {h.stream: _headroomed(h.demand or 0.0) for h in holders}
    total = sum([h.demand or 0.0 for h in holders])
    at_rule_3 = sum(loose.values())
    if at_rule_3 <= bound:
        # the slack's extra over rule 3, split evenly: whichever Envoy the client comes back on
        more = (min(bound, max(at_rule_3, total + room)) - at_rule_3) / len(holders)
        return {stream: (rate + more, False) for stream, rate in loose.items()}
    if total <= 0:  # a bound below the floors and no demand to split it by
        return {h.stream: (bound / len(holders), True) for h in holders}
    return {h.stream: (bound * (h.demand or 0.0) / total, True) for h in holders}


def allocate(holders: Sequence[Holder]) -> Allocation:
    """Every holder's strategy from everyone's demand (see the module docstring)."""
    steps = allocation(holders)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: Allocation = done.value
            return result


def allocation(holders: Sequence[Holder]) -> Generator[None, None, Allocation]:
    """``allocate`` in steps of about STEP buckets (or holders, or a cap's water level),
    so that a caller on an event loop can let it turn between them; returns the Allocation.
    """
    buckets: dict[BucketKey, list[Holder]] = {}
    blanket: dict[tuple[int, BucketKey], Strategy] = {}
    for n, holder in enumerate(holders, 1):
        if not n % STEP:
            yield
        if holder.target.blanket is not None:
            blanket[(holder.stream, holder.bucket)] = holder.target.blanket
        else:
            buckets.setdefault(holder.bucket, []).append(holder)
    caps = yield from _cap_bounds(buckets)
    bounds, levels = caps.bounds, caps.levels
    rooms = yield from _rooms(buckets, caps)
    strategies = dict(blanket)
    headroom: dict[str, float] = {cap: 0.0 for cap in levels}
    extra: dict[tuple[int, BucketKey], float] = {}
    for n, (key, hs) in enumerate(buckets.items(), 1):
        if not n % STEP:
            yield
        bound = bounds[key]
        if bound <= 0:
            strategies.update({(h.stream, key): Blanket.DENY_ALL for h in hs})
            continue
        if math.isinf(bound):
            strategies.update({(h.stream, key): Blanket.ALLOW_ALL for h in hs})
            continue
        rates = _bucket_strategies(hs, bound, rooms.get(key, 0.0))
        # a measured bucket below its bound (held at it by its headroom, or not) is assigned
        # above its grant, its demand: that is its headroom
        measured = all(h.demand is not None for h in hs)
        short = measured and sum([h.demand or 0.0 for h in hs]) < bound
        for h in hs:
            rate, bottlenecked = rates[h.stream]
            depth = depth_of(rate, bottlenecked, None if h.demand is None else h.interval)
            strategies[(h.stream, key)] = token_bucket(rate, depth)
            if short:
                extra[(h.stream, key)] = rate - (h.demand or 0.0)
                for claim in h.target.caps:
                    headroom[claim.cap] += rate - (h.demand or 0.0)
    return Allocation(strategies, levels, headroom, extra)


class Regions:
    """Which buckets share a division: those linked by a cap (union-find over cap keys).

    A bucket's assignment depends only on the buckets of its region (the caps above it,
    every bucket under those caps, and so on through nested caps), so a report need only
    re-divide the regions of the buckets it changed. A bucket under no cap is a region of
    its own."""

    __slots__ = ("_parent",)

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def _find(self, cap: str) -> str:
        parent = self._parent
        root = parent.setdefault(cap, cap)
        while parent[root] != root:
            root = parent[root]
        while parent[cap] != root:  # path compression
            parent[cap], cap = root, parent[cap]
        return root

    def add(self, target: Target) -> None:
        """Link the caps of ``target``."""
        caps = target.caps
        if len(caps) > 1:
            first = self._find(caps[0].cap)
            for claim in caps[1:]:
                other = self._find(claim.cap)
                if other != first:
                    self._parent[other] = first

    def root(self, handle: object) -> object:
        """A region as ``of`` gave it, after the links made since."""
        return self._find(handle) if isinstance(handle, str) else handle

    @staticmethod
    def handle(key: BucketKey, target: Target) -> object:
        """The region of bucket ``key`` governed by ``target``, to be rooted (``root``)
        later: marking a report's every bucket costs no lookup."""
        if target.blanket is not None or not target.caps:
            return key
        return target.caps[0].cap

    def of(self, key: BucketKey, target: Target) -> object:
        """The region of bucket ``key`` governed by ``target`` (added first)."""
        if target.blanket is not None or not target.caps:
            return key
        return self._find(target.caps[0].cap)


def provisional(target: Target, levels: Mapping[str, float], holders: int) -> Strategy:
    """A new bucket's strategy until the next division: its bound under the levels in force
    (a cap not divided yet offers its capacity), split among the ``holders`` streams holding
    it, as for an unmeasured bucket (step 4)."""
    if target.blanket is not None:
        return target.blanket
    bound = target.limit
    for claim in target.caps:
        level = levels.get(claim.cap)
        share = claim.capacity if level is None else level * claim.weight
        bound = min(bound, claim.client_limit, share)
    if bound <= 0:
        return Blanket.DENY_ALL
    if math.isinf(bound):
        return Blanket.ALLOW_ALL
    rate = bound / max(1, holders)
    return token_bucket(rate, depth_of(rate, False, None))


def settle(current: Strategy | None, new: Strategy) -> Strategy:
    """The strategy to send: ``current`` when ``new`` is within SETTLE of it.

    Envoy refills a token bucket whenever its parameters change, so a rate that jitters
    with the reports would hand out a bucket of burst each time; a steady one changes nothing.
    """
    if current is new:  # token_bucket hands out one object per bucket shape
        return new
    if not (isinstance(current, TokenBucket) and isinstance(new, TokenBucket)):
        return new
    return current if abs(new.rate - current.rate) <= SETTLE * current.rate else new


def most(strategy: Strategy) -> tuple[float, int]:
    """(rate, depth): the most ``strategy`` lets through; a blanket rule, without bound."""
    if isinstance(strategy, TokenBucket):
        return strategy.rate, strategy.max_tokens
    return math.inf, 0


def target_of(plan: Plan) -> Target:
    """What governs a bucket, from the plan of one request in it: its own limit (per
    second) and the fair-share caps above it; shadow-mode levels restrict nothing."""
    dplan = plan.descriptors[0]
    if dplan.unlimited or not dplan.charges:
        return Target(Blanket.ALLOW_ALL)
    limit = math.inf
    caps: list[CapClaim] = []
    for charge in dplan.charges:
        counter = plan.counters[charge.counter]
        if charge.share is None:
            if not counter.shadow:
                limit = min(limit, counter.limit / counter.window)
            continue
        share = plan.shares[charge.share]
        if share.shadow:
            continue
        per = share.window
        caps.append(CapClaim(share.cap, share.client, share.capacity / per,
                             share.client_limit / per, share.weight))  # fmt: skip
    if limit <= 0 or any(c.capacity <= 0 for c in caps):
        return Target(Blanket.DENY_ALL)
    if math.isinf(limit) and not caps:
        return Target(Blanket.ALLOW_ALL)
    return Target(None, limit, tuple(caps))
