"""A plan's replies, one per slot group, put together: the outcome, and what the over-limit
cache and the cap registry need."""

from collections.abc import Sequence
from dataclasses import dataclass

from fairlimit.core.admission import Outcome
from fairlimit.core.plan import Plan
from fairlimit.core.units import Algorithm, bounds
from fairlimit.store.redis.keys import SlotGroup
from fairlimit.store.redis.script import Seen


@dataclass(slots=True)
class Combined:
    """A plan's replies put together: the outcome and what the cache and registry need."""

    outcome: Outcome
    counter_left: list[float]  # seconds until each counter's window ends (store clock)
    rolled: list[str]  # meta keys of caps whose division was written


def combine(
    plan: Plan, groups: Sequence[SlotGroup], seen: Sequence[Seen], admitted: bool
) -> Combined:
    n, k = len(plan.counters), len(plan.shares)
    counts, counter_left, full_at = [0] * n, [0.0] * n, [0.0] * n
    shared, claimed = [0] * k, [0.0] * k
    rolled: list[str] = []
    for g, s in zip(groups, seen, strict=True):
        for pos, i in enumerate(g.counters):
            c = plan.counters[i]
            counts[i] = s.counts[pos]
            # a charge is taken back (release.lua) when another group refused the request
            full_at[i] = (s.full_at if admitted or c.force else s.full_before)[pos]
            # a sliding or GCRA count falls with time alone: the over-limit cache keeps none
            if c.shape is None or c.shape.algorithm is Algorithm.FIXED:
                counter_left[i] = bounds(c.window, c.shape, s.now)[1] - s.now
        for pos, i in enumerate(g.shares):
            shared[i], claimed[i] = s.shared[pos], s.bounds[pos]
        rolled.extend(g.cap_keys[j]["meta"] for j in s.rolled)
    clock = seen[0].now if seen else None  # Redis TIME: resets agree across replicas
    outcome = Outcome(admitted, tuple(counts), tuple(shared), tuple(claimed), clock)
    if any(c.shape is not None for c in plan.counters):
        outcome.full_at = tuple(full_at)
    return Combined(outcome, counter_left, rolled)
