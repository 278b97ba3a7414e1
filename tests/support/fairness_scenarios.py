"""A fairness scenario harness: real Limiter, injected clock, measured against the exact
solver (tests/support/maxmin.py).

A scenario is a descriptor config (YAML text), the caps it declares (capacity, window,
per-child limits and weights, nested caps) and clients defined by phases (rate, start/stop,
on/off, a one-off burst, a cost in hits per request). The run sends every request through
``Limiter.should_rate_limit`` on a tick clock (scenario time 0 is a day boundary, so windows
of every unit start at 0), and records per window and per cap node what each child offered
and was admitted. The figures, per scenario:

- ``error``: max over settled windows and clients of ``max(0, |a - f| - c) / f``, a being
  admitted and f the exact max-min share, c the client's cost per request (one request of
  rounding is allowed: shares are fractional, admissions whole requests). Settled: not the
  first window, no phase change in it.
  ``error_change`` is the same over the windows with a change (the first window excluded).
- ``jain``: min over settled windows of Jain's index of a / f over clients with f > 0.
- ``utilisation``: min over windows of the root's admitted / achievable (the max-min total).
- ``starved``: the longest time (s) a client was refused while below its max-min share of
  the part of the window that had elapsed (f·elapsed/W): from such a rejection to its next
  admission (or its last such rejection). A client refused because it has had its share,
  or is ahead of it on a long window, is not starving.
- ``over``: max over windows and cap nodes of admitted / capacity (1.0 at most).
- ``bound``: long windows only: the most a client was admitted beyond its share of the window
  as it unfolds (``maxmin.unfolding_bound`` with a slack of one period), in requests.
"""

import asyncio
import math
import sys
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# run as a script: python tests/support/fairness_scenarios.py
if str(ROOT / "server") not in sys.path:
    sys.path.insert(0, str(ROOT / "server"))

from fairlimit.config.loader import load  # noqa: E402
from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.base import Store  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402
from helpers import desc, req  # noqa: E402
from maxmin import INF, Allocation, Node, allocate, jain, unfolding_bound  # noqa: E402

EPOCH = 1_699_920_000.0  # a day boundary: scenario second 0 starts a window of every unit


@dataclass(frozen=True)
class Phase:
    """``rate`` requests/s from ``start`` to ``stop`` (s), sent only in the first ``on``
    seconds of every ``every`` seconds when ``every`` is set; ``burst`` more at ``start``."""

    start: float
    stop: float
    rate: float
    burst: int = 0
    every: float = 0.0
    on: float = 0.0

    def active(self, t: float) -> bool:
        if not self.start <= t < self.stop:
            return False
        return not self.every or (t - self.start) % self.every < self.on - 1e-9


@dataclass(frozen=True)
class Client:
    """One client: where it sits under the caps (``path``), its descriptor and phases."""

    name: str
    path: tuple[str, ...]  # child names from the root cap down, e.g. ("A", "a1")
    entries: tuple[str, ...]  # "key=value" descriptor entries
    phases: tuple[Phase, ...]
    cost: int = 1  # hits per request (tokens)


@dataclass(frozen=True)
class Cap:
    """A cap node: ``capacity`` per ``window`` s over children (each held to
    ``child_limit`` per window and weighted by ``weights``); nested caps by child name."""

    capacity: float
    window: int
    child_limit: float = INF
    weights: Mapping[str, float] = field(default_factory=dict)
    nested: Mapping[str, "Cap"] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    config: str
    domain: str
    cap: Cap
    clients: tuple[Client, ...]
    duration: float
    tick: float = 0.02


@dataclass
class Figures:
    error: float = 0.0
    error_change: float = 0.0
    jain: float = 1.0
    utilisation: float = 1.0
    starved: float = 0.0
    over: float = 0.0
    bound: float | None = None


@dataclass
class Record:
    """What the run saw: per window and leaf, offered and admitted hits; starvation."""

    offered: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    admitted: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    # per client, in time order: (t, window, admitted before in the window, admitted?)
    events: dict[str, list[tuple[float, int, float, bool]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # long windows: per second, cumulative offered and admitted per client within the window
    samples: list[tuple[int, float, dict[str, float], dict[str, float]]] = field(
        default_factory=list
    )

    def add(self, table: dict[int, dict[str, float]], window: int, name: str, hits: float) -> None:
        table[window][name] = table[window].get(name, 0.0) + hits


class _Sender:
    """Each client's due requests per tick (evenly spread), starvation clocks."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.due = {c.name: 0.0 for c in scenario.clients}
        self.burst_sent: set[tuple[str, int]] = set()

    def sends(self, t: float) -> list[Client]:
        """The clients' requests of the tick starting at ``t``, round-robin interleaved."""
        queues: list[list[Client]] = []
        for client in self.scenario.clients:
            count = 0
            for index, phase in enumerate(client.phases):
                due_now = phase.start <= t < phase.start + self.scenario.tick - 1e-9
                if phase.burst and due_now and (client.name, index) not in self.burst_sent:
                    self.burst_sent.add((client.name, index))
                    count += phase.burst
                if phase.active(t):
                    self.due[client.name] += phase.rate * self.scenario.tick
            whole = math.floor(self.due[client.name] + 1e-9)
            self.due[client.name] -= whole
            queues.append([client] * (count + whole))
        order: list[Client] = []
        for i in range(max((len(q) for q in queues), default=0)):
            order.extend(q[i] for q in queues if i < len(q))
        return order


async def run(scenario: Scenario, store: Store | None = None) -> Record:
    """Drive ``scenario`` through a real Limiter over ``store`` (a fresh MemoryStore)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.yaml"
        path.write_text(scenario.config)
        loaded = load([path])
    clock = _Clock()
    limiter = Limiter(loaded, store if store is not None else MemoryStore(), clock)
    requests = {
        c.name: req(scenario.domain, desc(*c.entries, hits=c.cost)) for c in scenario.clients
    }
    sender, record = _Sender(scenario), Record()
    window = scenario.cap.window
    cumulative: dict[str, tuple[float, float]] = {}
    ticks = round(scenario.duration / scenario.tick)
    per_second = round(1 / scenario.tick)
    for step in range(ticks):
        t = step * scenario.tick
        clock.t = EPOCH + t
        w = math.floor(t / window + 1e-9)
        if window > 1 and step and step % per_second == 0:
            _sample(record, cumulative, t, window)
        for client in sender.sends(t):
            decision = await limiter.should_rate_limit(requests[client.name])
            if decision.backend_failed:  # failing open would read as over-admission
                raise RuntimeError(f"the store failed at t={t}: see the log")
            ok = decision.code.name == "OK"
            before = record.admitted[w].get(client.name, 0.0)
            record.events[client.name].append((t, w, before, ok))
            record.add(record.offered, w, client.name, client.cost)
            if ok:
                record.add(record.admitted, w, client.name, client.cost)
            off, got = cumulative.get(client.name, (0.0, 0.0))
            cumulative[client.name] = (off + client.cost, got + (client.cost if ok else 0))
    if window > 1:
        _sample(record, cumulative, scenario.duration, window)
    return record


class _Clock:
    def __init__(self) -> None:
        self.t = EPOCH

    def now(self) -> float:
        return self.t


def _sample(
    record: Record, cumulative: dict[str, tuple[float, float]], t: float, window: int
) -> None:
    """Record the window so far at the end of a second; a new window starts afresh."""
    index = math.floor((t - 1e-6) / window)
    elapsed = t - index * window
    offered = {k: v[0] for k, v in cumulative.items()}
    admitted = {k: v[1] for k, v in cumulative.items()}
    record.samples.append((index, elapsed, offered, admitted))
    if elapsed > window - 1e-9:
        cumulative.clear()


# --- the figures ---------------------------------------------------------------------------


def _tree(cap: Cap, clients: Sequence[Client], offered: Mapping[str, float]) -> Node:
    """The max-min reference tree of one window: caps as inner nodes, clients as leaves."""

    def build(node: Cap, depth: int, members: Sequence[Client], name: str, limit: float) -> Node:
        children: list[Node] = []
        for child in dict.fromkeys(c.path[depth] for c in members):
            below = [c for c in members if c.path[depth] == child]
            weight = node.weights.get(child, 1.0)
            if child in node.nested:
                inner = node.nested[child]
                children.append(
                    build(inner, depth + 1, below, child, min(node.child_limit, inner.capacity))
                )
                children[-1] = Node(child, children[-1].limit, weight, 0, children[-1].children)
            else:
                demand = sum(offered.get(c.name, 0.0) for c in below)
                children.append(Node(child, node.child_limit, weight, demand))
        return Node(name, limit, 1, 0, tuple(children))

    return build(cap, 0, clients, "root", cap.capacity)


def _paths(clients: Sequence[Client]) -> dict[str, list[str]]:
    """Every node path of the reference tree -> the clients below it."""
    out: dict[str, list[str]] = defaultdict(list)
    for c in clients:
        for depth in range(len(c.path) + 1):
            out["/".join(("root", *c.path[:depth]))].append(c.name)
    return out


def _caps(cap: Cap, path: str = "root") -> dict[str, float]:
    out = {path: cap.capacity}
    for name, inner in cap.nested.items():
        out.update(_caps(inner, f"{path}/{name}"))
    return out


def _changes(scenario: Scenario) -> set[int]:
    """Windows in which some client's demand changes (start, stop, burst, on/off edge)."""
    window, out = scenario.cap.window, set()
    for client in scenario.clients:
        for p in client.phases:
            edges = [p.start, p.stop]
            if p.every:
                k = p.start
                while k < p.stop:
                    edges += [k, k + p.on]
                    k += p.every
            out.update(math.floor(e / window + 1e-9) for e in edges if e < scenario.duration)
    return out


def figures(scenario: Scenario, record: Record) -> Figures:
    """The scenario's figures (see the module docstring) from what the run recorded."""
    out = Figures()
    paths, caps = _paths(scenario.clients), _caps(scenario.cap)
    cost = {c.name: c.cost for c in scenario.clients}
    rounding = {p: max(cost[c] for c in names) for p, names in paths.items()}
    changed = _changes(scenario)
    windows = round(scenario.duration / scenario.cap.window)
    fairs = [
        allocate(_tree(scenario.cap, scenario.clients, record.offered.get(w, {})))
        for w in range(windows)
    ]
    for c in scenario.clients:
        share = "/".join(("root", *c.path))
        got = _starved(record.events[c.name], c.cost, fairs, share, scenario.cap.window)
        out.starved = max(out.starved, got)
    for w in range(windows):
        admitted, fair = record.admitted.get(w, {}), fairs[w]
        got = {p: sum(admitted.get(c, 0.0) for c in names) for p, names in paths.items()}
        for path, capacity in caps.items():
            out.over = max(out.over, got.get(path, 0.0) / capacity)
        if w == 0:
            continue
        if fair["root"] > 0:
            out.utilisation = min(out.utilisation, got["root"] / float(fair["root"]))
        errors = [
            max(0.0, abs(got[p] - float(fair[p])) - rounding[p]) / float(fair[p])
            for p in paths
            if p != "root" and fair[p] > 0
        ]
        worst = max(errors, default=0.0)
        if w in changed:
            out.error_change = max(out.error_change, worst)
            continue
        out.error = max(out.error, worst)
        ratios = [admitted.get(c.name, 0.0) / float(fair["/".join(("root", *c.path))])
                  for c in scenario.clients if fair["/".join(("root", *c.path))] > 0]  # fmt: skip
        out.jain = min(out.jain, jain(ratios))
    if scenario.cap.window > 1 and not scenario.cap.nested:
        out.bound = bound_excess(scenario, record)
    return out


def _starved(
    events: Sequence[tuple[float, int, float, bool]],
    cost: int,
    fairs: Sequence[Allocation],
    at: str,
    window: int,
) -> float:
    """The longest run of rejections while below the fair share (see the module docstring)."""
    worst, since, last = 0.0, None, 0.0
    for t, w, before, ok in events:
        elapsed = (t - w * window) / window
        below = before + cost < float(fairs[w][at]) * elapsed + cost
        if since is not None and (ok or not below):
            worst, since = max(worst, (t if ok else last) - since), None
        if not ok and below:
            since = t if since is None else since
            last = t
    return worst if since is None else max(worst, last - since)


def bound_excess(scenario: Scenario, record: Record) -> float:
    """The most any client was admitted beyond its unfolding share, in hits."""
    cap, names = scenario.cap, [c.name for c in scenario.clients]
    by_window: dict[int, list[tuple[float, dict[str, float], dict[str, float]]]] = defaultdict(list)
    for index, elapsed, offered, admitted in record.samples:
        by_window[index].append((elapsed, offered, admitted))
    worst = 0.0
    for samples in by_window.values():
        bound = unfolding_bound(
            cap.capacity,
            cap.window,
            0.0,
            [(e, [off.get(n, 0.0) for n in names]) for e, off, _ in samples],
            [cap.child_limit] * len(names),
            [cap.weights.get(c.path[0], 1.0) for c in scenario.clients],
        )
        for (_, _, got), limit in zip(samples, bound, strict=True):
            for name, b in zip(names, limit, strict=True):
                worst = max(worst, got.get(name, 0.0) - float(b))
    return worst


HEADER = ("scenario", "error", "err@change", "jain", "util", "starved s", "max/cap", "bound+")


def row(name: str, f: Figures) -> tuple[str, ...]:
    bound = "-" if f.bound is None else f"{f.bound:.0f}"
    return (
        name,
        f"{f.error:.1%}",
        f"{f.error_change:.1%}",
        f"{f.jain:.3f}",
        f"{f.utilisation:.3f}",
        f"{f.starved:.2f}",
        f"{f.over:.3f}",
        bound,
    )


def table(rows: Sequence[tuple[str, ...]]) -> str:
    """A Markdown table of the figures."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    """Print the table; ``--redis URL`` runs every scenario on that Redis (flushed first)."""
    from fairness_cases import SCENARIOS

    url = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--redis" else None
    rows = []
    for scenario in SCENARIOS:
        record = asyncio.run(_run_on(scenario, url))
        rows.append(row(scenario.name, figures(scenario, record)))
        print(scenario.name, "done", file=sys.stderr)
    print(table(rows))


async def _run_on(scenario: Scenario, url: str | None) -> Record:
    if url is None:
        return await run(scenario)
    import redis

    from fairlimit.store import open_store

    with redis.Redis.from_url(url) as scratch:  # a scratch server: each scenario starts empty
        scratch.flushdb()
    store = open_store(f"{url}?clock=caller&timeout=5")
    try:
        return await run(scenario, store)
    finally:
        await store.close()


if __name__ == "__main__":
    main()
