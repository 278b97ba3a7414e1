"""Real fairlimit server processes for tests: 127.0.0.1, port 0, stopped by SIGTERM."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from helpers import STARTUP_SECONDS

ROOT = Path(__file__).resolve().parents[2]
_PORT = re.compile(r"serving gRPC on \S+ \(port (\d+)\)")


def free_port() -> int:
    """A loopback port free at the moment of asking."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """``python -m fairlimit serve ...`` with its log captured."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        loopback_ports: bool = True,
        serve: list[str] | None = None,
    ) -> None:
        """``loopback_ports``: ask for free ports on 127.0.0.1 by flag; False leaves the
        addresses to ``env`` (the environment-only deployments). ``serve``: the command
        instead of ``python -m fairlimit serve`` (the image's /bin/ratelimit)."""
        self._terminated = False
        full_env = {**os.environ, "PYTHONPATH": str(ROOT / "server"), **(env or {})}
        ports = ["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"]
        start = serve or [sys.executable, "-m", "fairlimit", "serve"]
        command = [*start, *(ports if loopback_ports else []), *args]
        self.process = subprocess.Popen(
            command, env=full_env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self.lines: list[str] = []
        self.grpc_port = self._wait_for_port(timeout=STARTUP_SECONDS)
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _wait_for_port(self, timeout: float) -> int:
        assert self.process.stderr is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            found = _PORT.search(line)
            if found:
                return int(found.group(1))
        self.process.kill()
        self.process.wait()
        self.process.stderr.close()
        raise RuntimeError("fairlimit did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = STARTUP_SECONDS) -> str:
        """The first group (or the whole match) of the first log line matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found.group(found.lastindex or 0)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.02)  # polls the log the drainer thread fills; asserts no duration

    @property
    def admin_port(self) -> int:
        return int(self.wait_for(r"serving admin HTTP on \S+ \(port (\d+)\)"))

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """The samples named ``name`` on the server's /metrics: their labels and values."""
        url = f"http://127.0.0.1:{self.admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]

    def terminate(self) -> None:
        """SIGTERM once: a second one may land after the server's handlers are gone (its
        loop closing at the end of the drain) and kill it with -15 instead of exit 0."""
        if not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (unless sent already), then wait; returns the exit code."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # The drainer ends at the pipe's EOF; closing the pipe after it keeps no file open.
        self._drainer.join(timeout=5.0)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return self.process.returncode


@contextmanager
def fairlimit_server(
    *args: str,
    env: dict[str, str] | None = None,
    loopback_ports: bool = True,
    serve: list[str] | None = None,
) -> Iterator[ServerProcess]:
    server = ServerProcess(list(args), env, loopback_ports=loopback_ports, serve=serve)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def replicas_of(config: Path, backend: str, count: int = 2) -> Iterator[list[ServerProcess]]:
    """``count`` fairlimit processes serving ``config`` on one ``backend``, stopped after."""
    servers = [ServerProcess(["--config", str(config), "--backend", backend]) for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "server"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "fairlimit", *args], env=full_env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
