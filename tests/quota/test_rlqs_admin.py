"""RLQS in a real fairlimit process: /rlconfig and /metrics show streams, buckets, usage."""

import json
import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from servers import ROOT, fairlimit_server

pytestmark = pytest.mark.process

Reports = rlqs_pb2.RateLimitQuotaUsageReports


def reports(done: threading.Event) -> Iterator[Reports]:
    """One report for two buckets; the stream then stays open until ``done`` is set."""
    yield Reports(
        domain="edge",
        bucket_quota_usages=[
            Reports.BucketQuotaUsage(
                bucket_id={"bucket": {"route": "public", "client_id": client}},
                num_requests_allowed=allowed,
                num_requests_denied=denied,
            )
            for client, allowed, denied in (("alice", 7, 0), ("bob", 3, 2))
        ],
    )
    done.wait()


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return str(response.read().decode())


class TestAdmin:
    def test_rlconfig_and_metrics_show_streams_buckets_and_usage(self) -> None:
        """An open stream with two buckets: /rlconfig lists both with their assignment and
        usage; /metrics counts the stream, the buckets and the reported requests."""
        done = threading.Event()
        config = str(ROOT / "examples" / "envoy" / "rlqs-descriptors.yaml")
        with (
            fairlimit_server("--config", config) as server,
            grpc.insecure_channel(server.target) as channel,
        ):
            stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
            responses = stub.StreamRateLimitQuotas(reports(done))
            first = next(responses)
            assert {a.bucket_id.bucket["client_id"] for a in first.bucket_action} == {
                "alice",
                "bob",
            }
            view = json.loads(get(server.admin_port, "/rlconfig"))["rlqs"]
            metrics = get(server.admin_port, "/metrics")
            done.set()
            responses.cancel()
        (stream,) = view["streams"]
        assert stream["domain"] == "edge"
        buckets = {b["bucket"]["client_id"]: b for b in stream["buckets"]}
        assert buckets["alice"]["descriptor"] == "route=public/client_id=alice"
        assert (buckets["bob"]["requests_allowed"], buckets["bob"]["requests_denied"]) == (3, 2)
        bucket = buckets["alice"]["assignment"]["token_bucket"]
        assert bucket["rate_per_second"] == pytest.approx(50.0)  # unmeasured: offered its bound
        assert sample(metrics, "fairlimit_rlqs_streams") == 1
        assert sample(metrics, "fairlimit_rlqs_buckets", 'domain="edge"') == 2
        assert sample(metrics, "fairlimit_rlqs_assigned_rate_per_second") == 100
        allowed, denied = 'result="allowed"', 'result="denied"'
        assert sample(metrics, "fairlimit_rlqs_requests_total", allowed) == 10
        assert sample(metrics, "fairlimit_rlqs_requests_total", denied) == 2


def sample(metrics: str, name: str, label: str = "") -> float:
    """The value of the one Prometheus sample ``name`` whose labels include ``label``."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") and label in line
    ]
    assert len(values) == 1, (name, label, [x for x in metrics.splitlines() if "rlqs" in x])
    return values[0]
