"""gRPC over TLS and mTLS, through real secure channels to a real server process."""

from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ServerProcess
from test_cli import run

pytestmark = pytest.mark.process

D = ratelimit_pb2.RateLimitDescriptor
REQUEST = rls_pb2.RateLimitRequest(
    domain="edge", descriptors=[D(entries=[D.Entry(key="route", value="public")])]
)


def _ask(target: str, credentials: grpc.ChannelCredentials | None) -> rls_pb2.RateLimitResponse:
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, credentials)
    with channel:
        reply: rls_pb2.RateLimitResponse = rls_pb2_grpc.RateLimitServiceStub(
            channel
        ).ShouldRateLimit(REQUEST, timeout=3)
        return reply


class TestTls:
    def test_tls_serves_secure_clients_only(self, tls_files: dict[str, Path]) -> None:
        """With --tls-cert/--tls-key a client trusting the CA is answered; plaintext is not."""
        server = ServerProcess(
            ["--tls-cert", str(tls_files["server.crt"]), "--tls-key", str(tls_files["server.key"])]
        )
        try:
            trust = grpc.ssl_channel_credentials(tls_files["ca.crt"].read_bytes())
            assert _ask(server.target, trust).overall_code == rls_pb2.RateLimitResponse.OK
            with pytest.raises(grpc.RpcError):
                _ask(server.target, None)
        finally:
            assert server.stop() == 0

    def test_mtls_requires_a_client_certificate(self, tls_files: dict[str, Path]) -> None:
        """With --tls-client-ca a client must present a certificate that CA signed."""
        files = {k: str(v) for k, v in tls_files.items()}
        server = ServerProcess(
            [
                "--tls-cert",
                files["server.crt"],
                "--tls-key",
                files["server.key"],
                "--tls-client-ca",
                files["ca.crt"],
            ]
        )
        try:
            ca = tls_files["ca.crt"].read_bytes()
            with pytest.raises(grpc.RpcError):
                _ask(server.target, grpc.ssl_channel_credentials(ca))
            client = grpc.ssl_channel_credentials(
                ca, tls_files["client.key"].read_bytes(), tls_files["client.crt"].read_bytes()
            )
            assert _ask(server.target, client).overall_code == rls_pb2.RateLimitResponse.OK
        finally:
            assert server.stop() == 0

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--tls-cert", "x.pem"], "--tls-cert and --tls-key: give both, or neither"),
            (["--tls-client-ca", "ca.pem"], "--tls-client-ca: mTLS needs --tls-cert and --tls-key"),
            (
                ["--tls-cert", "/nope.pem", "--tls-key", "/nope.key"],
                "--tls-cert: no such file: /nope.pem",
            ),
        ],
    )
    def test_incomplete_tls_settings_are_refused(self, args: list[str], message: str) -> None:
        """Half a TLS setup is an error at start, never a silent plaintext server."""
        out = run("serve", *args)
        assert out.returncode == 2 and message in out.stderr
