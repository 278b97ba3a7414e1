"""gRPC over TLS and mTLS, through real secure channels to a real server process."""

import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ServerProcess, run_cli

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
        out = run_cli("serve", *args)
        assert out.returncode == 2 and message in out.stderr


def _issue(tls_files: dict[str, Path], where: Path, name: str) -> tuple[Path, Path]:
    """A new certificate for 127.0.0.1 from the test CA, with its key: (cert, key)."""
    ca = tls_files["ca.crt"]
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=where, timeout=30)

    openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca), "-CAkey",
            str(ca.parent / "ca.key"), "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
            "-extfile", "san.ext")  # fmt: skip
    return where / f"{name}.crt", where / f"{name}.key"


def _served_name(target: str, ca: Path) -> str:
    """The common name of the certificate the server presents to a new connection."""
    host, port = target.rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        cert = tls.getpeercert()
    assert cert is not None
    subject = dict(pair[0] for pair in cert["subject"])
    return str(subject["commonName"])


class TestTlsFiles:
    def test_a_key_that_is_not_the_certificates_is_refused_clearly(
        self, tls_files: dict[str, Path]
    ) -> None:
        """A mismatched pair: exit 2 naming both files, not a traceback and a failed bind."""
        cert, key = tls_files["server.crt"], tls_files["client.key"]
        out = run_cli("serve", "--tls-cert", str(cert), "--tls-key", str(key),
                  "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0")  # fmt: skip
        assert out.returncode == 2
        assert f"--tls-key: {key} is not the private key of --tls-cert {cert}" in out.stderr
        assert "Traceback" not in out.stderr

    def test_rotated_files_are_served_to_new_connections(
        self, tls_files: dict[str, Path], tmp_path: Path
    ) -> None:
        """The files replaced (as a Secret mount swaps them): new handshakes get the new
        certificate without a restart; a mismatched replacement keeps the last good one."""
        first, second = tmp_path / "first", tmp_path / "second"
        first.mkdir()
        second.mkdir()
        cert, key = _issue(tls_files, first, "first")
        new_cert, new_key = _issue(tls_files, second, "second")
        live_cert, live_key = tmp_path / "tls.crt", tmp_path / "tls.key"
        shutil.copy(cert, live_cert)
        shutil.copy(key, live_key)
        server = ServerProcess(["--tls-cert", str(live_cert), "--tls-key", str(live_key)])
        try:
            before = _served_name(server.target, tls_files["ca.crt"])
            shutil.copy(new_key, live_key.with_suffix(".tmp"))
            live_key.with_suffix(".tmp").replace(live_key)  # a key without its certificate
            half = _served_name(server.target, tls_files["ca.crt"])
            server.wait_for(r"TLS files changed but cannot be used")
            shutil.copy(new_cert, live_cert.with_suffix(".tmp"))
            live_cert.with_suffix(".tmp").replace(live_cert)
            after = _served_name(server.target, tls_files["ca.crt"])
            trust = grpc.ssl_channel_credentials(tls_files["ca.crt"].read_bytes())
            answer = _ask(server.target, trust).overall_code
        finally:
            assert server.stop() == 0
        assert (before, half, after) == ("first", "first", "second")
        assert answer == rls_pb2.RateLimitResponse.OK
        assert any("TLS certificate reloaded" in line for line in server.lines)
