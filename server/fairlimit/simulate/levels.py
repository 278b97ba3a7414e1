"""The counters a simulated request is charged at, and what max-min could admit through them.

Every counter a client's request touches is a level the run checks (route cap, tenant caps,
the client's own bucket, a global bucket). The root is the outermost limit all clients share
(``report.shared_limit``): utilisation is measured there, as admitted / achievable, where
achievable is what weighted max-min could admit given the demand, bottom-up: a client can
use ``min(demand, its own limit)``, a cap ``min(its capacity, what its children can use)``.
Limits of other windows are scaled to the root's window (their average rate).
"""

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fairlimit.core.keys import key_path
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Charge, Plan, plan
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded
from fairlimit.core.units import Shape


@dataclass(frozen=True, slots=True)
class Level:
    """One counter a client's request is charged at."""

    key: str
    rule: str  # the rule path, e.g. edge/route=api/tenant: instances of one rule share it
    limit: int
    window: int
    hits: int  # counter hits per hit of the request (two descriptors may charge it)
    index: int | None = None  # which of the rule's limits (None: a descriptor's own limit)
    shape: Shape | None = None  # calendar, sliding or gcra (None: a fixed window)


@dataclass(frozen=True, slots=True)
class Tree:
    """Each client's levels and its chain of counter keys from the root down."""

    root: str | None
    levels: tuple[tuple[Level, ...], ...]  # per client
    chains: tuple[tuple[str, ...], ...]  # per client: root first, its own counter last
    limits: Mapping[str, float]  # per key, in the root's window

    def achievable(self, demands: Sequence[float]) -> float:
        """What max-min could admit at the root for these per-client demands (root window)."""
        if self.root is None:
            return 0.0
        children: dict[str, set[str]] = defaultdict(set)
        direct: dict[str, float] = defaultdict(float)
        for chain, demand in zip(self.chains, demands, strict=True):
            for parent, child in itertools.pairwise(chain):
                children[parent].add(child)
            direct[chain[-1]] += demand
        return _usable(self.root, children, direct, self.limits)


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


def _index(charge: Charge) -> int | None:
    """Which of its rule's limits ``charge`` counts (None: the descriptor's own limit)."""
    limits = charge.rule.limits if charge.rule is not None else ()
    return next((i for i, limit in enumerate(limits) if limit is charge.limit), None)


def _levels(request_plan: Plan) -> tuple[Level, ...]:
    out: dict[str, Level] = {}
    for descriptor in request_plan.descriptors:
        for charge in descriptor.charges:
            counter = request_plan.counters[charge.counter]
            rule = _rule_of(charge, counter.key)
            out[counter.key] = Level(counter.key, rule, counter.limit, counter.window,
                                     counter.hits, _index(charge), counter.shape)  # fmt: skip
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
    return Tree(root, levels, tuple(_chain(p, root) for p in plans), limits)
