"""The latency histogram kept by telemetry.latency exports what the SDK's own would."""

import math
from collections.abc import Iterable

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from fairlimit.telemetry import Telemetry, latency, sdk
from fairlimit.telemetry.latency import RpcLatency
from fairlimit.telemetry.sdk import LatencyCollector, LatencyExporter

pytestmark = pytest.mark.unit

# Every bucket: each bound itself (upper bounds are inclusive), just past it, zero, past the
# last bound; values the SDK drops (negative, not finite) are dropped alike.
EDGES = [0.0, *latency.BOUNDS, *(b * 1.0001 for b in latency.BOUNDS), 3.5, 120.0]
DROPPED = [-0.001, math.nan, math.inf]
CALLS = [
    *((s, "OK") for s in EDGES),
    *((s / 3, "OVER_LIMIT") for s in EDGES[::2]),
    (0.0123, "INVALID_ARGUMENT"),
    *((s, "OK") for s in DROPPED),
]


class Exported:
    """A meter provider with a Prometheus reader and an OTLP-like periodic one, and the
    Telemetry recording on it: through the SDK's histogram, or kept in an RpcLatency and
    exported as ``serve`` does (``sdk.LatencyCollector``, ``sdk.LatencyExporter``)."""

    def __init__(self, local: bool) -> None:
        self.registry = CollectorRegistry()
        self.kept = _Kept()
        exporter: MetricExporter = self.kept
        self.latency = RpcLatency() if local else None
        if self.latency is not None:
            self.registry.register(LatencyCollector(self.latency))
            exporter = LatencyExporter(exporter, self.latency)
        self.periodic = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
        readers = [PrometheusMetricReader(registry=self.registry), self.periodic]
        self.provider = MeterProvider(metric_readers=readers,
                                      exemplar_filter=AlwaysOffExemplarFilter())  # fmt: skip
        self.telemetry = Telemetry(self.provider, TracerProvider(), rpc_latency=self.latency)

    def calls(self, calls: Iterable[tuple[float, str]]) -> None:
        for seconds, result in calls:
            self.telemetry.rpc_finished(seconds, result)

    def text(self) -> list[str]:
        """The /metrics lines of the histogram, in order."""
        lines = generate_latest(self.registry).decode().splitlines()
        return [line for line in lines if "fairlimit_rpc_duration" in line]

    def metric(self) -> tuple[Metric, MetricsData]:
        """What the periodic reader exports on a flush (a collection)."""
        self.periodic.force_flush()
        data = self.kept.exported[-1]
        found = [(m, s.scope) for r in data.resource_metrics for s in r.scope_metrics
                 for m in s.metrics if m.name == latency.NAME]  # fmt: skip
        assert len(found) == 1, found
        return found[0][0], found[0][1]

    def close(self) -> None:
        self.provider.shutdown()


def _fields(point: HistogramDataPoint) -> tuple[object, ...]:
    """What a point says, its timestamps aside (each side reads its own clock)."""
    return (dict(point.attributes or {}), point.count, point.sum, tuple(point.bucket_counts),
            tuple(point.explicit_bounds), point.min, point.max, list(point.exemplars))  # fmt: skip


@pytest.fixture
def both() -> Iterable[tuple[Exported, Exported]]:
    sdk, local = Exported(local=False), Exported(local=True)
    yield sdk, local
    sdk.close()
    local.close()


class TestSameAsTheSdk:
    def test_prometheus_text_is_the_same(self, both: tuple[Exported, Exported]) -> None:
        """/metrics shows the same HELP, TYPE, buckets, sum and count, line for line."""
        sdk, local = both
        assert sdk.text() == local.text() == []  # no series before the first call
        for exported in both:
            exported.calls(CALLS)
        assert local.text() == sdk.text()
        assert 'fairlimit_rpc_duration_seconds_count{otel_scope_name="fairlimit"' in "".join(
            local.text()
        )

    def test_points_are_the_same_collection_after_collection(
        self, both: tuple[Exported, Exported]
    ) -> None:
        """OTLP sees one cumulative histogram of the same name, unit, description, scope
        and points; a second collection goes on counting from the first."""
        sdk, local = both
        for part in (CALLS[:10], CALLS[10:]):
            for exported in both:
                exported.calls(part)
            (ours, our_scope), (theirs, their_scope) = local.metric(), sdk.metric()
            assert (ours.name, ours.unit, ours.description) == (
                theirs.name, theirs.unit, theirs.description)  # fmt: skip
            assert our_scope == their_scope
            assert ours.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
            assert theirs.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
            assert [_fields(p) for p in ours.data.data_points] == [
                _fields(p) for p in theirs.data.data_points
            ]

    def test_a_series_starts_when_its_first_value_comes(self, both: tuple[Exported, Exported]
                                                         ) -> None:  # fmt: skip
        """The start time is the first value's, and collecting moves only the point's time."""
        _, local = both
        local.calls([(0.002, "OK")])
        first, _ = local.metric()
        second, _ = local.metric()
        a, b = first.data.data_points[0], second.data.data_points[0]
        assert a.start_time_unix_nano == b.start_time_unix_nano <= a.time_unix_nano
        assert a.time_unix_nano <= b.time_unix_nano


class TestRpcLatency:
    def test_buckets_by_inclusive_upper_bounds(self) -> None:
        """A value equal to a bound counts in that bound's bucket; past the last, the last."""
        kept = RpcLatency((0.1, 0.2))
        for seconds in (0.0, 0.1, 0.1000001, 0.2, 5.0):
            kept.record(seconds, "OK")
        (point,) = kept.points()
        assert point.bucket_counts == (2, 2, 1)
        assert (point.count, point.min, point.max) == (5, 0.0, 5.0)
        assert point.sum == pytest.approx(5.4000001)


class _Kept(MetricExporter):
    """An OTLP stand-in: keeps what the periodic reader exports."""

    def __init__(self) -> None:
        super().__init__()
        self.exported: list[MetricsData] = []

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: object) -> MetricExportResult:  # fmt: skip
        self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        return None


class TestExport:
    def test_the_periodic_otlp_reader_exports_it(self) -> None:
        """What serve's OTLP reader sends carries the histogram kept outside the SDK."""
        kept, source = _Kept(), RpcLatency()
        reader = PeriodicExportingMetricReader(
            LatencyExporter(kept, source), export_interval_millis=3_600_000
        )
        provider = MeterProvider(metric_readers=[reader])
        telemetry = Telemetry(provider, TracerProvider(), rpc_latency=source)
        telemetry.rpc_finished(0.003, "OK")
        telemetry.rpc_finished(0.2, "OVER_LIMIT")
        provider.force_flush()
        provider.shutdown()
        points = {
            dict(p.attributes or {})["result"]: p.count
            for data in kept.exported for r in data.resource_metrics
            for s in r.scope_metrics for m in s.metrics if m.name == latency.NAME
            for p in m.data.data_points
        }  # fmt: skip
        assert points == {"OK": 1, "OVER_LIMIT": 1}

    @pytest.mark.parametrize(
        ("environ", "kept_here"),
        [
            ({}, True),
            ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
            ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
              "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "DELTA"}, False),
            ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
              "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "lowmemory"}, False),
            ({"OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "delta"}, True),
        ],
    )  # fmt: skip
    def test_delta_histograms_over_otlp_keep_the_sdks(
        self, environ: dict[str, str], kept_here: bool
    ) -> None:
        """Only cumulative points are made here: OTLP asked for delta histograms keeps the
        SDK's histogram (no OTLP, the delta setting concerns nobody)."""
        assert sdk.keeps_latency(environ) is kept_here
