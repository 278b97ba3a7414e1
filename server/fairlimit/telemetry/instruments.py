"""OpenTelemetry instruments, created once through the API; the SDK is wired in the CLI.

Per rule (attributes ``domain`` and ``rule``, the rule path; ``value``, the request's
``key=value`` path, only where the rule sets ``detailed_metric``), with envoyproxy/ratelimit's
meanings, in hits: ``ratelimit.hits`` (upstream's total_hits; Prometheus adds ``_total``),
``.over_limit`` (shadow-mode overs included), ``.near_limit`` (admitted hits that took the
rule past the near-limit ratio, 80% unless set, of its current limit), ``.within_limit``,
``.shadow_mode``. Per cap rule, observable gauges read from the last ``refresh``
(attributes ``domain`` and ``rule``; never a client value): see ``fairness``; the ratios end
in ``_ratio``, as Prometheus names unit-less ratios.
Service: ``fairlimit.rpc.duration``, ``fairlimit.rpc.shed``, ``fairlimit.backend.errors``,
``fairlimit.rpc.failed_open``, ``fairlimit.rpc.decided_locally``, ``fairlimit.backend.degraded``
(a gauge), ``fairlimit.config.loads``.

Telemetry never fails a request: recording errors are caught, counted and logged once.
"""

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import CallbackOptions, MeterProvider, NoOpMeterProvider, Observation
from opentelemetry.trace import (
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanKind,
    TracerProvider,
)

from fairlimit import __version__
from fairlimit.core.admission import Code, Status
from fairlimit.core.fairshare import CapReport, FairnessFigures
from fairlimit.core.plan import Plan
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded
from fairlimit.core.upstream import override_key, stat_key
from fairlimit.telemetry import latency
from fairlimit.telemetry.concurrency import SlotInstruments
from fairlimit.telemetry.fairness import BucketWatch, CapRow, CapTable
from fairlimit.telemetry.latency import RpcLatency
from fairlimit.telemetry.tokens import TokenInstruments
from fairlimit.telemetry.top import DEFAULT_CAPACITY, TopClients, TopRow
from fairlimit.telemetry.upstream import UpstreamStats

log = logging.getLogger(__name__)

NEAR_LIMIT_RATIO = 0.8  # envoyproxy/ratelimit's default NEAR_LIMIT_RATIO
NO_LEVEL = -1.0  # fair_share_level when λ is infinite (uncontended)

_RULE_COUNTERS = (
    ("hits", "Hits checked against the rule (upstream's total_hits)"),
    ("over_limit", "Hits over the rule's limit (shadow-mode overs included)"),
    ("near_limit", "Admitted hits that took the rule past 80% of its current limit"),
    ("within_limit", "Hits within the rule's limit"),
    ("shadow_mode", "Hits over a shadow-mode rule's limit, answered OK"),
)
_Reading = Callable[[CapRow], float | None]


def _figure(read: Callable[[FairnessFigures], float]) -> _Reading:
    return lambda row: None if row.figures is None else read(row.figures)


def _level(row: CapRow) -> float | None:
    if row.figures is None:
        return None
    level = row.figures.level
    # -1 while uncontended (λ infinite): the OpenTelemetry SDK drops non-finite values, and
    # a series that vanished under light load would look like a broken exporter.
    return NO_LEVEL if math.isinf(level) else level


def _over_declared(row: CapRow) -> float | None:
    return None if row.declared_clients is None else float(row.over_declared)


def _declared(row: CapRow) -> float | None:
    return None if row.declared_clients is None else float(row.declared_clients)


_CAP_GAUGES: tuple[tuple[str, str, str, _Reading], ...] = (
    ("utilization_ratio", "1", "Admitted hits over the cap's capacity, last period",
     _figure(lambda f: f.utilization)),
    ("active_clients", "{client}", "Clients with demand at the cap, last period",
     _figure(lambda f: f.active_clients)),
    ("declared_clients", "{client}", "The cap's fair_share.active_clients", _declared),
    ("fair_share_level", "{hit}/s", "λ per unit weight; -1 when uncontended", _level),
    ("jain_index_ratio", "1", "Jain's index over admitted / max-min fair share",
     _figure(lambda f: f.jain_index)),
    ("top_client_share_ratio", "1", "The largest client's part of the admitted hits",
     _figure(lambda f: f.top_client_share)),
    ("starved_clients", "{client}", "Clients that got under 90% of their fair share",
     _figure(lambda f: f.starved_clients)),
    ("over_declared", "1", "1 when active clients exceed the declared active_clients",
     _over_declared),
)  # fmt: skip


_Key = tuple[tuple[str, str], ...]  # a series' attributes, in order, as dict items


class _Tally:
    """A monotonic counter summed in a dict and reported when a reader collects.

    Recording is one dict update; the SDK's synchronous ``Counter.add`` costs about 15 µs
    (attribute hashing, locks, aggregation) and a request records two or three of them.
    The collecting thread copies the dict in one C call, so it never sees it change size.
    """

    __slots__ = ("_totals",)

    def __init__(self) -> None:
        self._totals: dict[_Key, int] = {}

    def add(self, amount: int, key: _Key) -> None:
        """Add ``amount`` to the series of attributes ``dict(key)``."""
        self._totals[key] = self._totals.get(key, 0) + amount

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(total, dict(key)) for key, total in list(self._totals.items())]


def _records_spans(tracer_provider: TracerProvider | None) -> bool:
    """Whether spans go anywhere: a real provider given, or one installed globally."""
    provider = tracer_provider or trace.get_tracer_provider()
    return not isinstance(provider, NoOpTracerProvider | ProxyTracerProvider)


class Telemetry:
    """The instruments and the fairness rows they report; one per process (or per test)."""

    def __init__(
        self,
        meter_provider: MeterProvider | None = None,
        tracer_provider: TracerProvider | None = None,
        *,
        enabled: bool = True,
        top_clients: int = DEFAULT_CAPACITY,
        rpc_latency: RpcLatency | None = None,
    ) -> None:
        """``rpc_latency``: where the latency histogram is kept when ``telemetry.sdk``
        exports it itself; without it, an SDK histogram records each call."""
        self.enabled = enabled
        self.errors = 0  # recording failures, swallowed so that requests never fail
        self._tracer = trace.get_tracer("fairlimit", __version__, tracer_provider)
        self.tracing = _records_spans(tracer_provider)  # no span machinery per call when not
        meter = metrics.get_meter("fairlimit", __version__, meter_provider)
        self._rule: dict[str, _Tally] = {}
        # (domain, rule path) -> the attributes of its series: built once, not per request
        self._rule_keys: dict[tuple[str, str], _Key] = {}
        for name, text in _RULE_COUNTERS:
            self._rule[name] = _Tally()
            meter.create_observable_counter(
                f"ratelimit.{name}", [self._rule[name].observe], "{hit}", text
            )
        self._latency = rpc_latency
        if rpc_latency is None:
            self._rpc = meter.create_histogram(
                latency.NAME,
                latency.UNIT,
                latency.DESCRIPTION,
                explicit_bucket_boundaries_advisory=latency.BOUNDS,
            )
        self._rpc_attributes: dict[str, dict[str, str]] = {}
        self._backend_errors = meter.create_counter(
            "fairlimit.backend.errors", "{error}", "Store calls that failed (StoreUnavailable)"
        )
        self._shed = meter.create_counter(
            "fairlimit.rpc.shed",
            "{call}",
            "Calls answered by the failure mode because their deadline passed (or left the "
            "backend no time)",
        )
        self._failed_open = meter.create_counter(
            "fairlimit.rpc.failed_open",
            "{call}",
            "Calls answered OK without a decision because the backend was unavailable "
            "(--failure-mode open): no limit was in force for them",
        )
        self._refused = meter.create_counter(
            "fairlimit.rpc.refused",
            "{call}",
            "gRPC calls refused before their message was served, by kind (rate-limit calls, "
            "RLQS streams, other calls) and reason (busy: the kind's budget was full; "
            "evicted: still waiting for its message, it gave its place to a new call; "
            "read_timeout: the message did not arrive within --grpc-read-timeout)",
        )
        self._in_progress: Callable[[], Iterable[tuple[str, int]]] = tuple
        meter.create_observable_gauge(
            "fairlimit.rpc.in_progress",
            [self._calls_in_progress],
            "{call}",
            "gRPC calls in progress by kind (rls, rlqs, other), against the budgets "
            "--grpc-max-concurrent and --rlqs-max-streams",
        )
        self._decided_locally = meter.create_counter(
            "fairlimit.rpc.decided_locally",
            "{call}",
            "Calls decided by this process alone, to its part of every limit, because the "
            "backend was unavailable (--failure-mode local)",
        )
        self._degraded = 0
        meter.create_observable_gauge(
            "fairlimit.backend.degraded",
            [self._degraded_now],
            "1",
            "1 while this process limits alone because the backend was unavailable "
            "(--failure-mode local), until what it admitted is written back and its part has "
            "bounded it for a second more",
        )
        # Exported at 0 from the start: an alert on rate() needs the series before the first
        # incident, and a missing series reads as "no data", not as "never".
        self._failed_open.add(0)
        self._shed.add(0)
        for kind in ("rls", "rlqs"):  # what FairlimitCallBudgetFull watches
            self._refused.add(0, {"kind": kind, "reason": "busy"})
        self._decided_locally.add(0)
        self._loads = meter.create_counter(
            "fairlimit.config.loads", "{load}", "Config loads, by result (success|failure)"
        )
        for name, unit, text, read in _CAP_GAUGES:
            meter.create_observable_gauge(
                f"fairlimit.cap.{name}", [self._observer(read)], unit, text
            )
        meter.create_observable_gauge(
            "fairlimit.cap.mode", [self._modes], "1", "1 for the cap's classification (mode)"
        )
        self.slots = SlotInstruments(meter, self._failed)  # concurrency (telemetry/concurrency)
        self.tokens = TokenInstruments(meter, self._failed)  # token budgets (telemetry/tokens)
        self._rows: tuple[CapRow, ...] = ()
        self.near_limit_ratio = NEAR_LIMIT_RATIO
        self.upstream: UpstreamStats | None = None  # envoyproxy/ratelimit's names, when on
        self._buckets = BucketWatch()
        self._table = CapTable()
        self._top = TopClients(top_clients)  # client values stay here: never an attribute

    @classmethod
    def off(cls) -> "Telemetry":
        """Records nothing (the limiter's default): instruments on the API's no-op providers."""
        return cls(NoOpMeterProvider(), NoOpTracerProvider(), enabled=False)

    def use(self, loaded: Loaded) -> None:
        """The configuration in force from now on."""
        self._buckets.use(loaded)
        self._top.use(loaded)
        self._rule_keys = {}  # the rules of the configuration before may be gone

    def decided(
        self, request: Request, statuses: Sequence[Status], now: float, plan: Plan | None = None
    ) -> None:
        """Count one answered request per rule, and what global buckets gave whom."""
        if not self.enabled:
            return
        try:
            self._count_rules(request, statuses)
            self._buckets.observe(request, statuses, now)
            if self._top.watching:
                self._top.observe(request, statuses, now)
            if self.upstream is not None and plan is not None:
                self._count_upstream(self.upstream, request, statuses, plan)
        except Exception:
            self._failed()

    def _count_upstream(
        self, upstream: UpstreamStats, request: Request, statuses: Sequence[Status], plan: Plan
    ) -> None:
        for descriptor, status, dplan in zip(
            request.descriptors, statuses, plan.descriptors, strict=True
        ):
            if status.current_limit is None or dplan.unlimited:
                continue
            if descriptor.limit is not None or dplan.match is None:
                key = override_key(request.domain, descriptor.entries)
            else:
                key = stat_key(request.domain, descriptor.entries, dplan.match.trail)
            upstream.rule(key, status, request.hits_for(descriptor))

    def _count_rules(self, request: Request, statuses: Sequence[Status]) -> None:
        domain, tallies = request.domain, self._rule
        for descriptor, status in zip(request.descriptors, statuses, strict=True):
            rule, limit = status.rule, status.current_limit
            hits = request.hits_for(descriptor)
            if rule is None or limit is None or hits == 0:
                continue
            if rule.detailed_metric:
                value = "/".join(f"{k}={v}" for k, v in descriptor.entries)
                key: _Key = (("domain", domain), ("rule", rule.path), ("value", value))
            else:
                key = self._rule_key(domain, rule.path)
            tallies["hits"].add(hits, key)
            if status.code is Code.OVER_LIMIT or status.shadowed:
                tallies["over_limit"].add(hits, key)
                if status.shadowed:
                    tallies["shadow_mode"].add(hits, key)
                continue
            tallies["within_limit"].add(hits, key)
            used = limit.requests_per_unit - status.limit_remaining
            near = used - math.floor(limit.requests_per_unit * self.near_limit_ratio)
            if near > 0:
                tallies["near_limit"].add(min(hits, near), key)

    def _rule_key(self, domain: str, path: str) -> _Key:
        """The attributes of a rule's series (``domain``, ``rule``), made once per rule."""
        key = self._rule_keys.get((domain, path))
        if key is None:
            key = self._rule_keys[domain, path] = (("domain", domain), ("rule", path))
        return key

    def backend_error(self) -> None:
        self._safely(self._backend_errors.add, 1)
        if self.upstream is not None:
            self._safely(self.upstream.error, "redis_error")

    def shed(self) -> None:
        self._safely(self._shed.add, 1)

    def refused(self, kind: str, reason: str) -> None:
        """A call of ``kind`` ended before its message was served (busy, read_timeout)."""
        self._safely(self._refused.add, 1, {"kind": kind, "reason": reason})

    def count_calls(self, read: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """Where fairlimit.rpc.in_progress reads its figures: (kind, calls) pairs."""
        self._in_progress = read

    def _calls_in_progress(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(calls, {"kind": kind}) for kind, calls in self._in_progress()]

    def failed_open(self) -> None:
        """One call was answered OK unlimited: the backend failed and the mode is open."""
        self._safely(self._failed_open.add, 1)

    def decided_locally(self) -> None:
        """One call was decided by this process alone (--failure-mode local)."""
        self._safely(self._decided_locally.add, 1)

    def degraded(self, on: bool) -> None:
        """This process limits alone from now on (``on``), or no longer."""
        self._degraded = int(on)

    def config_load(self, ok: bool) -> None:
        self._safely(self._loads.add, 1, {"result": "success" if ok else "failure"})
        if self.upstream is not None:
            self._safely(self.upstream.config_load, ok)

    def rpc_span(
        self, name: str, carrier: Mapping[str, str], attributes: Mapping[str, str]
    ) -> AbstractContextManager[Span]:
        """A SERVER span for one call, current while open; its parent the W3C context in
        ``carrier`` (the call's metadata). Only worth making when ``tracing``."""
        return self._tracer.start_as_current_span(
            name, propagate.extract(carrier), SpanKind.SERVER, attributes
        )

    def rpc_finished(self, seconds: float, result: str) -> None:
        """One ShouldRateLimit call took ``seconds``; ``result`` is its code's name."""
        if not self.enabled:
            return
        try:  # what _safely does, without its call on every request
            if self._latency is not None:
                self._latency.record(seconds, result)
            else:
                attributes = self._rpc_attributes.get(result)
                if attributes is None:  # one per code name: the SDK copies what it keeps
                    attributes = self._rpc_attributes[result] = {"result": result}
                self._rpc.record(seconds, attributes)
        except Exception:
            self._failed()
        if self.upstream is not None:
            self._safely(self.upstream.call, seconds)
            if result == "INVALID_ARGUMENT":
                self._safely(self.upstream.error, "service_error")

    def _safely(self, record: Callable[..., None], *args: object) -> None:
        if not self.enabled:
            return
        try:
            record(*args)
        except Exception:
            self._failed()

    def refresh(
        self, loaded: Loaded, reports: Iterable[CapReport], now: float
    ) -> tuple[CapRow, ...]:
        """Rebuild the fairness rows the gauges read; returns them (for /rlconfig).

        When disabled, or when rebuilding fails, the previous rows stay and are returned.
        """
        if not self.enabled:
            return self._rows
        try:
            self._rows = self._table.rows(loaded, reports, self._buckets.figures(now))
        except Exception:
            self._failed()
        return self._rows

    def top(self, n: int, now: float) -> tuple[TopRow, ...]:
        """Each cap's top ``n`` clients by demand and by rejections (``telemetry.top``)."""
        if not self.enabled:
            return ()
        try:
            return self._top.report(n, now)
        except Exception:
            self._failed()
            return ()

    @property
    def top_capacity(self) -> int:
        """The most clients ``top`` can rank per cap (0: not recorded)."""
        return self._top.capacity if self.enabled else 0

    def _failed(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("telemetry failed; requests go on (further failures are counted)")

    def _observer(self, read: _Reading) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            out = []
            for row in self._rows:
                value = read(row)
                if value is not None:
                    out.append(Observation(value, {"domain": row.domain, "rule": row.rule}))
            return out

        return observe

    def _degraded_now(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._degraded)]

    def _modes(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(1, {"domain": r.domain, "rule": r.rule, "mode": r.mode.value})
            for r in self._rows
        ]
