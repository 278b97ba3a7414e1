"""The container recipe, read as Docker reads it (test_image.py builds it with podman)."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from servers import free_port

from .helpers import (
    CONFIG_DIR,
    ROOT,
    dockerfile_instructions,
    excluded_from_context,
    runtime_stage,
)
from .processes import running_fairlimit

pytestmark = pytest.mark.unit

INSTALL = ("RUN", "/opt/fairlimit/bin/pip install --no-deps .")


def healthcheck_command(admin_port: int) -> list[str]:
    """The image's HEALTHCHECK, run by this interpreter against admin_port instead of 8080."""
    (args,) = [a for op, a in runtime_stage() if op == "HEALTHCHECK"]
    command: list[str] = json.loads(args.split(" CMD ", 1)[1])
    assert command[0] == "python"
    return [
        sys.executable,
        *(part.replace("127.0.0.1:8080", f"127.0.0.1:{admin_port}") for part in command[1:]),
    ]


class TestDockerfile:
    """The container recipe as written (test_image.py builds and runs it)."""

    def test_multi_stage_on_python_3_11_slim_pinned_by_digest(self) -> None:
        """A builder and a runtime stage, both from python:3.11-slim pinned by its digest."""
        instructions = dockerfile_instructions()
        froms = [args for op, args in instructions if op == "FROM"]
        assert froms == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]
        (base,) = [args for op, args in instructions if op == "ARG"]
        assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11-slim@sha256:[0-9a-f]{64}", base)
        assert any(
            op == "COPY" and args.startswith("--from=builder") for op, args in runtime_stage()
        )

    def test_builder_installs_the_repository(self) -> None:
        """The builder runs `pip install --no-deps .` into the venv the runtime copies."""
        assert INSTALL in dockerfile_instructions()

    def test_dependency_layer_comes_before_the_source(self) -> None:
        """Only pyproject.toml is copied before the dependencies install; the source after."""
        instructions = dockerfile_instructions()
        deps = next(
            i
            for i, (op, args) in enumerate(instructions)
            if op == "RUN" and "-r requirements" in args
        )
        copies = [
            (i, args.split()[:-1])
            for i, (op, args) in enumerate(instructions)
            if op == "COPY" and not args.startswith("--from")
        ]
        assert [sources for i, sources in copies if i < deps] == [["pyproject.toml"]]
        assert deps < next(i for i, sources in copies if "server" in sources)

    def test_builder_copies_what_the_package_build_reads(self) -> None:
        """pyproject's data-files sources are copied before `pip install .` runs."""
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())
        data_files = project.get("tool", {}).get("setuptools", {}).get("data-files", {})
        needed = {Path(g).parts[0] for globs in data_files.values() for g in globs}
        instructions = dockerfile_instructions()
        install = instructions.index(INSTALL)
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
            "docker/ratelimit",
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


def healthcheck(admin_port: int) -> int:
    command = healthcheck_command(admin_port)
    return subprocess.run(command, capture_output=True, timeout=30, check=False).returncode


class TestImageCommandRunsHere:
    """The image's ENTRYPOINT, CMD, ENV and HEALTHCHECK, run against this checkout's fairlimit."""

    def serve(self, extra_env: dict[str, str]) -> tuple[list[str], dict[str, str], int]:
        stage = dict(runtime_stage())
        assert json.loads(stage["ENTRYPOINT"]) == ["fairlimit"]
        admin_port = free_port()
        args = [
            a.replace("0.0.0.0:8080", f"127.0.0.1:{admin_port}") for a in json.loads(stage["CMD"])
        ]
        env = {
            # The image copies descriptors/ to FAIRLIMIT_CONFIG; here the checkout's copy.
            "FAIRLIMIT_CONFIG": str(ROOT / "descriptors"),
            "FAIRLIMIT_GRPC_ADDR": f"127.0.0.1:{free_port()}",
            **extra_env,
        }
        return args, env, admin_port

    def test_image_command_passes_its_healthcheck(self) -> None:
        """`fairlimit serve --admin-addr ...` with the image's FAIRLIMIT_CONFIG is healthy."""
        args, env, admin_port = self.serve({})
        with running_fairlimit(args, env, admin_port):
            assert healthcheck(admin_port) == 0

    def test_healthcheck_passes_with_grpc_over_mtls(self, tls_files: dict[str, Path]) -> None:
        """With gRPC on mTLS the HEALTHCHECK (admin /healthz, plain HTTP) still passes."""
        tls = {
            "FAIRLIMIT_TLS_CERT": str(tls_files["server.crt"]),
            "FAIRLIMIT_TLS_KEY": str(tls_files["server.key"]),
            "FAIRLIMIT_TLS_CLIENT_CA": str(tls_files["ca.crt"]),
        }
        args, env, admin_port = self.serve(tls)
        with running_fairlimit(args, env, admin_port):
            assert healthcheck(admin_port) == 0

    def test_healthcheck_fails_when_nothing_answers(self) -> None:
        """Control: with no server on the admin port the HEALTHCHECK fails."""
        assert healthcheck(free_port()) != 0
