"""The Deployment's container command, run against this checkout's fairlimit."""

import copy
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from grpc_health.v1 import health_pb2

from servers import free_port

from .helpers import CONFIG_DIR, Helm, Manifest, container, load_values, one
from .processes import (
    client_limit,
    grpc_health,
    http_status,
    kubelet_configmap_mount,
    kubelet_configmap_update,
    running_fairlimit,
)


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
