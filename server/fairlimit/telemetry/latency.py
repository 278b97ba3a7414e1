"""The ShouldRateLimit latency histogram, aggregated here at a few hundred ns a call.

The OpenTelemetry SDK's ``Histogram.record`` costs 10-30 µs of a call's CPU in the server
(a measurement object, attribute copying and hashing, three locks, the exemplar path), a
tenth of the whole call. The API has no observable histogram, so ``fairlimit serve`` keeps
the counts here and exports them as the SDK's own cumulative explicit-bucket aggregation
would report them (``telemetry/sdk.py``: a Prometheus collector, an exporter around OTLP's).
Where nothing exports them (tests with readers of their own, OTLP with delta temporality)
``Telemetry`` records through the SDK instead: both routes export the same metric.
"""

import math
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass

NAME = "fairlimit.rpc.duration"
UNIT = "s"
DESCRIPTION = "ShouldRateLimit latency, by result"
BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class Point:
    """One series (attributes ``{"result": result}``) as of a collection, cumulative."""

    result: str
    start_ns: int  # when its first value came, as the SDK's aggregation starts a series
    count: int
    sum: float
    bucket_counts: tuple[int, ...]
    min: float
    max: float


class _Series:
    __slots__ = ("counts", "max", "min", "start_ns", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.start_ns = time.time_ns()


class RpcLatency:
    """Call durations by result, in the explicit buckets ``BOUNDS`` (upper bounds
    inclusive, as the SDK buckets them), with sum, min and max per result."""

    def __init__(self, bounds: tuple[float, ...] = BOUNDS) -> None:
        self.bounds = bounds
        self._series: dict[str, _Series] = {}
        # Readers collect from other threads (OTLP's exporter): a point is read whole.
        self._lock = threading.Lock()

    def record(self, seconds: float, result: str) -> None:
        """One call of ``seconds`` that ended with ``result`` (a code's name). Values the
        SDK would drop (negative, not finite) are dropped."""
        if not 0.0 <= seconds < math.inf:
            return
        series = self._series.get(result)
        if series is None:
            series = self._series.setdefault(result, _Series(len(self.bounds) + 1))
        index = bisect_left(self.bounds, seconds)
        with self._lock:
            series.counts[index] += 1
            series.sum += seconds
            if seconds < series.min:
                series.min = seconds
            if seconds > series.max:
                series.max = seconds

    def points(self) -> list[Point]:
        """Every series so far, cumulative, in the order their first values came."""
        with self._lock:
            return [
                Point(result, s.start_ns, sum(s.counts), s.sum, tuple(s.counts), s.min, s.max)
                for result, s in list(self._series.items())
            ]
