"""The counters a simulated request is charged at, and what max-min could admit through them.

Every counter a client's request touches is a level the run checks (route cap, tenant caps,
the client's own bucket, a global bucket). The root is the outermost limit all clients share
(``report.shared_limit``): utilisation is measured there, as admitted / achievable, where
achievable is what weighted max-min could admit given the demand, bottom-up: a client can
use ``min(demand, its own limit)``, a cap ``min(its capacity, what its children can use)``.
Limits of shorter windows are scaled to the root's window (their average rate); a longer
fixed or sliding limit bounds a root window by what is left of it at the window's start (in
its own window, or in the last window's length), a GCRA limit by what its bucket holds then
and refills within the window (a bucket of ``burst + 1`` filling at the limit's rate,
replayed from what it admitted).
"""

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fairlimit.core.keys import key_path
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Charge, Plan, plan
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded, RateLimit
from fairlimit.core.units import Algorithm, Shape, bounds


@dataclass(frozen=True, slots=True)
class Level:
    """One counter a client's request is charged at."""

    key: str
    rule: str  # the rule path, e.g. edge/route=api/tenant: instances of one rule share it
    limit: int
    window: int
    hits: int  # counter hits per hit of the request (two descriptors may charge it)
    shape: Shape | None = None  # calendar windows, sliding or GCRA (None: a fixed window)
    index: int | None = None  # which of the rule's rate_limits (None: the rule has one)

    @property
    def name(self) -> str:
        """The rule's path, and ``rate_limits[i]`` when the rule has several limits."""
        return self.rule if self.index is None else f"{self.rule} rate_limits[{self.index}]"

    @property
    def algorithm(self) -> Algorithm:
        return Algorithm.FIXED if self.shape is None else self.shape.algorithm

    @property
    def burst(self) -> int:
        """GCRA's hits beyond the limit in one window (0 for the others)."""
        return 0 if self.shape is None else self.shape.burst


@dataclass(frozen=True, slots=True)
class Tree:
    """Each client's levels and its chain of counter keys from the root down."""

    root: str | None
    levels: tuple[tuple[Level, ...], ...]  # per client
    chains: tuple[tuple[str, ...], ...]  # per client: root first, its own counter last
    limits: Mapping[str, float]  # per key, in the root's window
    # per key of a fixed or sliding limit longer than the root's: (its limit, its window,
    # sliding): what is left of it bounds a root window (scaled to its average rate, a
    # month's limit would bind every second to a 30th of a day's)
    longer: Mapping[str, tuple[int, int, bool]] = field(default_factory=dict)
    # per key of a GCRA limit below the root: (its limit, its window, its burst): what its
    # bucket holds at a root window's start and its refill over the window bound it
    paced: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)

    def achievable(
        self, demands: Sequence[float], left: Mapping[str, float] | None = None
    ) -> float:
        """What max-min could admit at the root for these per-client demands (root window),
        with ``left`` of each longer limit still open at the window's start."""
        if self.root is None:
            return 0.0
        limits = {**self.limits, **(left or {})}
        children: dict[str, set[str]] = defaultdict(set)
        direct: dict[str, float] = defaultdict(float)
        for chain, demand in zip(self.chains, demands, strict=True):
            for parent, child in itertools.pairwise(chain):
                children[parent].add(child)
            direct[chain[-1]] += demand
        return _usable(self.root, children, direct, limits)


def _usable(
    key: str,
    children: Mapping[str, set[str]],
    direct: Mapping[str, float],
    limits: Mapping[str, float],
) -> float:
    below = direct.get(key, 0.0) + sum(
        _usable(child, children, direct, limits) for child in children.get(key, ())
    )
    return min(limits.get(key, math.inf), below)


def _rule_of(charge: Charge, key: str) -> str:
    return charge.rule.path if charge.rule is not None else key_path(key)


def _limit_of(charge: Charge) -> int | None:
    """Which of its rule's ``rate_limits`` the charge is (None: the rule has one limit)."""
    limits = charge.rule.limits if charge.rule is not None else ()
    return limits.index(charge.limit) if len(limits) > 1 and charge.limit in limits else None


def _levels(request_plan: Plan) -> tuple[Level, ...]:
    out: dict[str, Level] = {}
    for descriptor in request_plan.descriptors:
        for charge in descriptor.charges:
            counter = request_plan.counters[charge.counter]
            rule = _rule_of(charge, counter.key)
            out[counter.key] = Level(
                counter.key, rule, counter.limit, counter.window, counter.hits,
                counter.shape, _limit_of(charge),
            )  # fmt: skip
    return tuple(out.values())


def _chain(request_plan: Plan, root: str) -> tuple[str, ...]:
    """The request's counter keys from ``root`` down to its own (caps outermost first)."""
    for descriptor in request_plan.descriptors:
        caps = [c for c in descriptor.charges if c.share is not None]
        own = [c for c in descriptor.charges if c.share is None]
        keys = [request_plan.counters[c.counter].key for c in caps + own]
        if root in keys:
            return tuple(keys[keys.index(root) :])
    return (root,)


def tree(loaded: Loaded, requests: Sequence[Request], root: str | None) -> Tree:
    """The levels of ``requests`` under ``loaded``, rooted at the shared limit ``root``."""
    matcher = Matcher(loaded.config)
    plans = [plan(r, matcher) for r in requests]
    levels = tuple(_levels(p) for p in plans)
    if root is None:
        return Tree(None, levels, tuple(() for _ in plans), {})
    window = next(lv.window for lv in levels[0] if lv.key == root)
    limits = {lv.key: lv.limit * window / lv.window for per in levels for lv in per}
    longer = {
        lv.key: (lv.limit, lv.window, lv.algorithm is Algorithm.SLIDING)
        for per in levels
        for lv in per
        if lv.window > window and lv.algorithm is not Algorithm.GCRA
    }
    paced = {
        lv.key: (lv.limit, lv.window, lv.burst)
        for per in levels
        for lv in per
        if lv.key != root and lv.algorithm is Algorithm.GCRA
    }
    return Tree(root, levels, tuple(_chain(p, root) for p in plans), limits, longer, paced)


def most_between(limits: Sequence[RateLimit], start: float, end: float) -> float:
    """The most hits ``limits`` together admit one client from ``start`` to ``end``."""
    return min((_most_between(limit, start, end) for limit in limits), default=math.inf)


def _most_between(limit: RateLimit, start: float, end: float) -> float:
    if limit.unlimited:
        return math.inf
    count, window, shape = limit.requests_per_unit, limit.window, limit.shape
    span = end - start
    if shape is not None and shape.algorithm is Algorithm.GCRA:
        return shape.burst + math.ceil(count * span / window)
    if shape is not None and shape.algorithm is Algorithm.SLIDING:
        return count * math.ceil(span / window)
    met, at = 0, start  # the fixed windows (epoch-aligned or civil) the span meets
    while at < end:
        at = bounds(window, shape, at)[1]
        met += 1
    return count * met
