"""OTLP/gRPC metrics from a real ``fairlimit serve`` to a real MetricsService receiver.

The exporter is OpenTelemetry's own (opentelemetry-exporter-otlp-proto-grpc) on the
generated messages of opentelemetry-proto: this fails when another distribution's older
``opentelemetry/proto`` files replace them (xds-protos did, in the test venv; issue 41).
"""

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.metrics.v1 import metrics_pb2

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.telemetry import latency
from servers import fairlimit_server

pytestmark = pytest.mark.process

CALLS = 5


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """A collector's MetricsService: keeps every export request it is sent."""

    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self._lock = threading.Lock()

    def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: object
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        with self._lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def metrics(self, name: str) -> list[tuple[str, metrics_pb2.Metric]]:
        """Every exported metric called ``name``, with its scope's name, in export order."""
        with self._lock:
            return [
                (scope.scope.name, metric)
                for request in self.requests
                for resource in request.resource_metrics
                for scope in resource.scope_metrics
                for metric in scope.metrics
                if metric.name == name
            ]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    """The receiver, serving on a free loopback port."""
    kept = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(kept, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield kept, port
    finally:
        server.stop(grace=None)


def _request(client: str) -> rls_pb2.RateLimitRequest:
    D = ratelimit_pb2.RateLimitDescriptor
    entries = [D.Entry(key="route", value="public"), D.Entry(key="client_id", value=client)]
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[D(entries=entries)])


class TestOtlpMetrics:
    def test_serve_exports_the_latency_histogram_and_fairness(
        self, receiver: tuple[Receiver, int]
    ) -> None:
        """serve with OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (docs/operations.md): after a few
        real calls, the export made when it stops carries fairlimit.rpc.duration (unit,
        bounds, one count a call) and the caps' fairness gauges, under service fairlimit."""
        kept, port = receiver
        env = {
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"http://127.0.0.1:{port}",
            # only the export at shutdown (the provider's flush) within the test: one read
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",
        }
        with fairlimit_server(env=env) as server:
            server.wait_for(r"exporting metrics by OTLP")
            with grpc.insecure_channel(server.target) as channel:
                stub = rls_pb2_grpc.RateLimitServiceStub(channel)
                codes = [
                    stub.ShouldRateLimit(_request(client), timeout=10).overall_code
                    for client in ("checkout", "batch-etl") * 2 + ("checkout",)
                ]
            assert codes == [rls_pb2.RateLimitResponse.OK] * CALLS
            assert server.stop() == 0, "".join(server.lines)
        log = "".join(server.lines)
        assert "Failed to export" not in log and "Traceback" not in log, log

        [(scope, duration)] = kept.metrics(latency.NAME)
        assert scope == "fairlimit"
        assert duration.unit == latency.UNIT == "s"
        histogram = duration.histogram
        assert histogram.aggregation_temporality == metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
        for point in histogram.data_points:
            assert tuple(point.explicit_bounds) == latency.BOUNDS
            assert len(point.bucket_counts) == len(latency.BOUNDS) + 1
            assert sum(point.bucket_counts) == point.count
        assert sum(point.count for point in histogram.data_points) == CALLS

        [(_, declared)] = kept.metrics("fairlimit.cap.declared_clients")
        by_rule = {
            {a.key: a.value.string_value for a in point.attributes}["rule"]: point.as_double
            for point in declared.gauge.data_points
        }
        assert by_rule["edge/route=public"] == 10  # descriptors/edge.yaml's fair_share cap
        [(_, mode)] = kept.metrics("fairlimit.cap.mode")
        modes = [
            {a.key: a.value.string_value for a in p.attributes} for p in mode.gauge.data_points
        ]
        public = {"domain": "edge", "rule": "edge/route=public", "mode": "per-client-buckets"}
        assert public in modes
        [request] = kept.requests
        resource = request.resource_metrics[0].resource
        assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == (
            "fairlimit"
        )
