"""What a simulation reports (per client, the shared cap, the fairness figures) as text or JSON."""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fairlimit.core.fairshare import FairnessFigures, fairness_figures
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan, plan
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded, RateLimit
from fairlimit.core.units import Algorithm, Shape
from fairlimit.simulate.levels import most_between


@dataclass(frozen=True, slots=True)
class ClientResult:
    """One client's traffic under one config. ``success`` = admitted originals / offered."""

    name: str
    offered: int  # original requests
    attempted: int  # originals and retries
    admitted: int
    rejected: int
    success: float
    admitted_per_second: float  # over the client's own active time
    per_second: tuple[int, ...]  # hits admitted in each scenario second
    group: str = ""  # identical clients share one (one band in the plot)
    offered_hits: int = 0  # hits (tokens) of the original requests
    admitted_hits: int = 0


@dataclass(frozen=True, slots=True)
class CapCheck:
    """A limit the clients were charged at: the most it admitted in any one of its windows,
    and in any span of one window's length wherever it starts (``span_start`` seconds in).

    A fixed window holds the limit and a span across its edge up to twice that; under
    ``sliding`` no span holds more than the limit, under ``gcra`` the limit + ``burst``.
    """

    path: str  # the rule's, with rate_limits[i] when it has several limits
    mode: str | None  # the loader's classification of the rule, when it has one
    limit: int
    window: int
    max_admitted: int
    instances: int = 1  # counters of this rule the clients were charged at
    max_in_span: int = 0
    span_start: float = 0.0
    shape: Shape | None = None  # calendar windows, sliding or GCRA (None: a fixed window)

    @property
    def algorithm(self) -> str:
        return (Algorithm.FIXED if self.shape is None else self.shape.algorithm).value

    @property
    def burst(self) -> int:
        return 0 if self.shape is None else self.shape.burst

    @property
    def bound(self) -> int:
        return self.limit + self.burst

    @property
    def smooth(self) -> bool:
        return self.algorithm != Algorithm.FIXED.value

    @property
    def exceeded(self) -> bool:
        """More than the limit in a window, or, for a smooth algorithm, in any span."""
        return (self.max_in_span if self.smooth else self.max_admitted) > self.bound


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One window of the root limit: demand, what max-min could admit, what was admitted."""

    index: int
    start: float  # scenario seconds
    end: float
    complete: bool  # the run covered the whole window
    achievable: float
    admitted: int  # at the root counter
    level: float | None  # λ at the root cap at the window's last second (None: not a cap, cold)
    offered: tuple[int, ...]  # per client, hits of original requests
    admitted_by_client: tuple[int, ...]

    @property
    def utilisation(self) -> float | None:
        return self.admitted / self.achievable if self.achievable > 0 else None


@dataclass(frozen=True, slots=True)
class SharedLimit:
    """The limit every client is charged against: where the cap and fairness are measured."""

    key: str  # its counter key
    check: CapCheck  # max_admitted still 0
    hits: tuple[int, ...]  # per client: what one admitted request adds to its counter
    capacity: float  # per second
    limits: tuple[float, ...]  # per client, per second: its own limit under the cap
    weights: tuple[float, ...]
    # per client: the limits of the rule just below the cap (none outside a cap), which
    # bound it over a span longer than the cap's window too (a quota of 1000 an hour is
    # at most 1000 in a minute, however much of the cap is left each second)
    own: tuple[tuple[RateLimit, ...], ...] = ()

    def figures(
        self, demands: Sequence[float], admitted: Sequence[float], start: float, end: float
    ) -> FairnessFigures:
        """The fairness figures for per-second ``demands`` and ``admitted`` from ``start``
        to ``end`` (the limiter's clock), per client: its limit is the least of its limit
        in the cap's window and the most its own limits admit in that span, per second."""
        span = end - start
        limits = [
            min(limit, most_between(own, start, end) / span) if own else limit
            for limit, own in zip(self.limits, self.own or [()] * len(self.limits), strict=True)
        ]
        return fairness_figures(demands, admitted, limits, self.weights, self.capacity)


def shared_limit(loaded: Loaded, requests: Sequence[Request]) -> SharedLimit | None:
    """The outermost fair-share cap all ``requests`` are charged at, else a counter they share.

    A shared counter outside any cap (a global bucket) counts every client as a client of it,
    with its whole limit as each one's own limit and weight 1.
    """
    matcher = Matcher(loaded.config)
    plans = [plan(r, matcher) for r in requests]
    keys = [s.cap for s in plans[0].shares] + [c.key for c in plans[0].counters]
    common = [k for k in keys if all(any(c.key == k for c in p.counters) for p in plans)]
    if not common:
        return None
    counters = [next(c for c in p.counters if c.key == common[0]) for p in plans]
    shares = [next((s for s in p.shares if s.cap == common[0]), None) for p in plans]
    index = plans[0].counters.index(counters[0])
    rule = next(lv.rule for d in plans[0].descriptors for lv in d.charges if lv.counter == index)
    path = rule.path if rule else common[0]
    modes = [c.mode.value for c in loaded.classifications if c.path == path]
    limit, window = counters[0].limit, counters[0].window
    return SharedLimit(
        common[0],
        CapCheck(path, modes[0] if modes else None, limit, window, 0),
        tuple(c.hits for c in counters),
        limit / window,
        tuple(s.client_limit / s.window if s else limit / window for s in shares),
        tuple(s.weight if s else 1.0 for s in shares),
        tuple(_below_cap(p, common[0]) for p in plans),
    )


def _below_cap(request_plan: Plan, cap: str) -> tuple[RateLimit, ...]:
    """The limits of the rule just below the cap counted at ``cap`` (none outside a cap)."""
    for dplan in request_plan.descriptors:
        trail = dplan.match.trail if dplan.match is not None else ()
        for charge in dplan.charges:
            if charge.share is not None and request_plan.shares[charge.share].cap == cap:
                depth = next((i for i, r in enumerate(trail) if r is charge.rule), -1)
                return trail[depth + 1].limits if 0 <= depth < len(trail) - 1 else ()
    return ()


@dataclass(frozen=True, slots=True)
class ConfigResult:
    label: str
    path: str
    clients: tuple[ClientResult, ...]
    cap: CapCheck | None  # None when no limit is shared by every client
    figures: FairnessFigures | None  # at that limit, per second, over the steady part
    limiter_calls: int
    levels: tuple[CapCheck, ...] = ()  # every rule charged, worst instance and window
    windows: tuple[WindowResult, ...] = ()  # of the root limit
    levels_per_second: tuple[float | None, ...] = ()  # λ at the root cap, end of each second


@dataclass(frozen=True, slots=True)
class Summary:
    """The scenario as the report restates it."""

    name: str
    source: str
    duration: float
    tick: float
    steady: tuple[float, float]
    clients: int


@dataclass(frozen=True, slots=True)
class Result:
    summary: Summary
    configs: tuple[ConfigResult, ...]


def _window(seconds: int) -> str:
    names = {1: "1-s", 60: "1-min", 3600: "1-h", 86400: "1-day"}
    return names.get(seconds, f"{seconds}-s")


def _share(count: int, cap: CapCheck) -> str:
    return f" ({count / cap.limit:.0%})" if cap.limit else ""


def _span(cap: CapCheck) -> str:
    """The busiest span of one window, when it says more than the windows do."""
    most = f"{cap.max_in_span}{_share(cap.max_in_span, cap)}"
    if cap.smooth:
        return f"; in any {cap.window:g} s at most {most}"
    if cap.max_in_span <= cap.max_admitted:
        return ""
    return f"; across a window's edge {most} in the {cap.window:g} s from {cap.span_start:g} s"


def _per(cap: CapCheck) -> str:
    """A limit's window: ``1-s``, ``5-min``, ``calendar month in Europe/Berlin``."""
    calendar = cap.shape.calendar if cap.shape is not None else None
    if calendar is not None:
        return f"calendar {calendar.unit.name.lower()} in {calendar.name}"
    return _window(cap.window)


def _how(cap: CapCheck) -> str:
    """How a limit counts, when not in fixed windows: `` (sliding)``, `` (gcra, burst 20)``."""
    if not cap.smooth:
        return ""
    return f" ({cap.algorithm}" + (f", burst {cap.burst}" if cap.burst else "") + ")"


def _cap_line(cap: CapCheck, root: bool) -> str:
    verdict = "EXCEEDED" if cap.exceeded else "never exceeded"
    most = f"at most {cap.max_admitted}{_share(cap.max_admitted, cap)}"
    if root:
        return (
            f"cap {cap.limit} per {_per(cap)} window{_how(cap)}: "
            f"{most} admitted in one{_span(cap)}, {verdict}"
        )
    many = f" x{cap.instances}" if cap.instances > 1 else ""
    return (
        f"  level {cap.path}{many}: {cap.limit} per {_per(cap)}{_how(cap)}, "
        f"{most}{_span(cap)}, {verdict}"
    )


def _level(value: float | None) -> str:
    if value is None:
        return "none (cold start)"
    return "inf (fits)" if math.isinf(value) else f"{value:.0f}"


def _utilisation_line(config: ConfigResult) -> str | None:
    """Admitted / achievable at the root: the first window, the worst later one, overall."""
    measured = [w for w in config.windows if w.complete and w.utilisation is not None]
    if not measured:
        return None
    first, later = measured[0], measured[1:]
    worst = min(later, key=lambda w: w.utilisation or 0.0) if later else None
    admitted = sum(w.admitted for w in measured)
    achievable = sum(w.achievable for w in measured)
    levels = config.levels_per_second
    level = f"; λ at the end {_level(levels[-1])}" if any(x is not None for x in levels) else ""
    then = (
        f", then lowest {worst.utilisation:.2f} ({worst.start:g}-{worst.end:g} s)" if worst else ""
    )
    return (
        f"utilisation (admitted/achievable): first window {first.utilisation:.2f}{then}, "
        f"overall {admitted / achievable:.2f}{level}"
    )


def jain_shown(figures: FairnessFigures) -> float | None:
    """Jain's index as the report shows it: None (undefined) when clients were owed a share
    and none got anything, where the core's 0/0 reads 1 (every ratio equal, all zero)."""
    starved_all = figures.starved_clients > 0 and figures.top_client_share == 0
    return None if starved_all else figures.jain_index


def _figures_line(figures: FairnessFigures, steady: tuple[float, float]) -> str:
    level = "inf (fits)" if math.isinf(figures.level) else f"{figures.level:.0f}/s"
    jain = jain_shown(figures)
    shown = "Jain undefined (nothing admitted)" if jain is None else f"Jain {jain:.2f}"
    return (
        f"fairness {steady[0]:g}-{steady[1]:g} s: "
        f"{shown}, top client {figures.top_client_share:.0%}, "
        f"starved {figures.starved_clients}/{figures.active_clients}, level {level}"
    )


def _rows(clients: Sequence[ClientResult]) -> list[ClientResult]:
    """One row per client, or per group of identical clients (their mean, named so)."""
    groups: dict[str, list[ClientResult]] = {}
    for c in clients:
        groups.setdefault(c.group or c.name, []).append(c)
    rows = []
    for name, members in groups.items():
        if len(members) == 1:
            rows.append(members[0])
            continue
        mean = _total(members, f"{name} x{len(members)} (each)")
        n = len(members)
        rows.append(
            ClientResult(
                mean.name,
                round(mean.offered / n),
                round(mean.attempted / n),
                round(mean.admitted / n),
                round(mean.rejected / n),
                mean.success,
                mean.admitted_per_second / n,
                (),
                name,
                round(mean.offered_hits / n),
                round(mean.admitted_hits / n),
            )
        )
    return rows


def _table(config: ConfigResult, width: int, hits: bool, duration: float) -> list[str]:
    head: tuple[str, ...] = ("offered", "attempted", "admitted", "rejected", "success")
    head += ("admitted/s", "hits admitted") if hits else ("admitted/s",)
    lines = [f"{'client':<{width}}" + "".join(f"{h:>{11 if len(h) < 11 else 14}}" for h in head)]
    for c in [*_rows(config.clients), _total(config.clients, "total", duration)]:
        cells = (c.offered, c.attempted, c.admitted, c.rejected)
        lines.append(
            f"{c.name:<{width}}"
            + "".join(f"{n:>11}" for n in cells)
            + f"{c.success:>11.1%}{c.admitted_per_second:>11.1f}"
            + (f"{c.admitted_hits:>14}" if hits else "")
        )
    return lines


def _total(
    clients: Sequence[ClientResult], name: str, duration: float | None = None
) -> ClientResult:
    """The sums of ``clients``; admitted/s is all admitted over ``duration`` (the run's),
    or, without one, the sum of their rates (a group's, each over its own active time:
    summed over clients active at different times it would pass the cap)."""
    offered = sum(c.offered for c in clients)
    admitted = sum(c.admitted for c in clients)
    rate = sum(c.admitted_per_second for c in clients)
    return ClientResult(
        name,
        offered,
        sum(c.attempted for c in clients),
        admitted,
        sum(c.rejected for c in clients),
        admitted / offered if offered else 1.0,
        admitted / duration if duration else rate,
        (),
        name,
        sum(c.offered_hits for c in clients),
        sum(c.admitted_hits for c in clients),
    )


def _heading(config: ConfigResult) -> str:
    cap = config.cap
    shared = f": {cap.path}" + (f" ({cap.mode})" if cap.mode else "") if cap else ""
    return f"[{config.label}] {Path(config.path).name}{shared}"


def text(result: Result) -> str:
    """Every config's table and figures, one after the other, for one screen."""
    s = result.summary
    lines = [
        f"scenario {s.name} ({Path(s.source).name}): {s.duration:g} s in ticks of {s.tick:g} s, "
        f"{s.clients} clients",
        "success = original requests eventually admitted (after retries) / offered",
    ]
    rows = [r for cfg in result.configs for r in _rows(cfg.clients)]
    width = max([6] + [len(r.name) for r in rows]) + 1
    hits = any(c.offered_hits != c.offered for cfg in result.configs for c in cfg.clients)
    for config in result.configs:
        lines += ["", _heading(config), *_table(config, width, hits, s.duration)]
        if config.cap is None:
            lines.append("no limit is shared by every client: no cap to check")
        lines += [
            _cap_line(c, i == 0 and config.cap is not None) for i, c in enumerate(config.levels)
        ]
        if config.cap is not None and config.cap.smooth:
            lines.append(
                f"(utilisation and fairness are measured in fixed windows: "
                f"not for a {config.cap.algorithm} limit)"
            )
            continue
        utilisation = _utilisation_line(config)
        if utilisation is not None:
            lines.append(utilisation)
        if config.figures is not None:
            lines.append(_figures_line(config.figures, s.steady))
    return "\n".join(lines)


def _figures_json(figures: FairnessFigures | None) -> dict[str, Any] | None:
    if figures is None:
        return None
    return {
        "utilization": figures.utilization,
        "active_clients": figures.active_clients,
        "level_per_second": None if math.isinf(figures.level) else figures.level,
        "jain_index": jain_shown(figures),
        "top_client_share": figures.top_client_share,
        "starved_clients": figures.starved_clients,
    }


def _number(value: float | None) -> float | str | None:
    """JSON has no infinity: λ = inf (every demand fits) is written "inf"."""
    return "inf" if value is not None and math.isinf(value) else value


def _check_json(cap: CapCheck) -> dict[str, Any]:
    return {
        "path": cap.path,
        "mode": cap.mode,
        "limit": cap.limit,
        "window_seconds": cap.window,
        "counters": cap.instances,
        "max_admitted_in_a_window": cap.max_admitted,
        "max_admitted_over_limit": cap.max_admitted / cap.limit if cap.limit else None,
        "algorithm": cap.algorithm,
        **({"burst": cap.burst} if cap.algorithm == Algorithm.GCRA.value else {}),
        **({"calendar": cap.shape.calendar.name} if cap.shape and cap.shape.calendar else {}),
        "max_admitted_in_a_span": cap.max_in_span,
        "busiest_span_start": cap.span_start,
        "exceeded": cap.exceeded,
    }


def _window_json(window: WindowResult, clients: Sequence[ClientResult]) -> dict[str, Any]:
    return {
        "index": window.index,
        "start": window.start,
        "end": window.end,
        "complete": window.complete,
        "achievable": window.achievable,
        "admitted": window.admitted,
        "utilisation": window.utilisation,
        "level": _number(window.level),
        "clients": [
            {"name": c.name, "offered_hits": o, "admitted_hits": a}
            for c, o, a in zip(clients, window.offered, window.admitted_by_client, strict=True)
        ],
    }


def _config_json(config: ConfigResult) -> dict[str, Any]:
    cap = config.cap
    return {
        "label": config.label,
        "path": config.path,
        "limiter_calls": config.limiter_calls,
        "clients": [
            {
                "name": c.name,
                "offered": c.offered,
                "attempted": c.attempted,
                "admitted": c.admitted,
                "rejected": c.rejected,
                "success": c.success,
                "admitted_per_second": c.admitted_per_second,
                "admitted_each_second": list(c.per_second),
                "group": c.group,
                "offered_hits": c.offered_hits,
                "admitted_hits": c.admitted_hits,
            }
            for c in config.clients
        ],
        "levels": [_check_json(c) for c in config.levels],
        "windows": [_window_json(w, config.clients) for w in config.windows],
        "level_each_second": [_number(x) for x in config.levels_per_second],
        "cap": None if cap is None else _check_json(cap),
        "fairness": _figures_json(config.figures),
    }


def as_json(result: Result) -> dict[str, Any]:
    """The same report as a JSON-ready mapping (a level of null: demand fitted the cap)."""
    s = result.summary
    return {
        "scenario": {
            "name": s.name,
            "file": s.source,
            "duration": s.duration,
            "tick": s.tick,
            "steady": list(s.steady),
        },
        "configs": [_config_json(c) for c in result.configs],
    }
