"""The local over-limit cache of the Redis store: a retry storm must not become a Redis storm."""

import math
from collections import OrderedDict
from typing import Protocol

from fairlimit.core.admission import Outcome, counter_over
from fairlimit.core.plan import Plan
from fairlimit.core.units import Algorithm


class Lifetimes(Protocol):
    """How long what a reply showed stays true, per counter and per claim (store seconds)."""

    counter_left: list[float]


class OverLimitCache:
    """What this replica last saw of each counter, until its window ends (LRU).

    A client's own counter that a rejection found over stays over until its window ends:
    counts only grow within a window. Such a request is answered here, without Redis. Only
    a rejection teaches it, so each replica still sends one rejected attempt per window to
    Redis; a cap's total is never answered here, as that would hide every client's demand.
    A fair-share claim is never cached: its bound moves with every request at the cap (a
    newcomer lowers it, a quiet client's fading prediction raises it).

    With lease blocks (core/lease.py) a count also falls when a block's unused hits are
    given back, by this replica (``forget``) or by another: an entry then lives at most
    ``ttl`` seconds, about as long as the blocks that may have made the counter look full.

    An entry keeps the count, not a verdict: a request is judged by its own limit against
    it, so a per-request override (``limit`` in the descriptor) is never refused for what
    another limit of the same counter learned (upstream's cache, keyed by the counter
    alone, refuses it).
    """

    def __init__(self, size: int, ttl: float = math.inf) -> None:
        self._size = size
        self._ttl = ttl
        self._entries: OrderedDict[tuple[str, ...], tuple[float, int, float, bool]]
        self._entries = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, ...], t: float) -> tuple[int, float, bool] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= t:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[1], entry[2], entry[3]

    def put(self, key: tuple[str, ...], until: float, count: int, bound: float, over: bool) -> None:
        if self._size == 0:
            return
        self._entries[key] = (until, count, bound, over)
        self._entries.move_to_end(key)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def forget(self, plan: Plan) -> None:
        """Drop what is known of ``plan``'s counters (a block of them was given back)."""
        for c in plan.counters:
            self._entries.pop(("c", c.key), None)

    def answer(self, plan: Plan, t: float, travel: bool = False) -> Outcome | None:
        """A rejection from what is known, when a client's counter or claim is known over.

        A refusal still charges a forced level (charge_when_over_limit, every level under
        upstream's semantics): only when each of them is known over, where a charge
        changes no answer until the window ends, may it be answered here; with ``travel``
        (the caller takes the charges to the store later, core/owed.py) also when each
        of them is known at all, so its count, and what is left, can be told here."""
        if any(s.force for s in plan.shares):
            return None
        if any(c.shape is not None and c.shape.algorithm is not Algorithm.FIXED
               for c in plan.counters):  # fmt: skip
            return None  # a sliding or GCRA count falls with time alone
        over = owed = False
        counts: list[int] = []
        for c in plan.counters:
            known = self.get(("c", c.key), t)
            counts.append(known[0] if known else 0)
            past = known is not None and known[2] and counter_over(c, known[0])
            over = over or past
            owed = owed or (c.force and not past and not (travel and known is not None))
        if not over or owed:
            return None
        shared = tuple(0 for _ in plan.shares)
        bounds = tuple(s.client_limit for s in plan.shares)
        return Outcome(False, tuple(counts), shared, bounds)

    def charge(self, plan: Plan) -> None:
        """Count the hits of ``plan``'s forced counters, refused here (``answer``), in what
        is known of them: their charge travels to the store, and what is left shows it."""
        for c in plan.counters:
            entry = self._entries.get(("c", c.key)) if c.force else None
            if entry is not None:
                until, count, bound, over = entry
                self._entries[("c", c.key)] = (until, count + c.hits, bound, over)

    def admitted(self, plan: Plan) -> None:
        """Count the hits of ``plan``, admitted here from a lease block, in what is known of
        its counters: a refusal told from them later shows what is left after them."""
        for c in plan.counters:
            entry = self._entries.get(("c", c.key))
            if entry is not None:
                until, count, bound, over = entry
                self._entries[("c", c.key)] = (until, count + c.hits, bound, over)

    def learn(self, plan: Plan, outcome: Outcome, seen: Lifetimes, base: float) -> None:
        """Remember the counters after ``outcome``; ``base`` maps store time to cache time."""
        charged = outcome.admitted
        caps = {s.cap for s in plan.shares}
        for i, c in enumerate(plan.counters):
            count = outcome.counts[i] + (c.hits if charged or c.force else 0)
            over = not charged and c.key not in caps and counter_over(c, count)
            until = base + min(seen.counter_left[i], self._ttl)
            self.put(("c", c.key), until, count, 0.0, over)
