"""A config that limits nothing is refused, at start, on reload and by ``check``.

An emptied ConfigMap (its key removed, its ``..data`` link gone) used to load as "0 domains":
every request OK, /readyz 200, the load counted a success. Through real server processes.
"""

import re
import signal
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ServerProcess, run_cli

pytestmark = pytest.mark.process

EDGE = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 2}
"""
NO_LIMITS = "domain: edge\ndescriptors: []\n"
WAIT = 20.0


def _ask(target: str, client: str = "a") -> str:
    entries = [ratelimit_pb2.RateLimitDescriptor.Entry(key="client_id", value=client)]
    message = rls_pb2.RateLimitRequest(
        domain="edge", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=entries)]
    )
    with grpc.insecure_channel(target) as channel:
        reply = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(message, timeout=5)
    return rls_pb2.RateLimitResponse.Code.Name(reply.overall_code)


def _health(target: str) -> str:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _reload(server: ServerProcess) -> None:
    server.process.send_signal(signal.SIGHUP)


class TestStart:
    def test_serve_refuses_an_empty_directory(self, tmp_path: Path) -> None:
        """No descriptor file in a --config directory: exit 2, naming the directory."""
        out = run_cli("serve", "--config", str(tmp_path), "--grpc-addr", "127.0.0.1:0",
                  "--admin-addr", "127.0.0.1:0")  # fmt: skip
        assert out.returncode == 2
        assert f"{tmp_path}: (directory): no descriptor files (*.yaml, *.yml)" in out.stderr
        assert "--allow-empty-config accepts it" in out.stderr

    def test_serve_refuses_a_config_without_any_limit(self, tmp_path: Path) -> None:
        """Domains whose rules limit nothing switch limiting off just the same: exit 2."""
        (tmp_path / "edge.yaml").write_text(NO_LIMITS)
        out = run_cli("serve", "--config", str(tmp_path), "--grpc-addr", "127.0.0.1:0",
                  "--admin-addr", "127.0.0.1:0")  # fmt: skip
        assert out.returncode == 2
        assert "(config): no rate limit in any domain" in out.stderr

    @pytest.mark.parametrize("strict", [[], ["--strict"]])
    def test_check_fails_on_empty_input(self, tmp_path: Path, strict: list[str]) -> None:
        """``check`` on an empty directory fails, with --strict or without."""
        out = run_cli("check", *strict, str(tmp_path))
        assert out.returncode == 1
        assert "no descriptor files" in out.stderr


class TestReload:
    def test_emptying_the_directory_keeps_the_running_config(self, tmp_path: Path) -> None:
        """The file removed: the reload is rejected, limits hold, /readyz and a metric say so."""
        (tmp_path / "edge.yaml").write_text(EDGE)
        server = ServerProcess(["--config", str(tmp_path)])
        try:
            admin = server.admin_port
            (tmp_path / "edge.yaml").unlink()
            _reload(server)  # the watcher may not be watching yet: a reload, for certain
            server.wait_for(r"config rejected: keeping the running config", WAIT)
            answers = [_ask(server.target) for _ in range(3)]
            ready = _get(admin, "/readyz")
            metrics = _get(admin, "/metrics")[1]
        finally:
            assert server.stop() == 0
        assert answers == ["OK", "OK", "OVER_LIMIT"]
        assert ready[0] == 200
        assert ready[1].startswith("ready; last reload rejected, previous config kept: 1 problems")
        # one failed load, or two when the file watch saw the change before the SIGHUP
        failures = r'fairlimit_config_loads_total\{[^}]*result="failure"[^}]*\} [12]\.0'
        assert re.search(failures, metrics)

    def test_a_good_reload_clears_the_report(self, tmp_path: Path) -> None:
        """After a rejected reload, an accepted one makes /readyz plain "ready" again."""
        (tmp_path / "edge.yaml").write_text(EDGE)
        server = ServerProcess(["--config", str(tmp_path)])
        try:
            admin = server.admin_port
            (tmp_path / "edge.yaml").write_text(NO_LIMITS)
            _reload(server)
            server.wait_for(r"config rejected", WAIT)
            rejected = _get(admin, "/readyz")[1]
            (tmp_path / "edge.yaml").write_text(EDGE)
            _reload(server)
            server.wait_for(r"config reloaded", WAIT)
            accepted = _get(admin, "/readyz")[1]
        finally:
            assert server.stop() == 0
        assert rejected.startswith("ready; last reload rejected") and accepted == "ready\n"


class TestAllowed:
    def test_an_allowed_empty_start_is_not_ready_until_a_domain_loads(self, tmp_path: Path) -> None:
        """--allow-empty-config --healthy-with-config: serves, but /readyz 503 and health
        NOT_SERVING until a descriptor file appears; then ready and limiting."""
        server = ServerProcess(
            ["--config", str(tmp_path), "--allow-empty-config", "--healthy-with-config"]
        )
        try:
            admin = server.admin_port
            before = (_get(admin, "/readyz"), _health(server.target), _ask(server.target))
            (tmp_path / "edge.yaml").write_text(EDGE)
            _reload(server)
            server.wait_for(r"config reloaded", WAIT)
            after = (_get(admin, "/readyz"), _health(server.target))
            answers = [_ask(server.target, "b") for _ in range(3)]
        finally:
            assert server.stop() == 0
        assert before == ((503, "no config with a domain loaded yet\n"), "NOT_SERVING", "OK")
        assert after == ((200, "ready\n"), "SERVING")
        assert answers == ["OK", "OK", "OVER_LIMIT"]

    def test_an_allowed_empty_start_is_ready_by_default(self, tmp_path: Path) -> None:
        """--allow-empty-config alone: an empty config is served and counts as ready."""
        server = ServerProcess(["--config", str(tmp_path), "--allow-empty-config"])
        try:
            ready = _get(server.admin_port, "/readyz")
            server.process.send_signal(signal.SIGHUP)
            server.wait_for(r"config reloaded", WAIT)
        finally:
            assert server.stop() == 0
        assert ready == (200, "ready\n")


UPSTREAM_EMPTY = Path(__file__).parents[1] / "fixtures" / "upstream" / "empty"


class TestUpstreamLayout:
    """Under upstream's RUNTIME_* layout a config without limits is served, as upstream
    serves it; fairlimit's own --config refuses the same files (TestStart)."""

    def test_a_domain_without_limits_is_served_and_counted(self, tmp_path: Path) -> None:
        """A domain with no descriptor (upstream's duplicate_domain.yaml alone): it starts,
        logs that nothing is limited, counts the load as a success, answers OK."""
        config = tmp_path / "ratelimit" / "config"
        config.mkdir(parents=True)
        fixture = UPSTREAM_EMPTY / "domain-without-limits.yaml"
        (config / fixture.name).write_text(fixture.read_text())
        env = {"RUNTIME_ROOT": str(tmp_path), "RUNTIME_SUBDIRECTORY": "ratelimit",
               "FAIRLIMIT_METRICS_COMPAT": "true"}  # fmt: skip
        server = ServerProcess([], env)
        try:
            admin = server.admin_port
            server.wait_for(r"config loaded: no rate limit in any domain")
            ready = _get(admin, "/readyz")
            metrics = _get(admin, "/metrics")[1]
            answer = _ask(server.target)
        finally:
            assert server.stop() == 0
        assert ready == (200, "ready\n") and answer == "OK"
        assert "ratelimit_service_config_load_success 1\n" in metrics

    def test_fairlimits_own_flag_refuses_the_same_file(self) -> None:
        """The same file through --config: exit 2, the guard kept."""
        out = run_cli("serve", "--config", str(UPSTREAM_EMPTY), "--grpc-addr", "127.0.0.1:0",
                      "--admin-addr", "127.0.0.1:0")  # fmt: skip
        assert out.returncode == 2 and "(config): no rate limit in any domain" in out.stderr
