"""What each simulated client sends: phases of traffic, the cost of each request, arrivals.

A client is a list of phases. A phase sends ``rate`` requests per second, evenly spread, from
``start`` to ``stop``; with ``every`` set, only in the first ``on`` seconds of every ``every``
seconds (an on/off client); ``burst`` more requests go at once at ``start``. Every request
costs ``cost`` hits (tokens): a fixed number, uniform between two bounds, or one of a few
values with weights, drawn from a generator seeded by the scenario's ``seed`` and the
client's name, so a run is the same every time.
"""

import math
import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Phase:
    start: float
    stop: float
    rate: float = 0.0  # requests per second while on
    every: float = 0.0  # on/off cycle length; 0: always on
    on: float = 0.0  # seconds on at the start of each cycle
    burst: int = 0  # requests at once at ``start``

    def intervals(self) -> Iterator[tuple[float, float]]:
        """The (from, to) spans in which the phase sends at ``rate``."""
        if not self.every:
            yield self.start, self.stop
            return
        begin = self.start
        while begin < self.stop - EPSILON:
            yield begin, min(begin + self.on, self.stop)
            begin += self.every

    @property
    def active(self) -> float:
        """Seconds the phase sends at ``rate``."""
        return sum(b - a for a, b in self.intervals())

    def times(self) -> Iterator[float]:
        """Every request's exact send time, in order."""
        for _ in range(self.burst):
            yield self.start
        if self.rate <= 0:
            return
        for begin, end in self.intervals():
            n = 0
            while (at := begin + n / self.rate) < end - EPSILON:
                yield at
                n += 1

    @property
    def offered(self) -> int:
        """How many requests the phase sends (an upper bound within one request per span)."""
        spans = list(self.intervals())
        return self.burst + sum(math.ceil((b - a) * self.rate - EPSILON) for a, b in spans)


@dataclass(frozen=True, slots=True)
class Cost:
    """Hits per request: ``values`` drawn by ``weights``, or uniform in ``uniform``."""

    values: tuple[int, ...] = (1,)
    weights: tuple[float, ...] = (1.0,)
    uniform: tuple[int, int] | None = None

    @property
    def fixed(self) -> int | None:
        """The cost when every request costs the same, else None."""
        if self.uniform is None and len(set(self.values)) == 1:
            return self.values[0]
        if self.uniform is not None and self.uniform[0] == self.uniform[1]:
            return self.uniform[0]
        return None

    @property
    def mean(self) -> float:
        if self.uniform is not None:
            return (self.uniform[0] + self.uniform[1]) / 2
        return sum(v * w for v, w in zip(self.values, self.weights, strict=True)) / sum(
            self.weights
        )

    def draw(self, rng: random.Random) -> int:
        fixed = self.fixed
        if fixed is not None:
            return fixed
        if self.uniform is not None:
            return rng.randint(*self.uniform)
        return rng.choices(self.values, self.weights)[0]


def arrivals(
    phases: Sequence[Sequence[Phase]],
    costs: Sequence[Cost],
    names: Sequence[str],
    seed: int,
    per_second: int,
) -> dict[int, list[tuple[float, int, int]]]:
    """Original requests by tick: (exact time, client index, cost), in time order."""
    by_tick: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for index, (client_phases, cost, name) in enumerate(zip(phases, costs, names, strict=True)):
        rng = random.Random(f"{seed}/{name}")  # str seeds hash the same in every process
        times = sorted(t for phase in client_phases for t in phase.times())
        for at in times:
            by_tick[math.floor(at * per_second + EPSILON)].append((at, index, cost.draw(rng)))
    for events in by_tick.values():
        events.sort()
    return by_tick
