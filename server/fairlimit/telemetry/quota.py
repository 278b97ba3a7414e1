"""RLQS instruments: streams, buckets, assigned rates and reported usage.

Gauges (read from the last ``QuotaFigures`` the quota service hands in):
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

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QuotaFigures:
    """The RLQS state the gauges show."""

    streams: int = 0
    buckets: Mapping[str, int] = field(default_factory=dict)  # by domain
    assigned_rate: Mapping[str, float] = field(default_factory=dict)  # by domain
    headroom: Mapping[str, float] = field(default_factory=dict)  # by domain


class QuotaTelemetry:
    """The RLQS instruments; one per process (or per test)."""

    def __init__(self, meter_provider: MeterProvider | None = None, *, enabled: bool = True):
        self.enabled = enabled
        self.errors = 0
        # Where the figures come from when they are read (the quota service sets it), so
        # that no division pays for them: read by the gauges at each collection.
        self.source: Callable[[], QuotaFigures] | None = None
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

    @property
    def figures(self) -> QuotaFigures:
        """The figures as the state stands (none without a quota service)."""
        return self.source() if self.source is not None else QuotaFigures()

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
