"""The Deployment's container command, run against this checkout's fairlimit."""

import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from grpc_health.v1 import health_pb2

from servers import ServerProcess, free_port

from .helpers import CONFIG_DIR, ROOT, Helm, Manifest, container, load_values, one
from .processes import (
    client_limit,
    grpc_health,
    http_status,
    kubelet_configmap_mount,
    kubelet_configmap_update,
    running_fairlimit,
)

pytestmark = pytest.mark.process
ISTIO_VALUES = ROOT / "examples" / "kubernetes" / "values-istio-helm.yaml"


class TestRenderedCommandRunsHere:
    """The Deployment's container command, run against this checkout's fairlimit."""

    @pytest.fixture
    def pod(self, helm: Helm, tmp_path: Path) -> Iterator[tuple[Manifest, int, int]]:
        """Rendered args and env, with ports moved to free ones and the ConfigMap mounted."""
        docs = helm.template({})
        files = one(docs, "ConfigMap")["data"]
        mount = kubelet_configmap_mount(tmp_path / "descriptors", files)
        grpc_port, admin_port = free_port(), free_port()
        main = container(docs)
        replace = {
            CONFIG_DIR: str(mount),
            "0.0.0.0:8081": f"127.0.0.1:{grpc_port}",
            "0.0.0.0:8080": f"127.0.0.1:{admin_port}",
        }
        main["args"] = [replace.get(arg, arg) for arg in main["args"]]
        yield main, grpc_port, admin_port

    def test_container_serves_the_configmap(self, pod: tuple[Manifest, int, int]) -> None:
        """The args start fairlimit on the mounted ConfigMap; liveness passes; SIGTERM exits 0."""
        main, grpc_port, admin_port = pod
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        with running_fairlimit(main["args"], env, admin_port):
            assert grpc_health(grpc_port, timeout=5) == health_pb2.HealthCheckResponse.SERVING

    def test_configmap_update_is_hot_reloaded(
        self, pod: tuple[Manifest, int, int], tmp_path: Path
    ) -> None:
        """A kubelet-style ConfigMap update (..data swap) reaches the running server."""
        main, grpc_port, admin_port = pod
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        edge = copy.deepcopy(load_values()["config"]["descriptors"]["edge.yaml"])
        edge["descriptors"][0]["descriptors"][0]["rate_limit"]["requests_per_unit"] = 50
        with running_fairlimit(main["args"], env, admin_port):
            assert client_limit(grpc_port, "alice") == 100
            mount = tmp_path / "descriptors"
            kubelet_configmap_update(
                mount, {"edge.yaml": yaml.safe_dump(edge)}, "..2026_01_01_00_01_00.000000001"
            )
            deadline = time.monotonic() + 10
            while client_limit(grpc_port, "alice") != 50 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client_limit(grpc_port, "alice") == 50

    def test_http_probes_answer(self, pod: tuple[Manifest, int, int]) -> None:
        """The startup and readiness probe paths answer 200 on the admin port."""
        main, _, admin_port = pod
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        with running_fairlimit(main["args"], env, admin_port):
            for probe in ("startupProbe", "readinessProbe"):
                path = main[probe]["httpGet"]["path"]
                status = http_status(f"http://127.0.0.1:{admin_port}{path}", time.monotonic() + 5)
                assert status == 200, f"{probe} GET {path}: {status}"


class TestRenderedTlsCommandRunsHere:
    """tls.enabled: the rendered command serves mTLS from the mounted Secrets; probes pass."""

    def test_tls_pod_serves_and_its_probes_answer(
        self, helm: Helm, tmp_path: Path, tls_files: dict[str, Path]
    ) -> None:
        """The TLS flags point at the Secret mounts; every probe's GET answers 200."""
        tls = {"enabled": True, "secretName": "rl-tls", "clientCaSecretName": "mesh-ca"}
        docs = helm.template({"tls": tls})
        mount = kubelet_configmap_mount(tmp_path / "descriptors", one(docs, "ConfigMap")["data"])
        secret_dirs = {
            "/etc/fairlimit/tls": tmp_path / "tls",
            "/etc/fairlimit/client-ca": tmp_path / "ca",
        }
        for directory in secret_dirs.values():
            directory.mkdir()
        (secret_dirs["/etc/fairlimit/tls"] / "tls.crt").write_bytes(
            tls_files["server.crt"].read_bytes()
        )
        (secret_dirs["/etc/fairlimit/tls"] / "tls.key").write_bytes(
            tls_files["server.key"].read_bytes()
        )
        (secret_dirs["/etc/fairlimit/client-ca"] / "ca.crt").write_bytes(
            tls_files["ca.crt"].read_bytes()
        )
        grpc_port, admin_port = free_port(), free_port()
        main = container(docs)

        def local(arg: str) -> str:
            for mounted, directory in secret_dirs.items():
                arg = arg.replace(mounted, str(directory))
            replace = {
                CONFIG_DIR: str(mount),
                "0.0.0.0:8081": f"127.0.0.1:{grpc_port}",
                "0.0.0.0:8080": f"127.0.0.1:{admin_port}",
            }
            return replace.get(arg, arg)

        args = [local(arg) for arg in main["args"]]
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        with running_fairlimit(args, env, admin_port):
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                path = main[probe]["httpGet"]["path"]
                status = http_status(f"http://127.0.0.1:{admin_port}{path}", time.monotonic() + 5)
                assert status == 200, f"{probe} GET {path}: {status}"


def _post_json(port: int) -> tuple[int, str]:
    """POST /json to the admin port through 127.0.0.1: the status and the body."""
    body = json.dumps({"domain": "edge", "descriptors": [
        {"entries": [{"key": "route", "value": "public"}]}]}).encode()  # fmt: skip
    request = urllib.request.Request(f"http://127.0.0.1:{port}/json", body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


class TestJsonIsNotServedOnTheChartsAdminPort:
    """The chart binds the admin port to 0.0.0.0 (probes and scrapers reach it from outside
    the pod), and under Istio's sidecar every inbound peer is 127.0.0.6: a loopback peer
    was let POST /json and spend quota (issue 38). /json is served only on a listener bound
    to a loopback address, so it is off on the chart's. The admin port is bound to 0.0.0.0
    here as in the pod (briefly, on a free port), and asked through 127.0.0.1: a loopback
    peer, as a sidecar's is."""

    @pytest.mark.parametrize("style", ["plain", "istio"])
    def test_json_is_refused_with_and_without_istio(
        self, helm: Helm, tmp_path: Path, style: str
    ) -> None:
        values = {} if style == "plain" else yaml.safe_load(ISTIO_VALUES.read_text())
        docs = helm.template(values)
        mount = kubelet_configmap_mount(tmp_path / "descriptors", one(docs, "ConfigMap")["data"])
        main = container(docs)
        assert "0.0.0.0:8080" in main["args"]  # as rendered: reachable from outside the pod
        grpc_port, admin_port = free_port(), free_port()
        replace = {CONFIG_DIR: str(mount), "0.0.0.0:8081": f"127.0.0.1:{grpc_port}",
                   "0.0.0.0:8080": f"0.0.0.0:{admin_port}"}  # fmt: skip
        args = [replace.get(arg, arg) for arg in main["args"]]
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        with running_fairlimit(args, env, admin_port):
            status, body = _post_json(admin_port)
            health = http_status(f"http://127.0.0.1:{admin_port}/healthcheck", time.monotonic() + 5)
        assert status == 403 and "--admin-json" in body, (status, body)
        assert health == 200


class TestJsonOnALoopbackAdminPort:
    def test_default_config_serves_json_only_on_a_loopback_bound_admin_port(
        self, tmp_path: Path
    ) -> None:
        """`fairlimit serve` with the default --admin-json: POST /json through 127.0.0.1 is
        answered on an admin port bound to 127.0.0.1, and refused (403, naming the flag) on
        one bound to 0.0.0.0, whoever asks; --admin-json on serves it there."""
        answers = {}
        for name, flags in {"loopback": ["--admin-addr", "127.0.0.1:0"],
                            "any": ["--admin-addr", "0.0.0.0:0"],
                            "any, on": ["--admin-addr", "0.0.0.0:0", "--admin-json", "on"]
                            }.items():  # fmt: skip
            server = ServerProcess(flags)
            try:
                answers[name] = _post_json(server.admin_port)
            finally:
                server.stop()
        assert answers["loopback"][0] == 200
        assert answers["any"][0] == 403 and "--admin-json on" in answers["any"][1]
        assert answers["any, on"][0] == 200
