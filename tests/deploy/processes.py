"""What the chart and the image would run, run here: this checkout's fairlimit as a process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from helpers import STARTUP_SECONDS

from .helpers import ROOT


def grpc_health(port: int, timeout: float) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="")
        response = health_pb2_grpc.HealthStub(channel).Check(
            request, timeout=timeout, wait_for_ready=True
        )
        status: int = response.status
        return status


def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, as Kubernetes sends it; the process's output (killed after 20 s)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[0] + "\n(no exit within 20 s of SIGTERM: killed)"


@contextlib.contextmanager
def running_fairlimit(args: list[str], env: dict[str, str], admin_port: int) -> Iterator[None]:
    """`python -m fairlimit ARGS` from this checkout, up (admin /readyz 200) until exit.

    Leaving the block sends SIGTERM and requires a clean exit, as Kubernetes would.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "fairlimit", *args],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT / "server")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        status = ready_status(
            f"http://127.0.0.1:{admin_port}/readyz", time.monotonic() + STARTUP_SECONDS
        )
    except BaseException:
        stop(process)
        raise
    if status != 200:
        raise AssertionError(f"fairlimit never got ready ({status}):\n{stop(process)}")
    try:
        yield
    finally:
        output = stop(process)
    assert process.returncode == 0, output


def kubelet_configmap_mount(target: Path, files: dict[str, str]) -> Path:
    """Lay files out as the kubelet mounts a ConfigMap: NAME -> ..data/NAME -> ..<ts>/NAME."""
    target.mkdir()
    for name in files:
        (target / name).symlink_to(Path("..data") / name)
    kubelet_configmap_update(target, files, "..2026_01_01_00_00_00.000000001")
    return target


def kubelet_configmap_update(target: Path, files: dict[str, str], stamp: str) -> None:
    """Publish new contents as the kubelet does: a new directory, then an atomic ..data swap."""
    (target / stamp).mkdir()
    for name, text in files.items():
        (target / stamp / name).write_text(text)
    (target / "..data_tmp").symlink_to(stamp)
    (target / "..data_tmp").rename(target / "..data")


def client_limit(port: int, client: str) -> int:
    """The current_limit fairlimit reports for (route=public),(client_id=client) in edge."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = rls_pb2.RateLimitRequest(domain="edge", hits_addend=0)
        descriptor = request.descriptors.add()
        descriptor.entries.add(key="route", value="public")
        descriptor.entries.add(key="client_id", value=client)
        response = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=5)
        limit: int = response.statuses[0].current_limit.requests_per_unit
        return limit


def ready_status(url: str, deadline: float) -> int | str:
    """GET url until it answers 200 or the deadline passes; the last answer."""
    while True:
        status = http_status(url, deadline)
        if status == 200 or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def http_status(url: str, deadline: float) -> int | str:
    """The status of GET url, retried while nothing listens yet; the last error at deadline."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                status: int = response.status
                return status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError as error:
            if time.monotonic() > deadline:
                return f"{error}"
            time.sleep(0.05)


class StubRateLimitService(rls_pb2_grpc.RateLimitServiceServicer):
    """Records each request's descriptors; client_id "over" is over its limit."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[list[tuple[str, str]]]]] = []

    def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: grpc.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        entries = [[(e.key, e.value) for e in d.entries] for d in request.descriptors]
        self.calls.append((request.domain, entries))
        over = any(value == "over" for descriptor in entries for _, value in descriptor)
        code = rls_pb2.RateLimitResponse.OVER_LIMIT if over else rls_pb2.RateLimitResponse.OK
        response = rls_pb2.RateLimitResponse(overall_code=code)
        status = response.statuses.add(code=code, limit_remaining=0 if over else 99)
        status.current_limit.requests_per_unit = 100
        status.current_limit.unit = rls_pb2.RateLimitResponse.RateLimit.SECOND
        status.duration_until_reset.seconds = 1
        return response
