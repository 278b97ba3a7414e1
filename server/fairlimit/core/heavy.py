"""Heavy hitters in bounded memory: which clients carry most of a stream of weighted hits.

``HeavyHitters(k)`` is the Misra-Gries summary in its batched ("mergeable summaries",
Agarwal et al. 2012) form. It keeps at most ``2k`` counters; when a new client finds all of
them taken, the ``(k+1)``-th largest count is subtracted from every counter and those left
at zero or below are dropped, which leaves at most ``k``. That sort runs at most once per
``k`` new clients, so an update costs O(1) amortised for a fixed ``k`` whatever the number
of distinct clients.

``error`` is the sum of everything subtracted from one counter so far. With ``W`` the total
weight seen, every client's true count ``f`` satisfies ``count <= f <= count + error`` (a
client without a counter has ``count`` 0), and ``error <= (W - sum of counts) / (k + 1)``
because each batch removed at least ``k + 1`` times its amount. Hence the guarantees a
report keeps, the estimate being ``count + error`` (an upper bound, as Space-Saving gives):

- the estimate overestimates the true count by at most ``error <= W / (k + 1)``;
- every client with ``f > W / (k + 1)`` has a counter;
- ``top(n)`` with ``n <= k`` includes every client with ``f > W / n`` (ranking by estimate
  is ranking by count; ``n`` others ranked above such a client would need more weight in
  the summary than ``W - (k + 1) * error`` allows).
"""

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Hitter(Generic[Item]):
    """One reported client: ``estimate`` is at least its true count, at most ``error`` more."""

    item: Item
    estimate: int
    error: int


class HeavyHitters(Generic[Item]):
    """The top of a weighted stream in at most ``2 * capacity`` counters."""

    __slots__ = ("_counts", "_slots", "capacity", "error", "total")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be 1 or more, got {capacity}")
        self.capacity = capacity
        self._slots = 2 * capacity
        self._counts: dict[Item, int] = {}
        self.error = 0  # subtracted from every counter so far: the bound on any estimate
        self.total = 0  # W: all the weight ever added

    def add(self, item: Item, weight: int) -> None:
        """Count ``weight`` hits of ``item`` (a weight of 0 or less counts nothing)."""
        if weight <= 0:
            return
        self.total += weight
        counts = self._counts
        known = counts.get(item)
        if known is not None:
            counts[item] = known + weight
            return
        if len(counts) >= self._slots:
            self._shrink()  # a new dict: ``counts`` is stale from here
        self._counts[item] = weight

    def _shrink(self) -> None:
        """Subtract the (k+1)-th largest count from all, keeping the (at most k) positive."""
        cut = heapq.nlargest(self.capacity + 1, self._counts.values())[-1]
        self.error += cut
        self._counts = {i: c - cut for i, c in self._counts.items() if c > cut}

    def merge(self, other: "HeavyHitters[Item]") -> None:
        """Add ``other``'s counts (its error adds to ours, and the bound still holds)."""
        self.total += other.total
        self.error += other.error
        counts = self._counts
        for item, count in other._counts.items():
            counts[item] = counts.get(item, 0) + count
        while len(self._counts) > self._slots:
            self._shrink()

    def __len__(self) -> int:
        return len(self._counts)

    def top(self, n: int) -> list[Hitter[Item]]:
        """The ``n`` clients with the largest estimates, largest first (ties: first seen)."""
        ranked = heapq.nlargest(n, self._counts.items(), key=lambda pair: pair[1])
        return [Hitter(item, count + self.error, self.error) for item, count in ranked]

    def estimate(self, item: Item) -> int:
        """An upper bound on ``item``'s count, at most ``error`` above it."""
        return self._counts.get(item, 0) + self.error

    @classmethod
    def of(cls, capacity: int, stream: Iterable[tuple[Item, int]]) -> "HeavyHitters[Item]":
        """A summary of ``stream`` (pairs of item and weight)."""
        summary = cls(capacity)
        for item, weight in stream:
            summary.add(item, weight)
        return summary
