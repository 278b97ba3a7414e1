"""SIGTERM with a drain delay: health NOT_SERVING at once, calls answered for the delay.

Kubernetes removes a terminating pod from its endpoints only after the pod got SIGTERM;
until Envoy learns of it, calls keep arriving. Through a real server process.
"""

import signal
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ROOT, ServerProcess

pytestmark = pytest.mark.process

D = ratelimit_pb2.RateLimitDescriptor
REQUEST = rls_pb2.RateLimitRequest(
    domain="edge", descriptors=[D(entries=[D.Entry(key="route", value="public")])]
)


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def _on_a_new_connection(target: str) -> tuple[str, str]:
    """Health and a ShouldRateLimit answer, on a connection opened now."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(target, options) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        reply = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(REQUEST, timeout=5)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    return status, rls_pb2.RateLimitResponse.Code.Name(reply.overall_code)


class TestDrainDelay:
    def test_sigterm_keeps_answering_for_the_drain_delay(self) -> None:
        """--drain-delay: after SIGTERM, health says NOT_SERVING and /readyz 503, yet new
        connections are answered; a second SIGTERM ends the delay and the server exits 0."""
        server = ServerProcess(["--config", str(ROOT / "descriptors"), "--drain-delay", "300"])
        try:
            admin = server.admin_port
            server.process.send_signal(signal.SIGTERM)
            server.wait_for(r"answering calls for 300s more")
            during = _on_a_new_connection(server.target), _readyz(admin)
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(30)
        finally:
            server.stop()
        assert during == (("NOT_SERVING", "OK"), 503)
        assert code == 0
        assert any("draining: health NOT_SERVING" in line for line in server.lines)

    def test_the_delay_is_off_by_default(self) -> None:
        """Without --drain-delay, SIGTERM drains at once, as before."""
        server = ServerProcess(["--config", str(ROOT / "descriptors")])
        code = server.stop()
        assert code == 0
        assert not any("answering calls for" in line for line in server.lines)
