"""The container recipe, read as Docker reads it (no Docker engine on this machine)."""

import json
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from servers import free_port

from .helpers import (
    CONFIG_DIR,
    ROOT,
    dockerfile_instructions,
    excluded_from_context,
    runtime_stage,
)
from .processes import running_fairlimit


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, int]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def healthcheck_command(port: int) -> list[str]:
    """The image's HEALTHCHECK, run by this interpreter against port instead of 8081."""
    (args,) = [a for op, a in runtime_stage() if op == "HEALTHCHECK"]
    command: list[str] = json.loads(args.split(" CMD ", 1)[1])
    assert command[0] == "python"
    return [
        sys.executable,
        *(part.replace("127.0.0.1:8081", f"127.0.0.1:{port}") for part in command[1:]),
    ]


class TestDockerfile:
    """The container recipe (not built here: no Docker engine on this machine)."""

    def test_multi_stage_on_python_3_11_slim(self) -> None:
        """A builder and a runtime stage, both from python:3.11-slim by default."""
        instructions = dockerfile_instructions()
        froms = [args for op, args in instructions if op == "FROM"]
        assert froms == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]
        assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in instructions
        assert any(
            op == "COPY" and args.startswith("--from=builder") for op, args in runtime_stage()
        )

    def test_builder_installs_the_repository(self) -> None:
        """The builder runs `pip install .` into the venv the runtime copies."""
        runs = [args for op, args in dockerfile_instructions() if op == "RUN"]
        assert "/opt/fairlimit/bin/pip install ." in runs

    def test_builder_copies_what_the_package_build_reads(self) -> None:
        """pyproject's data-files sources are copied before `pip install .` runs."""
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())
        data_files = project.get("tool", {}).get("setuptools", {}).get("data-files", {})
        needed = {Path(g).parts[0] for globs in data_files.values() for g in globs}
        instructions = dockerfile_instructions()
        install = instructions.index(("RUN", "/opt/fairlimit/bin/pip install ."))
        copied = {
            Path(source).parts[0]
            for op, args in instructions[:install]
            if op == "COPY" and not args.startswith("--from")
            for source in args.split()[:-1]
        }
        assert needed <= copied
        assert {"pyproject.toml", "README.md", "server"} <= copied

    def test_runs_as_a_numeric_non_root_user(self) -> None:
        """The runtime's USER is uid 10001, numeric so that runAsNonRoot can verify it."""
        users = [args for op, args in runtime_stage() if op == "USER"]
        assert users[-1].split(":")[0] == "10001"

    def test_exposes_grpc_and_admin(self) -> None:
        """EXPOSE 8081 (gRPC) and 8080 (admin)."""
        exposed = {p for op, args in runtime_stage() if op == "EXPOSE" for p in args.split()}
        assert {"8081", "8080"} <= exposed

    def test_entrypoint_serves_with_admin_reachable(self) -> None:
        """ENTRYPOINT fairlimit, CMD serve with the admin port on all interfaces."""
        stage = dict(runtime_stage())
        assert json.loads(stage["ENTRYPOINT"]) == ["fairlimit"]
        assert json.loads(stage["CMD"]) == ["serve", "--admin-addr", "0.0.0.0:8080"]

    def test_writes_no_bytecode_and_finds_its_descriptors(self) -> None:
        """PYTHONDONTWRITEBYTECODE=1, and FAIRLIMIT_CONFIG names the baked-in descriptors."""
        env = " ".join(args for op, args in runtime_stage() if op == "ENV")
        assert "PYTHONDONTWRITEBYTECODE=1" in env
        assert f"FAIRLIMIT_CONFIG={CONFIG_DIR}" in env
        assert ("COPY", f"descriptors {CONFIG_DIR}") in runtime_stage()

    def test_build_context_keeps_what_the_build_copies(self) -> None:
        """.dockerignore keeps the copied sources and drops tests, charts and caches."""
        copied = [
            "pyproject.toml",
            "README.md",
            "server/fairlimit/__init__.py",
            "descriptors/edge.yaml",
        ]
        dropped = [
            ".git/HEAD",
            "tests/deploy/helpers.py",
            "helm/fairlimit/values.yaml",
            "server/fairlimit/__pycache__/cli.cpython-311.pyc",
            ".venv/bin/python",
        ]
        assert [p for p in copied if excluded_from_context(p)] == []
        assert [p for p in dropped if not excluded_from_context(p)] == []

    def test_copied_sources_exist(self) -> None:
        """Every COPY source outside --from exists in the repository."""
        for op, args in dockerfile_instructions():
            if op == "COPY" and not args.startswith("--from"):
                for source in args.split()[:-1]:
                    assert (ROOT / source).exists(), f"COPY {source}: missing"

    def test_healthcheck_follows_grpc_health(
        self, health_server: tuple[health.HealthServicer, int]
    ) -> None:
        """The HEALTHCHECK passes while health "" is SERVING and fails once it is not."""
        servicer, port = health_server
        command = healthcheck_command(port)

        def run() -> int:
            return subprocess.run(command, capture_output=True, timeout=30, check=False).returncode

        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run() == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run() == 1


class TestImageCommandRunsHere:
    """The image's ENTRYPOINT, CMD and ENV, run against this checkout's fairlimit."""

    def test_image_command_passes_its_healthcheck(self) -> None:
        """`fairlimit serve --admin-addr ...` with the image's FAIRLIMIT_CONFIG serves."""
        stage = dict(runtime_stage())
        assert json.loads(stage["ENTRYPOINT"]) == ["fairlimit"]
        grpc_port, admin_port = free_port(), free_port()
        args = [
            a.replace("0.0.0.0:8080", f"127.0.0.1:{admin_port}") for a in json.loads(stage["CMD"])
        ]
        env = {
            # The image copies descriptors/ to FAIRLIMIT_CONFIG; here the checkout's copy.
            "FAIRLIMIT_CONFIG": str(ROOT / "descriptors"),
            "FAIRLIMIT_GRPC_ADDR": f"127.0.0.1:{grpc_port}",
        }
        with running_fairlimit(args, env, admin_port):
            result = subprocess.run(
                healthcheck_command(grpc_port), capture_output=True, timeout=30, check=False
            )
            assert result.returncode == 0, result.stderr
