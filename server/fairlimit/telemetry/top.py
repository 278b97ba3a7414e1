"""Who is the hog: the top clients of each cap by demand and by rejections, in bounded memory.

A cap's client is named as in docs/semantics.md ("Matching"): the value a request carries one level
below a ``fair_share`` cap; for a global-bucket-only rule, the value one level below the
bucket in another descriptor of the same request (as ``fairness.BucketWatch`` names it). A
client is identified with the cap *instance* above it (``edge/tenant=acme`` for a value-less
tenant cap), so ``alice`` under two tenants is two clients.

Per classified rule, two ``core.heavy.HeavyHitters`` summaries count hits attempted and hits
rejected (over the limit, shadow-mode overs included, as ``ratelimit.over_limit``). They are
kept per interval of ``INTERVAL`` seconds; a report merges the last complete interval with the
current one, so it covers between one and two intervals. Memory is ``O(rules x capacity)``
whatever the number of clients, and the request path pays a dict lookup per descriptor, plus
two dict updates per cap it is charged at. Client values never reach a metric attribute: they
are shown only on the admin port (``GET /top``, ``/rlconfig``). The figures are this
process's: with ``--workers N`` or several replicas each one sees the requests it answered.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fairlimit.core.admission import Code, Status
from fairlimit.core.describe import limit_fields
from fairlimit.core.heavy import HeavyHitters, Hitter
from fairlimit.core.matching import Entry
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Loaded, walk
from fairlimit.core.validation import Mode, most_severe

INTERVAL = 10.0  # seconds per summary; a report covers the last complete one and this one
DEFAULT_CAPACITY = 16  # k: counters per summary (2k at most); top(n) is exact-enough for n <= k

_Client = tuple[Entry, ...]  # the cap instance's entries, then the client's entry


@dataclass(frozen=True, slots=True)
class TopClient:
    """One client at a cap; ``hits`` and ``rejected`` are upper bounds (see ``error``)."""

    client: str
    cap: str  # the cap instance (domain first), e.g. edge/route=public
    hits: int
    rejected: int
    error: int  # the ranked figure overestimates the true count by at most this

    def as_json(self, total: int) -> dict[str, Any]:
        share = self.hits / total if total else 0.0
        return {"client": self.client, "cap": self.cap, "hits": self.hits,
                "rejected": self.rejected, "error": self.error, "share": share}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TopRow:
    """One classified rule's top clients over the last ``seconds``."""

    domain: str
    rule: str
    mode: Mode
    seconds: float
    hits: int  # all hits attempted at the rule (exact)
    rejected: int  # all hits rejected (exact)
    by_demand: tuple[TopClient, ...]
    by_rejections: tuple[TopClient, ...]
    # every limit of the rule (core/describe.limit_fields), a cap's each with its own mode
    limits: tuple[Mapping[str, object], ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The row as ``GET /top`` and ``/rlconfig`` show it."""
        return {
            "domain": self.domain,
            "rule": self.rule,
            "mode": self.mode.value,
            "limits": [dict(limit) for limit in self.limits],
            "seconds": self.seconds,
            "hits": self.hits,
            "rejected": self.rejected,
            "by_demand": [c.as_json(self.hits) for c in self.by_demand],
            "by_rejections": [c.as_json(self.hits) for c in self.by_rejections],
        }


class _Tally:
    """One rule's demand and rejection summaries, interval by interval."""

    __slots__ = ("born", "capacity", "demand", "index", "previous", "rejected", "start", "until")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.born = now  # the first request seen: the figures cover no time before it
        self.index = -2  # no interval yet
        self.start = self.until = 0.0  # the current interval: [start, until)
        self.demand: HeavyHitters[_Client] = HeavyHitters(capacity)
        self.rejected: HeavyHitters[_Client] = HeavyHitters(capacity)
        self.previous: tuple[HeavyHitters[_Client], HeavyHitters[_Client]] | None = None

    def roll(self, now: float) -> None:
        """Start a new interval when ``now`` is past the current one (the common case is two
        float comparisons: this runs on the request path)."""
        if self.start <= now < self.until:
            return
        index = math.floor(now / INTERVAL)
        self.start, self.until = index * INTERVAL, (index + 1) * INTERVAL
        follows = index == self.index + 1 and self.demand.total > 0
        self.previous = (self.demand, self.rejected) if follows else None
        self.index = index
        self.demand, self.rejected = HeavyHitters(self.capacity), HeavyHitters(self.capacity)

    def seconds(self, now: float) -> float:
        start = (self.index - (self.previous is not None)) * INTERVAL
        return max(0.0, now - max(start, self.born))

    def merged(self) -> tuple[HeavyHitters[_Client], HeavyHitters[_Client]]:
        demand: HeavyHitters[_Client] = HeavyHitters(self.capacity)
        rejected: HeavyHitters[_Client] = HeavyHitters(self.capacity)
        for part in (self.previous, (self.demand, self.rejected)):
            if part is not None:
                demand.merge(part[0])
                rejected.merge(part[1])
        return demand, rejected


@dataclass(frozen=True, slots=True)
class _Watch:
    """A rule a matched descriptor counts toward, and where its client is."""

    rule: str
    depth: int  # the client's entry index below a cap; -1: a bucket's client descriptor


class TopClients:
    """The top-clients recorder: ``observe`` on the request path, ``report`` for the admin."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity  # 0 switches the recorder off
        self._watch: dict[str, tuple[_Watch, ...]] = {}  # matched rule path -> its rules
        self._tallies: dict[str, _Tally] = {}
        self._rows: tuple[_Shown, ...] = ()  # the rules to report

    @property
    def watching(self) -> bool:
        """Whether any request can be counted (caps configured and a capacity above 0)."""
        return bool(self._watch)

    def use(self, loaded: Loaded) -> None:
        """Watch the caps and global buckets of ``loaded`` (dropping the others' tallies)."""
        self._rows = _shown(loaded)
        buckets = {c.path for c in loaded.classifications if c.mode is Mode.GLOBAL_BUCKET_ONLY}
        watch: dict[str, tuple[_Watch, ...]] = {}
        for domain in loaded.config.domains.values() if self.capacity > 0 else ():
            for rule, ancestors in walk(domain.rules):
                found = [
                    _Watch(cap.path, depth + 1)
                    for depth, cap in enumerate(ancestors)
                    if cap.fair_share is not None and cap.rate_limit is not None
                ]
                if rule.path in buckets:
                    found.append(_Watch(rule.path, -1))
                if found:
                    watch[rule.path] = tuple(found)
        self._watch = watch
        live = {w.rule for found in watch.values() for w in found}
        self._tallies = {r: t for r, t in self._tallies.items() if r in live}

    def watches(self, path: str) -> bool:
        """Whether requests matching the rule at ``path`` are counted here."""
        return path in self._watch

    def observe(self, request: Request, statuses: Sequence[Status], now: float) -> None:
        """Count each descriptor's hits (and rejected hits) at the rules it is watched for."""
        for descriptor, status in zip(request.descriptors, statuses, strict=True):
            rule = status.rule
            found = None if rule is None else self._watch.get(rule.path)
            if found is None or status.current_limit is None:
                continue
            hits = request.hits_for(descriptor)
            over = status.code is Code.OVER_LIMIT or status.shadowed
            for watch in found:
                client = _client(request, descriptor, watch.depth)
                if client is not None:
                    self._count(watch.rule, client, hits, over, now)

    def _count(self, rule: str, client: _Client, hits: int, over: bool, now: float) -> None:
        tally = self._tallies.get(rule)
        if tally is None:
            tally = self._tallies[rule] = _Tally(self.capacity, now)
        tally.roll(now)
        tally.demand.add(client, hits)
        if over:
            tally.rejected.add(client, hits)

    def report(self, n: int, now: float) -> tuple[TopRow, ...]:
        """Every classified rule's top ``n`` (at most ``capacity``) by demand and rejections."""
        n = max(0, min(n, self.capacity))
        rows = []
        for shown in self._rows:
            domain, path, mode, limits = shown.domain, shown.rule, shown.mode, shown.limits
            tally = self._tallies.get(path)
            if tally is None:
                rows.append(TopRow(domain, path, mode, 0.0, 0, 0, (), (), limits))
                continue
            tally.roll(now)
            demand, rejected = tally.merged()
            rows.append(
                TopRow(
                    domain, path, mode, tally.seconds(now), demand.total, rejected.total,
                    _clients(domain, demand.top(n), demand, rejected, by_rejections=False),
                    _clients(domain, rejected.top(n), demand, rejected, by_rejections=True),
                    limits,
                )
            )  # fmt: skip
        return tuple(rows)


@dataclass(frozen=True, slots=True)
class _Shown:
    """A classified rule as its report names it (made once per config, not per report)."""

    domain: str
    rule: str
    mode: Mode  # a cap classified once per limit: the most severe (validation.most_severe)
    limits: tuple[Mapping[str, object], ...]


def _shown(loaded: Loaded) -> tuple[_Shown, ...]:
    """One row per classified rule (a cap with several limits has a verdict for each, and
    is one row), in classification order, with each limit as the views write it."""
    domains = {d.source: d.name for d in loaded.config.domains.values()}
    rules = loaded.config.rules_by_path()
    out = []
    for path, mine in loaded.verdicts_by_path().items():
        limits = []
        for index, limit in enumerate(rules[path].limits):
            fields = limit_fields(limit)
            mode = next((c.mode for c in mine if c.limit == index), None)
            if mode is not None:  # a cap's limit: its own verdict
                fields["mode"] = mode.value
            limits.append(MappingProxyType(fields))
        out.append(_Shown(domains[mine[0].source], path, most_severe(mine).mode, tuple(limits)))
    return tuple(out)


def _client(request: Request, descriptor: Descriptor, depth: int) -> _Client | None:
    """The cap instance's entries and the client's entry, or None when no client is named."""
    entries = descriptor.entries
    if depth >= 0:
        return entries[: depth + 1] if depth < len(entries) else None
    size = len(entries)  # a bucket: the client is in a descriptor one level deeper
    for other in request.descriptors:
        if len(other.entries) == size + 1 and other.entries[:size] == entries:
            return other.entries
    return None


def _clients(
    domain: str,
    ranked: list[Hitter[_Client]],
    demand: HeavyHitters[_Client],
    rejected: HeavyHitters[_Client],
    *,
    by_rejections: bool,
) -> tuple[TopClient, ...]:
    out = []
    for hitter in ranked:
        item = hitter.item
        cap = "/".join([domain, *(f"{k}={v}" for k, v in item[:-1])])
        error = rejected.error if by_rejections else demand.error
        out.append(
            TopClient(item[-1][1], cap, demand.estimate(item), rejected.estimate(item), error)
        )
    return tuple(out)
