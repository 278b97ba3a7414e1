"""What a simulated run measures: per client, per counter and window, per root window."""

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fairlimit.simulate.clients import Client
from fairlimit.simulate.levels import Level, Tree
from fairlimit.simulate.report import CapCheck, ClientResult, WindowResult
from fairlimit.simulate.scenario import Scenario

EPSILON = 1e-9


@dataclass
class Tally:
    """One client's requests (originals and attempts) and hits, as the run goes."""

    offered: int = 0
    attempted: int = 0
    admitted: int = 0
    offered_hits: int = 0
    admitted_hits: int = 0
    steady_attempted: int = 0  # hits
    steady_admitted: int = 0
    per_second: Counter[int] = field(default_factory=Counter)  # hits admitted

    def offer(self, cost: int) -> None:
        self.offered += 1
        self.offered_hits += cost

    def attempt(self, count: int, cost: int, ok: bool, steady: bool, second: int) -> None:
        hits = count * cost
        self.attempted += count
        self.steady_attempted += hits if steady else 0
        if ok:
            self.admitted += count
            self.admitted_hits += hits
            self.steady_admitted += hits if steady else 0
            self.per_second[second] += hits


def busiest_span(hits: Mapping[int, int], ticks: int, tick: float) -> tuple[int, float]:
    """The most ``hits`` (per tick index) within any ``ticks`` consecutive ticks, and the
    first tick of such a span in seconds (0 when nothing was admitted)."""
    at = sorted(hits)
    best, start, total, low = 0, 0, 0, 0
    for high in at:
        total += hits[high]
        while at[low] <= high - ticks:
            total -= hits[at[low]]
            low += 1
        if total > best:
            best, start = total, at[low]
    return best, start * tick


def bucket_levels(
    hits: Mapping[int, int], tick: float, rate: float, size: int, starts: Sequence[float]
) -> list[float]:
    """What a token bucket of ``size`` filling at ``rate`` per second (a GCRA limit) holds at
    each of ``starts`` (ascending, seconds), full at 0, ``hits`` (per tick) taken from it."""
    out, level, last = [], float(size), 0.0
    events = sorted(hits)
    i = 0
    for start in starts:
        while i < len(events) and events[i] * tick < start - EPSILON:
            at = events[i] * tick
            level = max(0.0, min(size, level + rate * (at - last)) - hits[events[i]])
            last, i = at, i + 1
        out.append(min(size, level + rate * (start - last)))
    return out


def client_result(client: Client, tally: Tally, seconds: int) -> ClientResult:
    return ClientResult(
        client.name,
        tally.offered,
        tally.attempted,
        tally.admitted,
        tally.attempted - tally.admitted,
        tally.admitted / tally.offered if tally.offered else 1.0,
        tally.admitted / client.active if client.active else 0.0,
        tuple(tally.per_second[s] for s in range(seconds)),
        client.group,
        tally.offered_hits,
        tally.admitted_hits,
    )


class Meter:
    """Hits admitted at every counter per window, demand per root window, λ per second."""

    def __init__(self, scenario: Scenario, tree: Tree) -> None:
        self.scenario = scenario
        self.tree = tree
        root = [lv for lv in tree.levels[0] if lv.key == tree.root] if tree.root else []
        self.window = root[0].window if root else 1
        self.ticks: dict[str, Counter[int]] = defaultdict(Counter)  # key -> tick -> hits
        self._sums: dict[str, tuple[list[int], list[int]]] = {}  # key -> ticks, prefix sums
        self.offered: dict[int, Counter[int]] = defaultdict(Counter)  # root window -> client
        self.admitted: dict[int, Counter[int]] = defaultdict(Counter)
        self.levels: tuple[float | None, ...] = ()  # λ at the root cap, end of each second

    def offer(self, at: float, client: int, cost: int) -> None:
        self.offered[math.floor(at / self.window + EPSILON)][client] += cost

    def admit(self, t: float, client: int, hits: int) -> None:
        """``hits`` admitted for ``client`` at scenario time ``t`` (a tick's start)."""
        tick = round(t / self.scenario.tick)
        for level in self.tree.levels[client]:
            self.ticks[level.key][tick] += hits * level.hits
        self.admitted[math.floor(t / self.window + EPSILON)][client] += hits

    def level(self, value: float | None) -> None:
        self.levels = (*self.levels, value)

    def _by_window(self, key: str, window: int) -> Counter[int]:
        """Hits ``key`` admitted in each of its windows of ``window`` seconds, by index."""
        out: Counter[int] = Counter()
        for at, hits in self.ticks.get(key, {}).items():
            out[math.floor(at * self.scenario.tick / window + EPSILON)] += hits
        return out

    def _before(self, key: str, window: int, t: float, sliding: bool) -> int:
        """Hits ``key`` admitted before scenario time ``t`` in its window of ``window``
        seconds (``sliding``: in the ``window`` seconds before ``t``)."""
        if key not in self._sums:
            at = sorted(self.ticks.get(key, {}))
            self._sums[key] = (at, [0, *itertools.accumulate(self.ticks[key][x] for x in at)])
        at, sums = self._sums[key]
        start = t - window if sliding else math.floor(t / window + EPSILON) * window
        low = bisect.bisect_left(at, round(start / self.scenario.tick))
        return sums[bisect.bisect_left(at, round(t / self.scenario.tick))] - sums[low]

    def span(self, key: str, window: int) -> tuple[int, float]:
        """The most hits ``key`` admitted in any span of ``window`` seconds, wherever it
        starts (at the ticks' resolution), and when the first such span starts."""
        return busiest_span(self.ticks.get(key, {}), round(window / self.scenario.tick),
                            self.scenario.tick)  # fmt: skip

    def checks(
        self, root: str | None, modes: Mapping[tuple[str, int | None], str]
    ) -> tuple[CapCheck, ...]:
        """Per limit charged (the root's first), its worst window and span of any instance;
        ``modes`` by (rule, limit index: 0 for a rule's only limit), a rule's whole verdict
        under None."""
        by_limit: dict[str, list[str]] = {}
        info: dict[str, Level] = {}
        for per_client in self.tree.levels:
            for lv in per_client:
                keys = by_limit.setdefault(lv.name, [])
                if lv.key not in keys:
                    keys.append(lv.key)
                info.setdefault(lv.name, lv)

        def most(key: str, window: int) -> int:
            return max(self._by_window(key, window).values(), default=0)

        names = sorted(by_limit, key=lambda r: (root not in by_limit[r], len(r)))
        out = []
        for name in names:
            lv = info[name]
            span, start = max((self.span(k, lv.window) for k in by_limit[name]), key=lambda x: x[0])
            out.append(
                CapCheck(
                    name,
                    modes.get((lv.rule, lv.index or 0), modes.get((lv.rule, None))),
                    lv.limit,
                    lv.window,
                    max(most(k, lv.window) for k in by_limit[name]),
                    len(by_limit[name]),
                    span,
                    start,
                    lv.shape,
                )
            )
        return tuple(out)

    def windows(self) -> tuple[WindowResult, ...]:
        """Each window of the root limit: demand, achievable and admitted, λ at its end."""
        n, duration, size = len(self.scenario.clients), self.scenario.duration, self.window
        out = []
        count = math.ceil(duration / size - EPSILON)
        starts = [w * size for w in range(count)]
        buckets = {
            key: bucket_levels(
                self.ticks.get(key, {}), self.scenario.tick, limit / window, burst + 1, starts
            )
            for key, (limit, window, burst) in self.tree.paced.items()
        }
        at_root = self._by_window(self.tree.root or "", size)
        for w in range(count):
            offered = tuple(self.offered[w][c] for c in range(n))
            left = {key: limit - self._before(key, window, w * size, sliding)
                    for key, (limit, window, sliding) in self.tree.longer.items()}  # fmt: skip
            for key, (limit, window, _) in self.tree.paced.items():
                # a hit needs a whole token, and the refill at the window's end is the next's
                left[key] = math.floor(buckets[key][w] + limit * size / window - EPSILON)
            end = min((w + 1) * size, duration)
            last = min(math.ceil(end - EPSILON), len(self.levels)) - 1
            out.append(
                WindowResult(
                    w,
                    float(w * size),
                    float(end),
                    (w + 1) * size <= duration + EPSILON,
                    self.tree.achievable([float(x) for x in offered], left),
                    at_root[w],
                    self.levels[last] if last >= 0 else None,
                    offered,
                    tuple(self.admitted[w][c] for c in range(n)),
                )
            )
        return tuple(out)
