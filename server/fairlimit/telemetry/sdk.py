"""The OpenTelemetry SDK, wired once by ``fairlimit serve`` (cli.py); the rest uses the API.

Metrics always go to a Prometheus registry that the admin ``/metrics`` renders. OTLP export
(gRPC) is added per signal when the standard variables name an endpoint:
``OTEL_EXPORTER_OTLP_ENDPOINT`` for both, or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the exporters read every other ``OTEL_*`` setting
(headers, TLS, timeouts, export interval) themselves. Without an OTLP traces endpoint no
span is recorded, but the W3C context still flows.

The ShouldRateLimit latency histogram is aggregated by ``telemetry.latency`` (the SDK's
per-call record path was a tenth of a call's CPU); every reader made here adds it to what it
collects, as the SDK would have reported it. OTLP with delta temporality for histograms
keeps the SDK's own aggregation (``Sdk.latency`` is None then).
"""

import dataclasses
import logging
import time
from collections.abc import Mapping
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

from fairlimit import __version__
from fairlimit.telemetry import latency
from fairlimit.telemetry.latency import RpcLatency

log = logging.getLogger(__name__)

_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
_TEMPORALITY = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
SCOPE = "fairlimit"  # the meter's name (telemetry/instruments.py)


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
    if "metrics" in signals:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    rpc_latency = None
    if keeps_latency(environ):
        rpc_latency = RpcLatency()
        for reader in readers:
            exporting_latency(reader, rpc_latency)
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


def exporting_latency(reader: MetricReader, source: RpcLatency) -> MetricReader:
    """``reader``, which from now on adds ``fairlimit.rpc.duration`` from ``source`` to what
    it collects (cumulative, as the SDK's explicit-bucket aggregation reports it)."""
    receive = reader._receive_metrics  # what every reader implements; collect() calls it

    def receive_with_latency(metrics_data: MetricsData, *args: Any, **kwargs: Any) -> None:
        receive(with_latency(metrics_data, source), *args, **kwargs)

    reader._receive_metrics = receive_with_latency  # type: ignore[method-assign]
    return reader


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
