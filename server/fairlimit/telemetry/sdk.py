"""The OpenTelemetry SDK, wired once by ``fairlimit serve`` (cli.py); the rest uses the API.

Metrics always go to a Prometheus registry that the admin ``/metrics`` renders. OTLP export
(gRPC) is added per signal when the standard variables name an endpoint:
``OTEL_EXPORTER_OTLP_ENDPOINT`` for both, or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the exporters read every other ``OTEL_*`` setting
(headers, TLS, timeouts, export interval) themselves. Without an OTLP traces endpoint no
span is recorded, but the W3C context still flows.

The ShouldRateLimit latency histogram is aggregated by ``telemetry.latency`` (the SDK's
per-call record path was a tenth of a call's CPU) and exported, as the SDK's cumulative
explicit-bucket aggregation would report it, through public interfaces only: a
prometheus_client collector on ``/metrics``'s registry (``LatencyCollector``) and an
exporter around OTLP's (``LatencyExporter``). OTLP with delta temporality for histograms
keeps the SDK's own aggregation (``Sdk.latency`` is None then).
"""

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily

from fairlimit import __version__
from fairlimit.telemetry import latency
from fairlimit.telemetry.latency import RpcLatency

log = logging.getLogger(__name__)

_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
_TEMPORALITY = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
SCOPE = "fairlimit"  # the meter's name (telemetry/instruments.py)
# what the Prometheus reader names fairlimit.rpc.duration (unit s: _seconds; the family
# adds _bucket, _count and _sum)
_PROMETHEUS_NAME = "fairlimit_rpc_duration_seconds"


@dataclass
class Sdk:
    """The installed providers and the registry ``/metrics`` renders."""

    registry: CollectorRegistry
    meter_provider: MeterProvider
    tracer_provider: TracerProvider | None = None
    latency: RpcLatency | None = None  # where Telemetry records the latency histogram

    def shutdown(self) -> None:
        """Flush and stop the exporters (on exit)."""
        self.meter_provider.shutdown()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()


def otlp_signals(environ: Mapping[str, str]) -> set[str]:
    """Which of ``metrics`` and ``traces`` the environment asks to export by OTLP/gRPC."""
    wanted = set()
    for signal in ("metrics", "traces"):
        upper = signal.upper()
        if not (environ.get(_ENDPOINT) or environ.get(f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT")):
            continue
        protocol = environ.get(f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL")
        protocol = (protocol or environ.get(_PROTOCOL) or "grpc").strip().lower()
        if protocol != "grpc":
            log.warning("OTLP %s: protocol %r is not built in (grpc is); not exporting", signal,
                        protocol)  # fmt: skip
            continue
        wanted.add(signal)
    return wanted


def _resource(environ: Mapping[str, str]) -> Resource:
    named = "OTEL_SERVICE_NAME" in environ or "service.name=" in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    return Resource.create({} if named else {"service.name": "fairlimit"})


def install(environ: Mapping[str, str]) -> Sdk:
    """Set the global meter (and, with OTLP, tracer) provider; returns what was made."""
    resource = _resource(environ)
    registry = CollectorRegistry()
    readers: list[MetricReader] = [PrometheusMetricReader(registry=registry)]
    signals = otlp_signals(environ)
    rpc_latency = RpcLatency() if keeps_latency(environ) else None
    if rpc_latency is not None:
        registry.register(LatencyCollector(rpc_latency))
    if "metrics" in signals:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        exporter: MetricExporter = OTLPMetricExporter()
        if rpc_latency is not None:
            exporter = LatencyExporter(exporter, rpc_latency)
        readers.append(PeriodicExportingMetricReader(exporter))
    # No exemplars: the Prometheus text exposition does not carry them, and the default
    # trace-based filter costs every histogram record about 3 µs (a third of it).
    provider = MeterProvider(
        metric_readers=readers, resource=resource, exemplar_filter=AlwaysOffExemplarFilter()
    )
    sdk = Sdk(registry, provider, latency=rpc_latency)
    metrics.set_meter_provider(sdk.meter_provider)
    if "traces" in signals:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        sdk.tracer_provider = TracerProvider(resource=resource)
        sdk.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(sdk.tracer_provider)
    if signals:
        log.info("exporting %s by OTLP", " and ".join(sorted(signals)))
    return sdk


def keeps_latency(environ: Mapping[str, str]) -> bool:
    """Whether the latency histogram is kept outside the SDK (``RpcLatency``): unless OTLP
    exports metrics with histograms as deltas (its temporality setting), which the SDK's own
    aggregation reports and ours does not."""
    delta = environ.get(_TEMPORALITY, "").strip().lower() in ("delta", "lowmemory")
    return not (delta and "metrics" in otlp_signals(environ))


class LatencyCollector:
    """The latency histogram on ``/metrics``: a prometheus_client custom collector on the
    registry ``serve``'s Prometheus reader renders into, writing the lines that reader
    writes for the SDK's own histogram (name, HELP, TYPE, the scope's labels, buckets)."""

    def __init__(self, source: RpcLatency) -> None:
        self.source = source
        self.scope = {"otel_scope_name": SCOPE, "otel_scope_schema_url": "",
                      "otel_scope_version": __version__}  # fmt: skip

    def collect(self) -> Iterator[HistogramMetricFamily]:
        points = self.source.points()
        if not points:
            return  # no series before the first call, as the SDK's
        family = HistogramMetricFamily(
            _PROMETHEUS_NAME, latency.DESCRIPTION, labels=[*self.scope, "result"]
        )
        bounds = [str(bound) for bound in self.source.bounds] + ["+Inf"]
        for p in points:
            buckets = list(zip(bounds, itertools.accumulate(p.bucket_counts), strict=True))
            family.add_metric([*self.scope.values(), p.result], buckets, p.sum)
        yield family


class LatencyExporter(MetricExporter):
    """A metric exporter that sends what it is given with the latency histogram added
    (``with_latency``), through ``inner`` (OTLP's): the SDK's public exporter interface."""

    def __init__(self, inner: MetricExporter, source: RpcLatency) -> None:
        # the reader aggregates for this exporter: with the inner one's preferences
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self.inner = inner
        self.source = source

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        return self.inner.export(with_latency(metrics_data, self.source), timeout_millis,
                                 **kwargs)  # fmt: skip

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis, **kwargs)


def with_latency(metrics_data: MetricsData, source: RpcLatency) -> MetricsData:
    """``metrics_data`` with the latency histogram in fairlimit's scope (each resource's)."""
    if metrics_data is None or not metrics_data.resource_metrics:
        return metrics_data  # nothing collected: no resource to put it under
    now = time.time_ns()
    points = source.points()
    if not points:
        return metrics_data
    metric = Metric(
        name=latency.NAME,
        description=latency.DESCRIPTION,
        unit=latency.UNIT,
        data=Histogram(
            data_points=[
                HistogramDataPoint(
                    attributes={"result": p.result},
                    start_time_unix_nano=p.start_ns,
                    time_unix_nano=now,
                    count=p.count,
                    sum=p.sum,
                    bucket_counts=p.bucket_counts,
                    explicit_bounds=source.bounds,
                    min=p.min,
                    max=p.max,
                    exemplars=[],
                )
                for p in points
            ],
            aggregation_temporality=AggregationTemporality.CUMULATIVE,
        ),
    )
    resources = []
    for resource in metrics_data.resource_metrics:
        scopes = list(resource.scope_metrics)
        at = next((i for i, s in enumerate(scopes) if s.scope.name == SCOPE), None)
        if at is None:
            scope = InstrumentationScope(SCOPE, __version__)
            scopes.append(ScopeMetrics(scope=scope, metrics=[metric], schema_url=""))
        else:
            found = scopes[at]
            scopes[at] = dataclasses.replace(found, metrics=[*found.metrics, metric])
        resources.append(dataclasses.replace(resource, scope_metrics=scopes))
    return MetricsData(resource_metrics=resources)
