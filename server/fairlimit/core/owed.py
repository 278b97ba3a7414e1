"""Refused hits on their way: a consumer's debts to the store's forced counters.

Where a refused request still counts (``charge_when_over_limit``), a refusal the consumer
answers itself, from what it knows of a counter (the over-limit cache), admits nothing and
charges its forced counters; their hits travel with the consumer and reach the store with
a later call (core/lease.py says when), in the window they were refused in.
"""

from dataclasses import dataclass

from fairlimit.core.plan import Counter, Plan
from fairlimit.core.units import bounds


@dataclass(slots=True)
class Debt:
    """Refused hits one forced counter owes the store, in one of its windows."""

    plan: Plan  # a plan that charged it (its keys name the counter at the store)
    index: int  # the counter's index in ``plan.counters``
    hits: int
    start: float  # the start of the window the hits were refused in (store clock)

    @property
    def counter(self) -> Counter:
        return self.plan.counters[self.index]


class Owed:
    """The refused hits of forced counters (``charge_when_over_limit``) that this consumer
    answered itself, from what it knew of the counters, and the store has not counted yet:
    a refusal admits nothing, so its charge may travel to the store with a later call."""

    def __init__(self) -> None:
        self.debts: dict[tuple[str, float], Debt] = {}  # (counter key, window start) -> debt

    def add(self, plan: Plan, at: float) -> None:
        """Owe the hits of ``plan``'s forced counters, refused at ``at`` (store clock)."""
        for i, c in enumerate(plan.counters):
            if not c.force or c.hits <= 0:
                continue
            key = (c.key, bounds(c.window, c.shape, at)[0])
            debt = self.debts.get(key)
            if debt is None:
                self.debts[key] = Debt(plan, i, c.hits, key[1])
            else:
                debt.hits += c.hits

    def take(self, at: float, plan: Plan | None = None) -> list[Debt]:
        """The debts of ``plan``'s counters (of every counter when None) to pay at ``at``
        (store clock), forgotten here: those of a window still current at ``at``. A debt
        whose window has ended is dropped: that window's count answers nothing any more,
        and the counter's next window must not count it."""
        keys = None if plan is None else {c.key for c in plan.counters if c.force}
        found = [k for k in self.debts if keys is None or k[0] in keys]
        taken = [self.debts.pop(k) for k in found]
        return [d for d in taken
                if bounds(d.counter.window, d.counter.shape, at)[0] == d.start]  # fmt: skip
