"""An envoyproxy/ratelimit deployment with only the image swapped: its environment, its
RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY layout, a real Envoy in front."""

import json
import os
import shutil
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from envoy_proxy import envoy_in_front, http_get
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from redis_servers import RedisProcess
from servers import fairlimit_server, free_port

pytestmark = pytest.mark.process

RUNTIME = Path(__file__).parents[1] / "fixtures" / "upstream" / "runtime"
COMMAND = Path(__file__).resolve().parents[2] / "docker" / "ratelimit"


def _layout(tmp_path: Path) -> Path:
    """RUNTIME_ROOT with ratelimit/config/edge.yaml under it, as the upstream chart mounts it."""
    root = tmp_path / "srv" / "runtime_data" / "current"
    config = root / "ratelimit" / "config"
    config.mkdir(parents=True)
    shutil.copy(RUNTIME / "edge.yaml", config / "edge.yaml")
    return root


def _upstream_env(root: Path, ports: dict[str, int]) -> dict[str, str]:
    return {
        "RUNTIME_ROOT": str(root),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_IGNOREDOTFILES": "true",
        "RUNTIME_WATCH_ROOT": "false",
        "USE_STATSD": "false",
        "STATSD_HOST": "statsd.local",  # not spoken here: named in the startup warning
        "LOG_LEVEL": "info",
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": str(ports["grpc"]),
        "HOST": "127.0.0.1",
        "PORT": str(ports["http"]),
        "DEBUG_HOST": "127.0.0.1",
        "DEBUG_PORT": str(ports["debug"]),
        "USE_PROMETHEUS": "true",
        "PROMETHEUS_ADDR": f"127.0.0.1:{ports['prometheus']}",
        "LIMIT_RESPONSE_HEADERS_ENABLED": "true",
    }


def _post_json(url: str, client: str) -> Any:
    """upstream's /json: a RateLimitRequest in proto3 JSON, the response likewise."""
    entries = [{"key": "route", "value": "public"}, {"key": "client_id", "value": client}]
    body = json.dumps({"domain": "edge", "descriptors": [{"entries": entries}]}).encode()
    request = urllib.request.Request(url, data=body, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


class TestUpstreamDeployment:
    def test_only_upstream_settings_through_envoy(
        self, tmp_path: Path, redis_process: RedisProcess
    ) -> None:
        """Counters in Redis (REDIS_URL), Envoy's answers, /healthcheck, the debug /rlconfig
        and upstream's metric names."""
        ports = {name: free_port() for name in ("grpc", "http", "debug", "prometheus")}
        env = _upstream_env(_layout(tmp_path), ports)
        redis_url = f"127.0.0.1:{redis_process.port}"
        env.update({"REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "SINGLE", "REDIS_URL": redis_url,
                    "REDIS_POOL_SIZE": "5"})  # fmt: skip
        with (
            fairlimit_server(env=env, loopback_ports=False) as server,
            envoy_in_front(server.grpc_port, tmp_path) as envoy,
        ):
            assert server.grpc_port == ports["grpc"]
            answers = [http_get(envoy.url, {"x-client-id": "alice"}) for _ in range(4)]
            assert [code for code, _, _ in answers] == [200, 200, 200, 429]
            first, last = answers[0][1], answers[-1][1]
            assert (first["ratelimit-limit"], first["ratelimit-remaining"]) == ("3", "2")
            assert (last["ratelimit-limit"], last["ratelimit-remaining"]) == ("3", "0")
            assert 0 < int(last["ratelimit-reset"]) <= 86400

            answer = _post_json(f"http://127.0.0.1:{ports['http']}/json", "bob")
            assert answer["overallCode"] == "OK"
            assert answer["responseHeadersToAdd"][0] == {"key": "RateLimit-Limit", "value": "3"}

            with redis_process.client() as client:
                assert list(client.scan_iter("fairlimit:*"))  # the counters are there

            health = http_get(f"http://127.0.0.1:{ports['http']}/healthcheck")
            assert (health[0], health[2]) == (200, b"OK")
            dump = http_get(f"http://127.0.0.1:{ports['debug']}/rlconfig")[2].decode()
            assert "edge/route=public/client_id: unit=DAY requests_per_unit=3" in dump

            metrics = http_get(f"http://127.0.0.1:{ports['prometheus']}/metrics")[2].decode()
            labels = '{domain="edge",key1="route_public",key2="client_id"}'
            assert f"ratelimit_service_rate_limit_total_hits{labels} 5" in metrics
            assert f"ratelimit_service_rate_limit_over_limit{labels} 1" in metrics
            assert f"ratelimit_service_rate_limit_within_limit{labels} 4" in metrics
            assert "ratelimit_service_config_load_success 1" in metrics
            assert 'ratelimit_service_total_requests{grpc_method="ShouldRateLimit"} 4' in metrics
        log = "".join(server.lines)
        assert (
            "envoyproxy/ratelimit settings not supported by fairlimit, ignored: STATSD_HOST" in log
        )


def _charge(stub: Any, client: str, hits: int) -> tuple[int, int]:
    entries = [{"key": "route", "value": "public"}, {"key": "client_id", "value": client}]
    descriptor = {"entries": entries, "hits_addend": {"value": hits}}
    answer = stub.ShouldRateLimit(
        rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor]), timeout=5
    )
    return answer.overall_code, answer.statuses[0].limit_remaining


class TestImageCommand:
    def test_bin_ratelimit_serves_upstreams_layout_over_the_images_config(
        self, tmp_path: Path
    ) -> None:
        """docker/ratelimit (the image's /bin/ratelimit) ignores the image's FAIRLIMIT_CONFIG."""
        ports = {name: free_port() for name in ("grpc", "http", "debug")}
        env = {
            "RUNTIME_ROOT": str(_layout(tmp_path)), "RUNTIME_SUBDIRECTORY": "ratelimit",
            "FAIRLIMIT_CONFIG": str(tmp_path / "baked-in"),  # the image's; absent here
            "GRPC_HOST": "127.0.0.1", "GRPC_PORT": str(ports["grpc"]), "HOST": "127.0.0.1",
            "PORT": str(ports["http"]), "DEBUG_HOST": "127.0.0.1",
            "DEBUG_PORT": str(ports["debug"]),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }  # fmt: skip
        with fairlimit_server(env=env, loopback_ports=False, serve=["sh", str(COMMAND)]):
            health = http_get(f"http://127.0.0.1:{ports['http']}/healthcheck")
            assert (health[0], health[2]) == (200, b"OK")
            dump = http_get(f"http://127.0.0.1:{ports['debug']}/rlconfig")[2].decode()
            assert "edge/route=public/client_id: unit=DAY" in dump

    def test_bin_ratelimit_ignores_its_arguments(self, tmp_path: Path) -> None:
        """Envoy AI Gateway's Deployment passes a flag of its own (upstream's binary reads no
        arguments): it serves, and says once that the arguments were ignored."""
        ports = {name: free_port() for name in ("grpc", "http", "debug")}
        env = {
            "RUNTIME_ROOT": str(_layout(tmp_path)), "RUNTIME_SUBDIRECTORY": "ratelimit",
            "GRPC_HOST": "127.0.0.1", "GRPC_PORT": str(ports["grpc"]), "HOST": "127.0.0.1",
            "PORT": str(ports["http"]), "DEBUG_HOST": "127.0.0.1",
            "DEBUG_PORT": str(ports["debug"]),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }  # fmt: skip
        flag = "--quotaRateLimitServiceHost=envoy-ai-gateway-ratelimit.envoy-gateway-system"
        command = ["sh", str(COMMAND), flag]
        with fairlimit_server(env=env, loopback_ports=False, serve=command) as server:
            health = http_get(f"http://127.0.0.1:{ports['http']}/healthcheck")
            assert (health[0], health[2]) == (200, b"OK")
        ignored = [line for line in server.lines if "ignores its arguments" in line]
        assert len(ignored) == 1 and flag in ignored[0]

    def test_bin_ratelimit_charges_as_upstream(self, tmp_path: Path) -> None:
        """Upstream's files cannot say charge_when_over_limit: under /bin/ratelimit a charge
        past the limit (3 a day, +5 after the response) is counted, so the next check is
        OVER_LIMIT, as upstream answers."""
        ports = {name: free_port() for name in ("grpc", "http")}
        env = {
            "RUNTIME_ROOT": str(_layout(tmp_path)), "RUNTIME_SUBDIRECTORY": "ratelimit",
            "GRPC_HOST": "127.0.0.1", "GRPC_PORT": str(ports["grpc"]), "HOST": "127.0.0.1",
            "PORT": str(ports["http"]), "DEBUG_HOST": "127.0.0.1", "DEBUG_PORT": "0",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }  # fmt: skip
        command = ["sh", str(COMMAND)]
        with (
            fairlimit_server(env=env, loopback_ports=False, serve=command) as server,
            grpc.insecure_channel(server.target) as channel,
        ):
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            answers = [_charge(stub, "alice", hits) for hits in (0, 5, 0)]
        ok, over = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
        assert answers == [(ok, 3), (over, 0), (over, 0)]

    def test_ignored_dotfiles_are_not_read(self, tmp_path: Path) -> None:
        """RUNTIME_IGNOREDOTFILES=true (Envoy Gateway sets it): a broken dotfile ending in
        .yaml next to the config neither stops startup nor loads."""
        root = _layout(tmp_path)
        (root / "ratelimit" / "config" / ".edge.yaml").write_text("domain: [broken\n")
        ports = {name: free_port() for name in ("grpc", "http")}
        env = {
            "RUNTIME_ROOT": str(root), "RUNTIME_SUBDIRECTORY": "ratelimit",
            "RUNTIME_IGNOREDOTFILES": "true", "GRPC_HOST": "127.0.0.1",
            "GRPC_PORT": str(ports["grpc"]), "HOST": "127.0.0.1", "PORT": str(ports["http"]),
            "DEBUG_PORT": "0",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }  # fmt: skip
        with fairlimit_server(env=env, loopback_ports=False, serve=["sh", str(COMMAND)]):
            health = http_get(f"http://127.0.0.1:{ports['http']}/healthcheck")
            assert (health[0], health[2]) == (200, b"OK")


def _versioned(tmp_path: Path) -> tuple[Path, Path]:
    """RUNTIME_ROOT ``current`` -> ``v1`` (3 a day), and a ``v2`` (1 a day) beside it, as a
    deployment that swaps the whole runtime tree at once lays them out."""
    for version, per_day in (("v1", 3), ("v2", 1)):
        config = tmp_path / version / "ratelimit" / "config"
        config.mkdir(parents=True)
        text = (RUNTIME / "edge.yaml").read_text()
        config.joinpath("edge.yaml").write_text(
            text.replace("requests_per_unit: 3", f"requests_per_unit: {per_day}")
        )
    root = tmp_path / "current"
    root.symlink_to(tmp_path / "v1")
    return root, tmp_path / "v2"


def _swap(root: Path, target: Path) -> None:
    """Point the ``root`` symlink at ``target`` atomically (a new link renamed over it)."""
    fresh = root.with_name(root.name + ".new")
    fresh.symlink_to(target)
    fresh.replace(root)


def _root_env(root: Path, ports: dict[str, int], **more: str) -> dict[str, str]:
    return {
        "RUNTIME_ROOT": str(root), "RUNTIME_SUBDIRECTORY": "ratelimit",
        "GRPC_HOST": "127.0.0.1", "GRPC_PORT": str(ports["grpc"]), "HOST": "127.0.0.1",
        "PORT": str(ports["http"]), "DEBUG_HOST": "127.0.0.1", "DEBUG_PORT": str(ports["debug"]),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **more,
    }  # fmt: skip


class TestRuntimeRoot:
    def test_a_swap_of_the_root_symlink_reloads(self, tmp_path: Path) -> None:
        """RUNTIME_WATCH_ROOT (upstream's default, true): pointing RUNTIME_ROOT at another
        tree loads that tree's config, with no SIGHUP."""
        root, v2 = _versioned(tmp_path)
        ports = {name: free_port() for name in ("grpc", "http", "debug")}
        rlconfig = f"http://127.0.0.1:{ports['debug']}/rlconfig"
        command = ["sh", str(COMMAND)]
        with fairlimit_server(env=_root_env(root, ports), loopback_ports=False,
                              serve=command) as server:  # fmt: skip
            assert "unit=DAY requests_per_unit=3" in http_get(rlconfig)[2].decode()
            _swap(root, v2)
            server.wait_for(r"config reloaded")
            assert "unit=DAY requests_per_unit=1" in http_get(rlconfig)[2].decode()

    def test_not_watched_when_told_and_said_so(self, tmp_path: Path) -> None:
        """RUNTIME_WATCH_ROOT=false (Envoy Gateway sets it), the root a symlink: one warning
        at start says that a swap of it reloads nothing until SIGHUP."""
        root, _ = _versioned(tmp_path)
        ports = {name: free_port() for name in ("grpc", "http", "debug")}
        env = _root_env(root, ports, RUNTIME_WATCH_ROOT="false")
        with fairlimit_server(env=env, loopback_ports=False, serve=["sh", str(COMMAND)]) as server:
            warned = server.wait_for(r"RUNTIME_WATCH_ROOT=false: (swapping it reloads nothing)")
        assert warned == "swapping it reloads nothing"
