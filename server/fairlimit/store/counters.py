"""In-process counters of the memory store: fixed and calendar windows, sliding and GCRA
meters (core/smooth.py), each table with its deadlines, dropped in steps (store/memory.py
drives the steps and frees what they drop).
"""

from collections.abc import Callable, Sequence

from fairlimit.core.plan import Counter, Plan
from fairlimit.core.smooth import gcra_charged, gcra_count, part, sliding_full_at
from fairlimit.core.units import SLIDING_PARTS, Algorithm, bounds, window_start
from fairlimit.store.deadlines import Deadlines, Due
from fairlimit.store.sweep import worth_compacting


class MemoryCounter:
    """A fixed window's count (epoch-aligned or a calendar one)."""

    __slots__ = ("count", "end", "reserved", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.count = 0
        self.reserved = 0  # hits of this window's reservations not settled (core/reserve.py)


class MemoryMeter:
    """A sliding window's sub-window counts, or GCRA's theoretical arrival time
    (core/smooth.py); ``count`` is the count at the last ``look``."""

    __slots__ = ("count", "parts", "tat", "until")

    def __init__(self, sliding: bool) -> None:
        self.count = 0
        self.tat = 0.0
        self.until = 0.0  # when its state counts nothing any more (full_at, after a charge)
        # per sub-window slot: [index, hits]; SLIDING_PARTS + 1 slots cover a window's parts
        self.parts = [[-1, 0] for _ in range(SLIDING_PARTS + 1)] if sliding else []

    def look(self, spec: Counter, now: float) -> int:
        if not self.parts:
            self.count = gcra_count(spec, self.tat, now)
            return self.count
        newest = part(spec, now)
        self.count = sum(n for i, n in self.parts if newest - SLIDING_PARTS <= i <= newest)
        return self.count

    def add(self, spec: Counter, hits: int, now: float) -> None:
        if not self.parts:
            self.tat = gcra_charged(spec, self.tat, now, hits)
            return
        index = part(spec, now)
        slot = self.parts[index % (SLIDING_PARTS + 1)]
        if slot[0] != index:
            slot[0], slot[1] = index, 0
        slot[1] += hits

    def full_at(self, spec: Counter) -> float:
        """When nothing charged so far is counted any more (its state may go then)."""
        if not self.parts:
            return self.tat
        newest = max((i for i, n in self.parts if n > 0), default=-1)
        return 0.0 if newest < 0 else sliding_full_at(spec, newest)


def charge(
    counters: Sequence[MemoryCounter | MemoryMeter], plan: Plan, admitted: bool, now: float
) -> None:
    """Charge each counter of ``plan`` its hits: all of them when admitted, else only the
    ones of charge_when_over_limit rules."""
    for counter, spec in zip(counters, plan.counters, strict=True):
        if admitted or spec.force:
            if isinstance(counter, MemoryMeter):
                counter.add(spec, spec.hits, now)
            else:
                counter.count += spec.hits


class MemoryCounters:
    """Every counter and meter of one memory store, by key.

    ``seed``: the count a counter starts a window at, by its key and the window's start
    (store/memory.py says who gives one). ``due``: the store's, lowered by each deadline.
    """

    def __init__(
        self, seed: Callable[[str, int], int] | None = None, due: Due | None = None
    ) -> None:
        self._seed = seed
        self.table: dict[str, MemoryCounter] = {}
        self.meters: dict[str, MemoryMeter] = {}  # sliding and GCRA counters
        self._deadlines = Deadlines(0.0, due)  # a window's counters end at one instant
        self._meter_deadlines = Deadlines(1.0, due)  # a meter is dropped up to a second late
        self._high = 0  # the most counters held since the table was last compacted

    def __len__(self) -> int:
        return len(self.table) + len(self.meters)

    def counter(self, key: str, window: int, now: float) -> MemoryCounter:
        """The counter of the window at ``now``; a call from a window already closed here
        (it waited while a later call opened the next) counts in the later one, never
        replacing it: the later window's count would start again."""
        start = window_start(window, now)
        counter = self.table.get(key)
        if counter is None or counter.start < start:
            counter = self._fresh(key, start, start + window)
        return counter

    def _fresh(self, key: str, start: int, end: int) -> MemoryCounter:
        counter = MemoryCounter(start, end)
        if self._seed is not None:
            counter.count = self._seed(key, start)
        self.table[key] = counter
        self._deadlines.push(end, key)
        return counter

    def shaped(self, spec: Counter, now: float) -> MemoryCounter | MemoryMeter:
        """A calendar window's counter, or a sliding or GCRA meter, looked at ``now``."""
        shape = spec.shape
        assert shape is not None
        if shape.algorithm is Algorithm.FIXED:
            counter = self.table.get(spec.key)
            if counter is None or counter.end <= now:  # an older window's call: as counter()
                counter = self._fresh(spec.key, *bounds(spec.window, shape, now))
            return counter
        meter = self.meters.get(spec.key)
        if meter is None:
            meter = self.meters[spec.key] = MemoryMeter(shape.algorithm is Algorithm.SLIDING)
            self._meter_deadlines.push(now + spec.window, spec.key)
        meter.look(spec, now)
        return meter

    def expire(self, now: float, budget: int, dropped: list[object]) -> bool:
        """Drop the counters and meters that ended by ``now``, ``budget`` deadlines of each
        table at most, into ``dropped`` (to be freed later); True when more are due."""
        more = self._expire_counters(now, budget, dropped)
        return self._expire_meters(now, budget, dropped) or more

    def first(self) -> float:
        """The earliest instant a counter or meter is due (infinity when none)."""
        return min(self._deadlines.first(), self._meter_deadlines.first())

    def _expire_counters(self, now: float, budget: int, dropped: list[object]) -> bool:
        deadlines, counters = self._deadlines, self.table
        if not deadlines.due(now):
            return False
        self._high = max(self._high, len(counters))
        for key in deadlines.take(now, budget):
            counter = counters.get(key)
            if counter is not None and counter.end <= now:  # not a later window's
                del counters[key]
                dropped.append(counter)
                dropped.append(key)
        return deadlines.due(now)

    def _expire_meters(self, now: float, budget: int, dropped: list[object]) -> bool:
        """Drop the meters whose state counts nothing any more (each has one deadline)."""
        deadlines = self._meter_deadlines
        for key in deadlines.take(now, budget):
            meter = self.meters[key]
            if meter.until <= now:
                del self.meters[key]
                dropped.append(meter)
                dropped.append(key)
            else:
                deadlines.push(meter.until, key)
        return deadlines.due(now)

    @property
    def compact_due(self) -> bool:
        """Whether the counter table is to be compacted (store/sweep.py)."""
        return worth_compacting(len(self.table), self._high)

    def compact(self) -> None:
        """Copy the counter table into one of its live size (a dict never gives back the
        table it grew to)."""
        self.table = dict(self.table)
        self._high = len(self.table)

    def clear(self) -> None:
        self.table.clear()
        self.meters.clear()
        self._deadlines.clear()
        self._meter_deadlines.clear()
