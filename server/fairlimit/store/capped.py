"""The memory store's admission of a plan with shares: each fair-share cap's verdict
(core/sharing.py) over the caps' state (store/caps.py), the counters charged as the
verdicts say. ``admit_one`` is ``admit_many`` for a plan with one share, the most common
under a cap, with the same steps in the same order and without its lists; a test holds the
two to the same answers (tests/store/test_memory_one_share.py).
"""

from collections.abc import Sequence

from fairlimit.core.admission import Outcome, above, admits, demand_seen
from fairlimit.core.plan import Plan
from fairlimit.core.sharing import Verdict, charge, enter, record, verdict
from fairlimit.store.caps import MemoryCaps
from fairlimit.store.counters import MemoryCounter, MemoryMeter
from fairlimit.store.counters import charge as charge_counters

_OUTERMOST = (-1,)  # above() of a plan with one share


def admit_many(
    fair: MemoryCaps,
    plan: Plan,
    now: float,
    counters: Sequence[MemoryCounter | MemoryMeter],
    counts: tuple[int, ...],
) -> Outcome:
    """A plan with shares: each cap's verdict, nested caps after their parents; the
    counters charged as the verdicts say (the store keeps an admitted plan's reservations)."""
    states = fair.claims(plan, now)
    shared = tuple([int(row.admitted) for _, _, row, _ in states])
    verdicts: list[Verdict] = []
    # one cap: it is outermost (above() says so too, at the cost of two lists)
    parents: Sequence[int] = above(plan) if len(plan.shares) > 1 else _OUTERMOST
    for i, (division, claim, row, clock) in enumerate(states):
        s, parent = plan.shares[i], parents[i]
        claim.nested = i in parents  # a cap over clients of its own: it paces them
        if 0 <= parent < i:  # a nested cap divides what its parent gives it
            claim.capacity = min(claim.capacity, verdicts[parent].share)
        verdicts.append(verdict(row, division, claim, clock, counts[s.total]))
    bounds = tuple([v.bound for v in verdicts])
    admitted = admits(plan, counts, shared, bounds)
    # Admitted, every level admitted: every cap sees the request as demand.
    seen = [True] * len(states) if admitted else demand_seen(plan, counts, shared, bounds)
    for (division, _, row, clock), share, demand, v in zip(
        states, plan.shares, seen, verdicts, strict=True
    ):
        if demand:
            record(row, share.hits, now)
            if v.light:
                fair.light(share, row, clock, bool(division.cold))
    # Refused, only the levels of charge_when_over_limit rules are charged (usage that
    # already happened); admitted, every level is.
    charge_counters(counters, plan, admitted, now)
    for (division, _, row, clock), share, v in zip(states, plan.shares, verdicts, strict=True):
        if admitted or share.force:
            charge(row, share.hits)
        enter(division, row, v.kind, clock)
    return Outcome(admitted, counts, shared, bounds)


def admit_one(
    fair: MemoryCaps,
    plan: Plan,
    now: float,
    counters: Sequence[MemoryCounter | MemoryMeter],
    counts: tuple[int, ...],
) -> Outcome:
    """``admit_many`` of a plan with one share (most plans with a cap): the same
    steps in the same order, without the lists (its one cap is outermost)."""
    share = plan.shares[0]
    division, claim, row, clock = fair.claim(share, now)
    had = int(row.admitted)
    v = verdict(row, division, claim, clock, counts[share.total])
    shared, bounds = (had,), (v.bound,)
    admitted = admits(plan, counts, shared, bounds)
    if admitted or demand_seen(plan, counts, shared, bounds)[0]:
        record(row, share.hits, now)
        if v.light:
            fair.light(share, row, clock, bool(division.cold))
    charge_counters(counters, plan, admitted, now)
    if admitted or share.force:
        charge(row, share.hits)
    enter(division, row, v.kind, clock)
    return Outcome(admitted, counts, shared, bounds)
