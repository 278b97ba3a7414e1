"""The OpenTelemetry SDK, wired once by ``fairlimit serve`` (cli.py); the rest uses the API.

Metrics always go to a Prometheus registry that the admin ``/metrics`` renders. OTLP export
(gRPC) is added per signal when the standard variables name an endpoint:
``OTEL_EXPORTER_OTLP_ENDPOINT`` for both, or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the exporters read every other ``OTEL_*`` setting
(headers, TLS, timeouts, export interval) themselves. Without an OTLP traces endpoint no
span is recorded, but the W3C context still flows.
"""

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"


@dataclass
class Sdk:
    """The installed providers and the registry ``/metrics`` renders."""

    registry: CollectorRegistry
    meter_provider: MeterProvider
    tracer_provider: TracerProvider | None = None

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
    # No exemplars: the Prometheus text exposition does not carry them, and the default
    # trace-based filter costs every histogram record about 3 µs (a third of it).
    provider = MeterProvider(
        metric_readers=readers, resource=resource, exemplar_filter=AlwaysOffExemplarFilter()
    )
    sdk = Sdk(registry, provider)
    metrics.set_meter_provider(sdk.meter_provider)
    if "traces" in signals:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        sdk.tracer_provider = TracerProvider(resource=resource)
        sdk.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(sdk.tracer_provider)
    if signals:
        log.info("exporting %s by OTLP", " and ".join(sorted(signals)))
    return sdk
