"""Fairness per cap rule, for the gauges and ``/rlconfig``: what monitoring was missing.

Two sources feed one row per classified rule:

- a ``fair_share`` cap: the store's reports (``Store.caps()``), one per cap *instance*. The
  instance key holds client values (a value-less cap has one instance per value of its own
  level, e.g. one tenant cap per tenant), so instances are folded into their rule, and no
  value ever becomes a label: utilisation, active clients and top-client share are the
  maximum over instances (the busiest one), Jain's index the minimum (the least fair one),
  starved clients the sum, λ the smallest finite level (the most contended one).
- a global-bucket-only rule: no store state knows whom a shared counter served, so
  ``BucketWatch`` measures it on the request path. Its clients are named as a cap's are
  (docs/semantics.md, "Matching"): the value a request carries one level below the bucket, here in
  another descriptor of the same request, as Envoy sends ``(route)`` beside
  ``(route, client_id)``. Requests that name no client are not in the figures.

Both measure one period P = min(window, 1 s) = 1 s (windows are whole seconds), so every
figure, λ included, is per second.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fairlimit.core.admission import Code, Status
from fairlimit.core.fairshare import CapReport, FairnessFigures, PeriodDemand, figures_of
from fairlimit.core.keys import parse_counter_key
from fairlimit.core.matching import Entry, Matcher
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded
from fairlimit.core.validation import Mode

PERIOD = 1.0  # seconds: P = min(window, 1 s), and windows are at least 1 s


@dataclass(frozen=True, slots=True)
class CapRow:
    """One rule's fairness, folded over its live instances."""

    domain: str
    rule: str  # the rule path, domain first: no client values
    mode: Mode
    declared_clients: int | None  # fair_share.active_clients; None for a global bucket
    instances: int  # live instances with figures
    figures: FairnessFigures | None  # None until a full period has been seen

    @property
    def over_declared(self) -> bool:
        """Whether more clients are active than the cap was sized for."""
        declared = self.declared_clients
        return (
            self.figures is not None
            and declared is not None
            and (self.figures.active_clients > declared)
        )


def fold(figures: Sequence[FairnessFigures]) -> FairnessFigures:
    """Several instances' figures as one (see the module docstring for each rule)."""
    finite = [f.level for f in figures if not math.isinf(f.level)]
    return FairnessFigures(
        utilization=max(f.utilization for f in figures),
        active_clients=max(f.active_clients for f in figures),
        level=min(finite, default=math.inf),
        jain_index=min(f.jain_index for f in figures),
        top_client_share=max(f.top_client_share for f in figures),
        starved_clients=sum(f.starved_clients for f in figures),
    )


class _Period:
    """One global bucket's demand and admitted hits per client in the current period."""

    __slots__ = ("admitted", "capacity", "demand", "figures", "index")

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity  # hits per period
        self.index = -1
        self.demand: dict[str, int] = {}
        self.admitted: dict[str, int] = {}
        self.figures: FairnessFigures | None = None

    def roll(self, now: float) -> None:
        index = math.floor(now / PERIOD)
        if index == self.index:
            return
        if index == self.index + 1 and self.demand:
            # A shared bucket has no per-client limit and no weights.
            self.figures = figures_of(PeriodDemand.of(self.capacity, self.demand, self.admitted))
        else:
            self.figures = None  # a period without traffic: nothing current to say
        self.index, self.demand, self.admitted = index, {}, {}


class BucketWatch:
    """Who a global bucket served, period by period (state: the clients of one period)."""

    def __init__(self) -> None:
        self._capacity: dict[str, float] = {}  # watched rule path -> capacity per period
        self._periods: dict[str, _Period] = {}

    def use(self, loaded: Loaded) -> None:
        """Watch the global-bucket-only rules of ``loaded`` (dropping the others' state)."""
        self._capacity = {
            c.path: c.cap_per_second * PERIOD
            for c in loaded.classifications
            if c.mode is Mode.GLOBAL_BUCKET_ONLY
        }
        self._periods = {p: s for p, s in self._periods.items() if p in self._capacity}

    def watches(self, path: str) -> bool:
        """Whether the rule at ``path`` is a watched global bucket."""
        return path in self._capacity

    def observe(self, request: Request, statuses: Sequence[Status], now: float) -> None:
        """Count each named client's hits at each watched bucket the request touched."""
        if not self._capacity:
            return
        admitted = all(s.code is Code.OK for s in statuses)
        for descriptor, status in zip(request.descriptors, statuses, strict=True):
            rule = status.rule
            # No current limit: the bucket charged nothing (another descriptor replaced it).
            if rule is None or rule.path not in self._capacity or status.current_limit is None:
                continue
            client = _client_below(request, descriptor.entries)
            if client is None:
                continue
            period = self._periods.get(rule.path)
            if period is None:
                period = self._periods[rule.path] = _Period(self._capacity[rule.path])
            period.roll(now)
            hits = request.hits_for(descriptor)
            period.demand[client] = period.demand.get(client, 0) + hits
            if admitted:
                period.admitted[client] = period.admitted.get(client, 0) + hits

    def figures(self, now: float) -> dict[str, FairnessFigures]:
        """The last full period's figures by rule path (none once traffic has stopped)."""
        out: dict[str, FairnessFigures] = {}
        for path, period in self._periods.items():
            period.roll(now)
            if period.figures is not None:
                out[path] = period.figures
        return out


def _client_below(request: Request, entries: tuple[Entry, ...]) -> str | None:
    depth = len(entries)
    for other in request.descriptors:
        if len(other.entries) == depth + 1 and other.entries[:depth] == entries:
            return other.entries[depth][1]
    return None


class CapTable:
    """Folds store reports and bucket figures into rows, one per classified rule."""

    def __init__(self) -> None:
        self._matcher: tuple[Loaded, Matcher] | None = None

    def _rule_path(self, loaded: Loaded, key: str) -> str | None:
        if self._matcher is None or self._matcher[0] is not loaded:
            self._matcher = (loaded, Matcher(loaded.config))
        parsed = parse_counter_key(key)
        match = self._matcher[1].match(*parsed) if parsed else None
        return match.rule.path if match and match.rule.fair_share else None

    def rows(
        self,
        loaded: Loaded,
        reports: Iterable[CapReport],
        buckets: Mapping[str, FairnessFigures],
    ) -> tuple[CapRow, ...]:
        """The rows for ``loaded``; instances of rules no longer configured are left out."""
        by_rule: dict[str, list[FairnessFigures]] = {}
        for report in reports:
            path = self._rule_path(loaded, report.cap)
            if path is not None and report.figures is not None:
                by_rule.setdefault(path, []).append(report.figures)
        for path, figures in buckets.items():
            by_rule.setdefault(path, []).append(figures)
        domains = {d.source: d.name for d in loaded.config.domains.values()}
        rows = []
        for c in loaded.classifications:
            instances = by_rule.get(c.path, [])
            rows.append(
                CapRow(
                    domain=domains[c.source],
                    rule=c.path,
                    mode=c.mode,
                    declared_clients=c.active_clients,
                    instances=len(instances),
                    figures=fold(instances) if instances else None,
                )
            )
        return tuple(rows)
