"""Keys by the instant they are due, taken in steps, each instant's in the order they came.

The memory store's counters of one window all end at one instant: a heap of (end, key)
pairs would give them back in key order, at a logarithmic cost each, and free them all
over the heap's memory. Here each instant (rounded up to ``grain`` seconds, so that
reservations made a moment apart share one) keeps its keys in a queue in the order they
were added, so they are taken in the order they were made: the memory blocks they filled
empty one after another and go back to the system while the sweep is still running,
instead of being held by a few new objects put in their holes (bench/expiry.py).
"""

import heapq
import math
from collections import deque


class Due:
    """The earliest instant anything of a store's tables is due: never later than that
    (each push lowers it; a step sets it to the tables' first), so a call before it has
    nothing to expire and looks no further (one comparison). Lower than that costs a step
    that drops nothing."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = math.inf

    def by(self, instant: float) -> None:
        """Something is due at ``instant``."""
        if instant < self.at:
            self.at = instant


class Deadlines:
    """When each key is due (a key may be pushed again: the owner checks, when it is
    taken, whether its state is really over). ``due``: lowered to each instant pushed."""

    def __init__(self, grain: float = 0.0, due: Due | None = None) -> None:
        self._grain = grain
        self._instants: list[float] = []  # a heap of the instants that have keys
        self._keys: dict[float, deque[str]] = {}
        self._due = due or Due()

    def push(self, at: float, key: str) -> None:
        """``key`` is due at ``at`` (taken at its instant or later, never sooner)."""
        grain = self._grain
        instant = math.ceil(at / grain) * grain if grain else at
        keys = self._keys.get(instant)
        if keys is None:
            keys = self._keys[instant] = deque()
            heapq.heappush(self._instants, instant)
            if instant < self._due.at:
                self._due.at = instant
        keys.append(key)

    def first(self) -> float:
        """The earliest instant with keys (infinity when none)."""
        return self._instants[0] if self._instants else math.inf

    def due(self, now: float) -> bool:
        """Whether any key is due by ``now``."""
        return bool(self._instants) and self._instants[0] <= now

    def take(self, now: float, budget: int) -> list[str]:
        """Up to ``budget`` of the keys due by ``now``, the earliest instant's first."""
        taken: list[str] = []
        instants = self._instants
        while instants and instants[0] <= now and len(taken) < budget:
            keys = self._keys[instants[0]]
            while keys and len(taken) < budget:
                taken.append(keys.popleft())
            if not keys:
                del self._keys[heapq.heappop(instants)]
        return taken

    def clear(self) -> None:
        self._instants.clear()
        self._keys.clear()
