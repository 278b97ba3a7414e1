"""What a simulated run measures: per client, per counter and window, per root window."""

import math
from collections import Counter, defaultdict
from collections.abc import Mapping
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
        self.counters: Counter[tuple[str, int]] = Counter()  # (key, window index) -> hits
        self.offered: dict[int, Counter[int]] = defaultdict(Counter)  # root window -> client
        self.admitted: dict[int, Counter[int]] = defaultdict(Counter)
        self.levels: tuple[float | None, ...] = ()  # λ at the root cap, end of each second

    def offer(self, at: float, client: int, cost: int) -> None:
        self.offered[math.floor(at / self.window + EPSILON)][client] += cost

    def admit(self, t: float, client: int, hits: int) -> None:
        """``hits`` admitted for ``client`` at scenario time ``t`` (a tick's start)."""
        for level in self.tree.levels[client]:
            self.counters[(level.key, math.floor(t / level.window + EPSILON))] += hits * level.hits
        self.admitted[math.floor(t / self.window + EPSILON)][client] += hits

    def level(self, value: float | None) -> None:
        self.levels = (*self.levels, value)

    def checks(
        self, root: str | None, modes: Mapping[tuple[str, int | None], str]
    ) -> tuple[CapCheck, ...]:
        """Per limit of each rule charged (the root's first), its worst window of any
        instance; ``modes`` by (rule, limit index), a rule's whole verdict under None."""
        by_limit: dict[tuple[str, int | None], list[str]] = {}
        info: dict[tuple[str, int | None], Level] = {}
        for per_client in self.tree.levels:
            for lv in per_client:
                keys = by_limit.setdefault((lv.rule, lv.index), [])
                if lv.key not in keys:
                    keys.append(lv.key)
                info.setdefault((lv.rule, lv.index), lv)
        worst: dict[str, int] = defaultdict(int)
        for (key, _), hits in self.counters.items():
            worst[key] = max(worst[key], hits)
        order = sorted(by_limit, key=lambda r: (root not in by_limit[r], len(r[0]), r[1] or 0))
        return tuple(
            CapCheck(
                rule,
                modes.get((rule, index), modes.get((rule, None))),
                info[rule, index].limit,
                info[rule, index].window,
                max(worst[k] for k in by_limit[rule, index]),
                len(by_limit[rule, index]),
                info[rule, index].shape,
            )
            for rule, index in order
        )

    def windows(self) -> tuple[WindowResult, ...]:
        """Each window of the root limit: demand, achievable and admitted, λ at its end."""
        n, duration, size = len(self.scenario.clients), self.scenario.duration, self.window
        out = []
        for w in range(math.ceil(duration / size - EPSILON)):
            offered = tuple(self.offered[w][c] for c in range(n))
            end = min((w + 1) * size, duration)
            last = min(math.ceil(end - EPSILON), len(self.levels)) - 1
            out.append(
                WindowResult(
                    w,
                    float(w * size),
                    float(end),
                    (w + 1) * size <= duration + EPSILON,
                    self.tree.achievable([float(x) for x in offered]),
                    self.counters[(self.tree.root or "", w)],
                    self.levels[last] if last >= 0 else None,
                    offered,
                    tuple(self.admitted[w][c] for c in range(n)),
                )
            )
        return tuple(out)
