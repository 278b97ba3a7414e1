"""Per-window fairness figures of a ``fairlimit simulate`` run, against tests/support/maxmin.py.

The run is the engine's (``fairlimit.simulate.engine``) on one fair-share config; what it
measured per window of the cap (``ConfigResult.windows``: the meter's hits offered by each
client in original requests, retries left out, and its hits admitted, retries included) is
compared with the exact weighted max-min allocation of the same demand. A window is the
cap's window (1 s for a per-second cap, 60 s for a per-minute one); the cap's capacity and
each client's own limit are read from the config file itself, not from the server's code.

Per window w, with d_i the hits client i offered in w, a_i the hits it was admitted in w:

- ``fair``: f_i = ``maxmin(d, [L]*n, [1]*n, C)``, C the cap's ``requests_per_unit`` and L a
  client's own limit in the cap's window (weights 1), in exact fractions.
- ``error`` of client i (only where d_i > 0): ``max(0, |a_i - f_i| - c_i) / f_i``, c_i the hits
  of one of its requests: one request of rounding is allowed, since f_i is fractional and
  admissions are whole requests.
- ``utilisation``: ``sum(a) / sum(f)`` (1 when nothing was offered).
- ``jain``: Jain's index of a_i / f_i over the clients with f_i > 0 (1 when there are none).
- ``over``: the most admitted at the cap in the window (its counter, or the clients' sum if
  that is higher) over C: above 1 means the cap was exceeded.
- ``changed``: some client's life starts or ends strictly inside the window (a client lives
  from its first phase's start to its last phase's stop; the on/off cycles of a phase, such
  as a page load every 8 s, are its traffic, not starts and stops). Jain's index compares
  clients on an equal footing only in the other windows.

Over the run, ``share(names)``: the named clients' admitted hits over their max-min hits,
summed over every window.
"""

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from fairlimit.simulate import engine, load_scenario
from fairlimit.simulate.report import ConfigResult
from fairlimit.simulate.scenario import Scenario
from fairlimit.store.base import Store
from maxmin import jain, maxmin

UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


@dataclass(frozen=True)
class Cap:
    """A fair-share cap as its config states it: C per window over per-client limits."""

    capacity: int  # hits per window
    window: int  # seconds
    client_limit: Fraction  # each client's own limit, in hits per cap window


def read_cap(path: str | Path) -> Cap:
    """The first ``fair_share`` cap of the config at ``path`` and its per-client rule."""
    raw = yaml.safe_load(Path(path).read_text())

    def find(nodes: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
        for node in nodes:
            if "fair_share" in node:
                return node
            found = find(node.get("descriptors", []))
            if found is not None:
                return found
        return None

    node = find(raw["descriptors"])
    if node is None:
        raise ValueError(f"{path} declares no fair_share cap")
    cap = node["rate_limit"]
    window = UNITS[cap["unit"]]
    children = [c["rate_limit"] for c in node.get("descriptors", []) if "rate_limit" in c]
    limit = (
        Fraction(children[0]["requests_per_unit"] * window, UNITS[children[0]["unit"]])
        if children
        else Fraction(cap["requests_per_unit"])
    )
    return Cap(int(cap["requests_per_unit"]), window, limit)


@dataclass(frozen=True)
class Window:
    """One window of the cap: per client (scenario order) offered, admitted, fair, error."""

    index: int
    start: float
    end: float
    offered: tuple[int, ...]
    admitted: tuple[int, ...]
    fair: tuple[Fraction, ...]
    error: tuple[float | None, ...]  # None: the client offered nothing in the window
    utilisation: float
    jain: float
    over: float
    changed: bool


@dataclass(frozen=True)
class Worst:
    """The worst error of some windows: its value, where, and the figures behind it."""

    error: float
    window: int
    client: str
    admitted: int
    fair: float

    def __str__(self) -> str:
        return (
            f"error {self.error:.1%} in window {self.window}: {self.client} admitted "
            f"{self.admitted}, max-min {self.fair:.1f}"
        )


@dataclass(frozen=True)
class Figures:
    """Every window's figures, and the client names to report them by."""

    names: tuple[str, ...]
    cap: Cap
    windows: tuple[Window, ...]

    def worst(self, windows: Iterable[Window] | None = None) -> Worst:
        """The largest error over ``windows`` (all of them by default)."""
        best: Worst | None = None  # ties: the first window and client
        for w in self.windows if windows is None else windows:
            for i, e in enumerate(w.error):
                if e is not None and (best is None or e > best.error):
                    best = Worst(e, w.index, self.names[i], w.admitted[i], float(w.fair[i]))
        return best or Worst(0.0, -1, "nobody offered anything", 0, 0.0)

    def share(self, names: Iterable[str]) -> float:
        """The named clients' hits admitted over their max-min hits, summed over the run."""
        which = [self.names.index(n) for n in names]
        got = sum(w.admitted[i] for w in self.windows for i in which)
        fair = sum(w.fair[i] for w in self.windows for i in which)
        return float(got / fair) if fair else 1.0

    def admitted(self) -> tuple[tuple[int, ...], ...]:
        """Per window, each client's admitted hits: what two stores must agree on."""
        return tuple(w.admitted for w in self.windows)


def _lives(scenario: Scenario) -> list[tuple[float, float]]:
    return [
        (min(p.start for p in c.phases), max(p.stop for p in c.phases)) for c in scenario.clients
    ]


def figures(scenario: Scenario, cap: Cap, result: ConfigResult) -> Figures:
    """The figures (see the module docstring) of ``result``, a run of ``scenario`` on ``cap``."""
    if not result.windows or result.cap is None or result.cap.window != cap.window:
        raise ValueError(f"{result.label}: not a run whose windows are the cap's ({cap})")
    costs = [c.cost.fixed or max(c.cost.values) for c in scenario.clients]
    lives = _lives(scenario)
    n = len(scenario.clients)
    out = []
    for w in result.windows:
        fair = [
            Fraction(x)
            for x in maxmin(list(w.offered), [cap.client_limit] * n, [1] * n, cap.capacity)
        ]
        error = [
            max(0.0, abs(a - float(f)) - cost) / float(f) if d > 0 else None
            for d, a, f, cost in zip(w.offered, w.admitted_by_client, fair, costs, strict=True)
        ]
        total, fair_total = sum(w.admitted_by_client), sum(fair)
        ratios = [a / float(f) for a, f in zip(w.admitted_by_client, fair, strict=True) if f > 0]
        inside = [
            t for life in lives for t in life if w.start + 1e-9 < t < w.start + cap.window - 1e-9
        ]
        out.append(
            Window(
                w.index,
                w.start,
                w.end,
                w.offered,
                w.admitted_by_client,
                tuple(fair),
                tuple(error),
                float(total / fair_total) if fair_total else 1.0,
                jain(ratios),
                max(w.admitted, total) / cap.capacity,
                bool(inside),
            )
        )
    return Figures(tuple(c.name for c in scenario.clients), cap, tuple(out))


def scenario_text(name: str, duration: int, tick: float, clients: Sequence[str]) -> str:
    """A scenario of ``clients`` (each a flow-style YAML mapping) asking on (route=api),
    (client_id=<client>) of the one config ``simulated`` writes (fair.yaml, labelled
    fairlimit), for ``duration`` seconds in ticks of ``tick``."""
    lines = "\n".join(f"  - {c}" for c in clients)
    return f"""name: {name}
domain: fair
descriptors:
  - [{{key: route, value: api}}, {{key: client_id, value: "{{client}}"}}]
configs:
  - {{label: fairlimit, path: fair.yaml}}
duration: {duration}
tick: {tick}
clients:
{lines}
"""


def retrying_batch(capacity: int) -> str:
    """A batch job (a ``scenario_text`` client) asking four times ``capacity`` a second and
    sending each refused request again, up to three times, 50 ms apart."""
    return f"{{name: batch, rate: {4 * capacity}, retries: {{max: 3, backoff: 0.05}}}}"


def phased(name: str, start: float, stop: float, rate: float) -> str:
    """A client (a ``scenario_text`` client) asking ``rate`` requests a second, evenly
    spread, from ``start`` to ``stop``."""
    return f"{{name: {name}, phases: [{{start: {start}, stop: {stop}, rate: {rate}}}]}}"


def late_one_shot_at(at: float) -> str:
    """The shared late-one-shot case's first minute with its one-shot from ``at``: six
    clients asking once every 4 s from 0 s, 1,500 asked in 0.1 s (its cap, of 900 a minute
    for 7 clients: ``fairness_cases.flat_config(900, "minute", 900, 7)``)."""
    late = phased("late", at, round(at + 0.1, 2), 15000)
    clients = ["{name: sparse, count: 6, rate: 0.25}", late]
    return scenario_text(f"the shared late one-shot at {at} s", 60, 0.05, clients)


def page_user(
    name: str, start: float, stop: float, every: int, page: int, length: float = 0.01
) -> str:
    """A user (a ``scenario_text`` client) loading a page of ``page`` requests within
    ``length`` seconds every ``every`` seconds from ``start`` to ``stop``."""
    phase = f"every: {every}, for: {length}, rate: {round(page / length)}"
    return f"{{name: {name}, phases: [{{start: {start}, stop: {stop}, {phase}}}]}}"


async def simulated(
    scenario: str, config: str, where: Path, store: Callable[[], Store] | None = None
) -> Figures:
    """The figures of one engine run of the scenario text ``scenario``, whose config
    labelled ``fairlimit`` is ``fair.yaml`` (the text ``config``), both written to
    ``where``; on ``store`` (a factory, as the engine takes it) or memory."""
    (where / "fair.yaml").write_text(config)
    (where / "scenario.yaml").write_text(scenario)
    loaded = load_scenario(where / "scenario.yaml")
    result = await engine.run_async(loaded, store=store)
    run = next(c for c in result.configs if c.label == "fairlimit")
    return figures(loaded, read_cap(where / "fair.yaml"), run)


def summary(name: str, f: Figures, bursty: Sequence[str]) -> str:
    """One line of the figures: worst error, lowest utilisation, Jain, the bursty clients' share."""
    settled = [w for w in f.windows if not w.changed]
    low = min(f.windows, key=lambda w: w.utilisation)
    jain_all = min(w.jain for w in f.windows)
    jain_settled = min((w.jain for w in settled), default=math.nan)
    return (
        f"{name}: {f.worst()}; utilisation min {low.utilisation:.3f} (window {low.index}); "
        f"Jain min {jain_all:.3f} (settled windows {jain_settled:.3f}); "
        f"max/cap {max(w.over for w in f.windows):.3f}; bursty share {f.share(bursty):.3f}"
    )
