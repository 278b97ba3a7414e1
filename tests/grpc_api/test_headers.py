"""Response headers under upstream's QUOTA_MODE, from a real server process over gRPC."""

from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ServerProcess

pytestmark = pytest.mark.process

D = ratelimit_pb2.RateLimitDescriptor
RLS = rls_pb2.RateLimitResponse
CONFIG = """\
domain: quotas
descriptors:
  - key: closed
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5}
"""


class TestQuotaMode:
    def test_a_pass_reports_the_quota_that_had_room(self, tmp_path: Path) -> None:
        """QUOTA_MODE=true and LIMIT_RESPONSE_HEADERS_ENABLED=true: a request whose (closed)
        is over and whose (user) has room passes, and its headers say what (user) has, 5
        an hour and 4 left; they would say 0 and 0, (closed)'s, were the reported status
        chosen as if (closed) had refused it."""
        config = tmp_path / "quotas.yaml"
        config.write_text(CONFIG)
        env = {"QUOTA_MODE": "true", "LIMIT_RESPONSE_HEADERS_ENABLED": "true"}
        server = ServerProcess(["--config", str(config)], env)
        try:
            with grpc.insecure_channel(server.target) as channel:
                stub = rls_pb2_grpc.RateLimitServiceStub(channel)
                request = rls_pb2.RateLimitRequest(domain="quotas", descriptors=[
                    D(entries=[D.Entry(key="closed", value="x")]),
                    D(entries=[D.Entry(key="user", value="u")]),
                ])  # fmt: skip
                answer = stub.ShouldRateLimit(request, timeout=5)
        finally:
            assert server.stop() == 0
        assert answer.overall_code == RLS.OK
        assert [s.code for s in answer.statuses] == [RLS.OVER_LIMIT, RLS.OK]
        headers = {h.key: h.value for h in answer.response_headers_to_add}
        assert (headers["RateLimit-Limit"], headers["RateLimit-Remaining"]) == ("5", "4")
