"""RLQS instruments: streams, buckets, assigned rates and reported usage.

Gauges (``QuotaFigures``, worked out from the state the quota service publishes when they are
read, at most once a FIGURES_SECONDS, so that no division pays for them):
``fairlimit.rlqs.streams``, ``fairlimit.rlqs.buckets`` (subscriptions, one per stream and
bucket), ``fairlimit.rlqs.assigned_rate`` (the token-bucket rates assigned, summed per
domain) and ``fairlimit.rlqs.headroom`` (assigned above the grants, summed per domain).
Counters: ``fairlimit.rlqs.reports``, ``fairlimit.rlqs.requests`` (reported usage, by
``result`` allowed|denied) and ``fairlimit.rlqs.refused_buckets`` (new buckets a report had
refused at a cap, by ``cap`` stream|process: a refused bucket counts at each report that
lists it). Attributes are the domain, the result and the cap only, never a bucket's values.
Recording never fails a stream.
"""

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, NoOpMeterProvider, Observation

from fairlimit import __version__
from fairlimit.core.quota import Strategy, TokenBucket

log = logging.getLogger(__name__)

FIGURES_SECONDS = 1.0  # the figures are worked out again at most this often (a full scan)
# Per stream: its domain, and each of its buckets' strategy in force and headroom (its part
# of the assigned rate above the grants).
Streams = Iterable[tuple[str, Iterable[tuple[Strategy | None, float]]]]


@dataclass(frozen=True, slots=True)
class QuotaFigures:
    """The RLQS state the gauges show."""

    streams: int = 0
    buckets: Mapping[str, int] = field(default_factory=dict)  # by domain
    assigned_rate: Mapping[str, float] = field(default_factory=dict)  # by domain
    headroom: Mapping[str, float] = field(default_factory=dict)  # by domain


def figures_of(streams: Streams) -> QuotaFigures:
    """The figures of ``streams``: subscriptions, and the token-bucket rates assigned and
    their headroom, summed per domain (a blanket rule assigns no rate)."""
    count = 0
    buckets: dict[str, int] = {}
    rates: dict[str, float] = {}
    headroom: dict[str, float] = {}
    for domain, held in streams:
        count += 1
        subscriptions = 0
        for strategy, extra in held:
            subscriptions += 1
            if not isinstance(strategy, TokenBucket):
                continue
            rates[domain] = rates.get(domain, 0.0) + strategy.rate
            headroom[domain] = headroom.get(domain, 0.0) + extra
        buckets[domain] = buckets.get(domain, 0) + subscriptions
    return QuotaFigures(count, buckets, rates, headroom)


class QuotaTelemetry:
    """The RLQS instruments; one per process (or per test)."""

    def __init__(self, meter_provider: MeterProvider | None = None, *, enabled: bool = True):
        self.enabled = enabled
        self.errors = 0
        # The state the figures are worked out from, and the clock that paces it (the quota
        # service publishes both); the last figures and when they were worked out.
        self._source: Callable[[], Streams] | None = None
        self._now: Callable[[], float] = lambda: 0.0
        self._figured: tuple[float, QuotaFigures] | None = None
        meter = metrics.get_meter("fairlimit", __version__, meter_provider)
        gauges: tuple[tuple[str, str, str, Callable[[], Iterable[Observation]]], ...] = (
            ("streams", "{stream}", "Open RLQS streams", self._streams),
            ("buckets", "{bucket}", "Bucket subscriptions (stream x bucket)",
             self._by_domain(lambda f: f.buckets)),
            ("assigned_rate", "{request}/s", "Token-bucket rates assigned to Envoys",
             self._by_domain(lambda f: f.assigned_rate)),
            ("headroom", "{request}/s", "Assigned above the max-min grants",
             self._by_domain(lambda f: f.headroom)),
        )  # fmt: skip
        for name, unit, text, read in gauges:
            meter.create_observable_gauge(f"fairlimit.rlqs.{name}", [_callback(read)], unit, text)
        self._reports = meter.create_counter(
            "fairlimit.rlqs.reports", "{report}", "RLQS usage reports received"
        )
        self._requests = meter.create_counter(
            "fairlimit.rlqs.requests", "{request}", "Requests Envoys reported, by result"
        )
        self._refused = meter.create_counter(
            "fairlimit.rlqs.refused_buckets",
            "{bucket}",
            "New buckets refused at a cap (stream: --rlqs-max-buckets-per-stream, process:"
            " --rlqs-max-buckets); each report that lists one counts it",
        )

    def publish(self, source: Callable[[], Streams], now: Callable[[], float]) -> None:
        """The gauges read ``source`` (at most once a FIGURES_SECONDS of ``now``)."""
        self._source, self._now, self._figured = source, now, None

    def stale(self) -> None:
        """The state changed at once (a stream closed): the next read works it out again."""
        self._figured = None

    @property
    def figures(self) -> QuotaFigures:
        """The figures as the state stands (none without a quota service)."""
        if self._source is None:
            return QuotaFigures()
        now = self._now()
        if self._figured is not None and now - self._figured[0] < FIGURES_SECONDS:
            return self._figured[1]
        figures = figures_of(self._source())
        self._figured = (now, figures)
        return figures

    @classmethod
    def off(cls) -> "QuotaTelemetry":
        return cls(NoOpMeterProvider(), enabled=False)

    def reported(self, domain: str, allowed: int, denied: int) -> None:
        """One usage report of a stream in ``domain``, with its totals."""
        if not self.enabled:
            return
        try:
            self._reports.add(1, {"domain": domain})
            self._requests.add(allowed, {"domain": domain, "result": "allowed"})
            self._requests.add(denied, {"domain": domain, "result": "denied"})
        except Exception:
            self._failed()

    def refused(self, domain: str, cap: str, count: int) -> None:
        """A report of a stream in ``domain`` had ``count`` new buckets refused at ``cap``."""
        if not self.enabled:
            return
        try:
            self._refused.add(count, {"domain": domain, "cap": cap})
        except Exception:
            self._failed()

    def _failed(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("RLQS telemetry failed; streams go on (further failures are counted)")

    def _streams(self) -> Iterable[Observation]:
        return [Observation(self.figures.streams)]

    def _by_domain(
        self, read: Callable[[QuotaFigures], Mapping[str, float]]
    ) -> Callable[[], Iterable[Observation]]:
        return lambda: [Observation(v, {"domain": d}) for d, v in read(self.figures).items()]


def _callback(
    read: Callable[[], Iterable[Observation]],
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    return lambda options: read()
