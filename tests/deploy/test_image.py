"""The image, built from the Dockerfile and run as Envoy Gateway runs it (see image.py).

Envoy Gateway runs the rate-limit image with `command: /bin/ratelimit`, as uid 65534 with
readOnlyRootFilesystem, from upstream's environment variables, and probes GET /healthcheck
on 8080. Here: the image's root mounted read-only with a tmpfs at /tmp and the config
bind-mounted read-only, `chroot --userspec=65534:65534 ROOT /bin/ratelimit` with the
image's ENV and upstream's variables, on loopback ports.
"""

import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from helpers import STARTUP_SECONDS, require, skip_or_fail
from redis_servers import RedisProcess
from servers import free_port

from .helpers import CONFIG_DIR, ROOT, runtime_stage
from .image import (
    EG_UID,
    IMAGE,
    Podman,
    base_tarball,
    image_root,
    mounts_seen_by,
    read_only_tree,
    scratch_tmpfs,
    status_fields,
    traced_chroot,
)
from .processes import ready_status

pytestmark = pytest.mark.process

HINT = "bash tests/run.sh installs Debian's podman, mmdebstrap and strace"
EDGE = ROOT / "tests" / "fixtures" / "upstream" / "runtime" / "edge.yaml"  # 3 a day a client
OK, OVER_LIMIT = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
# /bin/ratelimit's `exec fairlimit serve`, from the venv the image's PATH names first.
SERVER = r"^/opt/fairlimit/bin/python /opt/fairlimit/bin/fairlimit serve $"
# What a failed write says in Python's and the shell's error messages.
WRITE_ERRORS = ("Read-only file system", "Permission denied", "Errno 30", "Errno 13")


def tools(*names: str) -> dict[str, str]:
    """The tools' paths; the test mounts and chroots, so it also needs root (CI is root)."""
    if os.geteuid() != 0:
        skip_or_fail("mount and chroot need root (CI runs as root)")
    return {name: require(name, HINT) for name in names}


@pytest.fixture
def built() -> Iterator[tuple[Podman, dict[str, Any]]]:
    """The image built from the Dockerfile on the Debian base; its storage removed after."""
    found = tools("podman", "mmdebstrap", "strace")
    # In /tmp, not tmp_path: podman refuses a --runroot over 50 characters (pytest's paths
    # under xdist are). The build peaks at about 1 GB.
    with scratch_tmpfs("fairlimit-podman-", "3g") as workdir:
        podman = Podman(found["podman"], workdir)
        podman.load_base(base_tarball(found["mmdebstrap"], workdir / "mmdebstrap"))
        podman.build()
        yield podman, podman.inspect(IMAGE)


def runtime_layout(srv: Path) -> Path:
    """Upstream's RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config/*.yaml under ``srv``."""
    config = srv / "ratelimit" / "config"
    config.mkdir(parents=True)
    shutil.copy(EDGE, config / "edge.yaml")
    return srv


def upstream_env(ports: dict[str, int], redis_port: int) -> dict[str, str]:
    """Envoy Gateway's variables for its rate-limit container (file config instead of xDS:
    its RUNTIME_ROOT is /data, which the image has no directory for; /srv it has), and the
    listeners on loopback ports instead of every interface."""
    return {
        "RUNTIME_ROOT": "/srv",
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_IGNOREDOTFILES": "true",
        "RUNTIME_WATCH_ROOT": "false",
        "LOG_LEVEL": "info",
        "USE_STATSD": "false",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": f"127.0.0.1:{redis_port}",
        "HOST": "127.0.0.1",
        "PORT": str(ports["http"]),
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": str(ports["grpc"]),
        "DEBUG_HOST": "127.0.0.1",
        "DEBUG_PORT": str(ports["debug"]),
        "USE_PROMETHEUS": "true",
        "PROMETHEUS_ADDR": f"127.0.0.1:{ports['prometheus']}",
    }


def should_rate_limit(port: int, client: str) -> int:
    """The overall code of one ShouldRateLimit for (route=public),(client_id=client)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = rls_pb2.RateLimitRequest(domain="edge")
        descriptor = request.descriptors.add()
        descriptor.entries.add(key="route", value="public")
        descriptor.entries.add(key="client_id", value=client)
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        code: int = stub.ShouldRateLimit(request, timeout=10).overall_code
        return code


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


class TestImage:
    def test_builds_and_serves_read_only_as_65534_through_bin_ratelimit(
        self,
        built: tuple[Podman, dict[str, Any]],
        redis_process: RedisProcess,
        tmp_path: Path,
    ) -> None:
        """The Dockerfile builds on a Debian base; its root, read-only, runs /bin/ratelimit
        as uid 65534 from the image's ENV and upstream's variables: /healthcheck 200, real
        ShouldRateLimit calls counted in Redis to OVER_LIMIT, and no write tried outside
        the tmpfs at /tmp (strace saw no EROFS); SIGTERM stops it cleanly."""
        podman, inspected = built
        config = inspected["Config"]
        assert config["User"] == "10001:10001"
        assert config["Entrypoint"] == ["fairlimit"]
        (healthcheck,) = [args for op, args in runtime_stage() if op == "HEALTHCHECK"]
        assert ["CMD", *json.loads(healthcheck.split(" CMD ", 1)[1])] == (
            inspected["Healthcheck"]["Test"]  # kept: built with --format docker
        )
        env = dict(item.split("=", 1) for item in config["Env"])
        assert env["FAIRLIMIT_CONFIG"] == CONFIG_DIR
        assert env["PATH"].startswith("/opt/fairlimit/bin:")

        ports = {name: free_port() for name in ("http", "grpc", "debug", "prometheus")}
        srv = runtime_layout(tmp_path / "srv")
        deadline = time.monotonic() + STARTUP_SECONDS
        # chroot starts it in /, not the image's WORKDIR /tmp: stricter, since a write
        # relative to the working directory would then hit the read-only root.
        with (
            image_root(podman, IMAGE, tmp_path / "root", {"/srv": srv}) as root,
            traced_chroot(
                tools("strace")["strace"],
                root,
                EG_UID,
                ["/bin/ratelimit"],
                {**env, **upstream_env(ports, redis_process.port)},
                tmp_path / "run",
            ) as traced,
        ):
            pid, _ = traced.child(SERVER, deadline)
            health = ready_status(f"http://127.0.0.1:{ports['http']}/healthcheck", deadline)
            assert health == 200, traced.output()
            assert get(f"http://127.0.0.1:{ports['http']}/healthcheck") == (200, "OK")

            codes = [should_rate_limit(ports["grpc"], "image-ci") for _ in range(4)]
            assert codes == [OK, OK, OK, OVER_LIMIT], traced.output()
            assert redis_process.client().dbsize() > 0  # counted in Redis, not in memory
            status, metrics = get(f"http://127.0.0.1:{ports['prometheus']}/metrics")
            assert status == 200
            assert "ratelimit_service_rate_limit_over_limit" in metrics

            fields = status_fields(pid)
            assert fields["Uid"].split() == [str(EG_UID)] * 4, fields["Uid"]
            assert fields["Gid"].split() == [str(EG_UID)] * 4, fields["Gid"]
            assert set(fields["Groups"].split()) <= {str(EG_UID)}, fields["Groups"]
            assert int(fields["CapEff"], 16) == 0  # no capabilities left, as with drop: ALL
            seen = mounts_seen_by(pid)
            assert "ro" in seen["/"][1], seen["/"]
            assert seen["/tmp"][0] == "tmpfs" and "rw" in seen["/tmp"][1], seen["/tmp"]
            assert "ro" in seen["/srv"][1], seen["/srv"]
            written = sorted(str(p.relative_to(root)) for p in (root / "tmp").rglob("*"))
            exit_status = traced.stop(pid)

        output = traced.output()
        assert exit_status == 0, output
        assert traced.write_attempts() == [], f"writes outside /tmp ({written} in /tmp)"
        assert [e for e in WRITE_ERRORS if e in output] == [], output
        assert "Traceback" not in output, output

    def test_a_swallowed_write_outside_the_tmpfs_is_seen(self, tmp_path: Path) -> None:
        """Control: on this machine's root, read-only, a write that the command ignores
        fails is still in the trace; one into the tmpfs at /tmp is not."""
        found = tools("strace")
        shell = "echo x > /tmp/allowed; echo x > /etc/fairlimit-probe 2>/dev/null; true"
        with (
            read_only_tree(Path("/"), tmp_path / "root", {}) as root,
            traced_chroot(
                found["strace"], root, EG_UID, ["/bin/sh", "-c", shell], {}, tmp_path / "run"
            ) as traced,
        ):
            assert traced.strace.wait(timeout=60) == 0, traced.output()
            assert (root / "tmp" / "allowed").read_text() == "x\n"
        (attempt,) = traced.write_attempts()
        assert '"/etc/fairlimit-probe"' in attempt
