"""OpenTelemetry instruments, created once through the API; the SDK is wired in the CLI.

``Telemetry`` is what the limiter, the servicer and the app record into; it holds the
instrument groups, each in its module: the per-rule hit counters with envoyproxy/ratelimit's
meanings (``rules``), the service's instruments on calls, the backend and config loads
(``calls``), the per-cap fairness gauges (``caps``, read from the last ``refresh``), slots
(``concurrency``) and token budgets (``tokens``).

Telemetry never fails a request: recording errors are caught, counted and logged once.
"""

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import MeterProvider, NoOpMeterProvider
from opentelemetry.trace import (
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanKind,
    TracerProvider,
)

from fairlimit import __version__
from fairlimit.core.admission import Status
from fairlimit.core.fairshare import CapReport
from fairlimit.core.plan import Plan
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Loaded, Rule
from fairlimit.telemetry.calls import CallInstruments
from fairlimit.telemetry.caps import CapGauges
from fairlimit.telemetry.concurrency import SlotInstruments
from fairlimit.telemetry.fairness import BucketWatch, CapRow, CapTable
from fairlimit.telemetry.latency import RpcLatency
from fairlimit.telemetry.rules import Key, RuleCounters, count_upstream
from fairlimit.telemetry.tokens import TokenInstruments
from fairlimit.telemetry.top import DEFAULT_CAPACITY, TopClients, TopRow
from fairlimit.telemetry.upstream import UpstreamStats

log = logging.getLogger(__name__)

NEAR_LIMIT_RATIO = 0.8  # envoyproxy/ratelimit's default NEAR_LIMIT_RATIO


def _records_spans(tracer_provider: TracerProvider | None) -> bool:
    """Whether spans go anywhere: a real provider given, or one installed globally."""
    provider = tracer_provider or trace.get_tracer_provider()
    return not isinstance(provider, NoOpTracerProvider | ProxyTracerProvider)


class Telemetry:
    """The instrument groups and the fairness rows they report; one per process (or per
    test)."""

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
        self._rules = RuleCounters(meter)  # ratelimit.* (telemetry/rules)
        self._latency = rpc_latency
        self._calls = CallInstruments(meter, sdk_latency=rpc_latency is None)  # telemetry/calls
        self._caps = CapGauges(meter)  # fairlimit.cap.* (telemetry/caps)
        self.slots = SlotInstruments(meter, self._failed)  # concurrency (telemetry/concurrency)
        self.tokens = TokenInstruments(meter, self._failed)  # token budgets (telemetry/tokens)
        self.near_limit_ratio = NEAR_LIMIT_RATIO
        self.upstream: UpstreamStats | None = None  # envoyproxy/ratelimit's names, when on
        self._buckets = BucketWatch()
        self._table = CapTable()
        self._top = TopClients(top_clients)  # client values stay here: never an attribute
        self._watching_top = False  # _top.watching, as of the last ``use`` (read per call)

    @classmethod
    def off(cls) -> "Telemetry":
        """Records nothing (the limiter's default): instruments on the API's no-op providers."""
        return cls(NoOpMeterProvider(), NoOpTracerProvider(), enabled=False)

    def use(self, loaded: Loaded) -> None:
        """The configuration in force from now on."""
        self._buckets.use(loaded)
        self._top.use(loaded)
        self._watching_top = self._top.watching
        self._rules.forget_rules()

    def decided(
        self, request: Request, statuses: Sequence[Status], now: float, plan: Plan | None = None
    ) -> None:
        """Count one answered request per rule, and what global buckets gave whom."""
        if not self.enabled:
            return
        try:
            self._rules.count(request, statuses, self.near_limit_ratio)
            self._buckets.observe(request, statuses, now)
            if self._watching_top:
                self._top.observe(request, statuses, now)
            if self.upstream is not None and plan is not None:
                count_upstream(self.upstream, request, statuses, plan)
        except Exception:
            self._failed()

    def count_rule(self, key: Key, hits: int, over: bool, per_unit: int, remaining: int) -> None:
        """Count one descriptor's hits in the rule counters' series ``key`` (what ``decided``
        counts for it; for a caller that decides without statuses, flows/fast.py): refused
        (``over``), or within its limit of ``per_unit`` with ``remaining`` left. Raises
        what recording raises (the caller counts it as ``failed``)."""
        self._rules.add(key, hits, over, False, per_unit, remaining, self.near_limit_ratio)

    def rule_series(self, request: Request, descriptor: Descriptor, rule: Rule) -> Key:
        """The attributes of the rule counters' series ``descriptor`` counts in."""
        return self._rules.series(request.domain, descriptor, rule)

    def counts_only(self, paths: Iterable[str]) -> bool:
        """Whether ``decided`` does no more for requests matching only the rules at
        ``paths`` than count the rule counters: none is a watched global bucket or has its
        top clients kept, and upstream's stat names are off."""
        if self.upstream is not None:
            return False
        return not any(self._buckets.watches(p) or self._top.watches(p) for p in paths)

    def failed(self) -> None:
        """Recording failed (the caller caught it): counted, logged once."""
        self._failed()

    def backend_error(self) -> None:
        self._safely(self._calls.backend_errors.add, 1)
        if self.upstream is not None:
            self._safely(self.upstream.error, "redis_error")

    def shed(self) -> None:
        self._safely(self._calls.shed.add, 1)

    def refused(self, kind: str, reason: str) -> None:
        """A call of ``kind`` ended before its message was served (busy, read_timeout)."""
        self._safely(self._calls.refused.add, 1, {"kind": kind, "reason": reason})

    def count_calls(self, read: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """Where fairlimit.rpc.in_progress reads its figures: (kind, calls) pairs."""
        self._calls.in_progress = read

    def failed_open(self) -> None:
        """One call was answered OK unlimited: the backend failed and the mode is open."""
        self._safely(self._calls.failed_open.add, 1)

    def decided_locally(self) -> None:
        """One call was decided by this process alone (--failure-mode local)."""
        self._safely(self._calls.decided_locally.add, 1)

    def degraded(self, on: bool) -> None:
        """This process limits alone from now on (``on``), or no longer."""
        self._calls.degraded = int(on)

    def config_load(self, ok: bool) -> None:
        self._safely(self._calls.loads.add, 1, {"result": "success" if ok else "failure"})
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
                self._calls.record_latency(seconds, result)
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
            return self._caps.rows
        try:
            self._caps.rows = self._table.rows(loaded, reports, self._buckets.figures(now))
        except Exception:
            self._failed()
        return self._caps.rows

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
