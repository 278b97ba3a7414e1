"""Processes the benchmark starts: on 127.0.0.1 only, each stopped explicitly."""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
_PORT = re.compile(r"serving gRPC on \S+ \(port (\d+)\)")
_ADMIN = re.compile(r"serving admin HTTP on \S+ \(port (\d+)\)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def servers(baseline: Path | None) -> list[tuple[str, Path]]:
    """The servers a bench runs in turns: another checkout's server/ first (``--baseline``),
    then this checkout's, each with its label."""
    this = [("this", ROOT / "server")]
    return this if baseline is None else [("baseline", baseline / "server"), *this]


def ensure_debian_package(command: str, package: str) -> str | None:
    """``command``'s path, installing ``package`` with apt-get (as root) where missing."""
    found = shutil.which(command)
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    print(f"== installing {package} (Debian package) for {command}", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=False, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", package], check=False, env=env,
                   capture_output=True)  # fmt: skip
    return shutil.which(command)


class Proc:
    """A child process with its output in a log file; stopped by SIGTERM, then SIGKILL."""

    def __init__(self, name: str, command: list[str], workdir: Path,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name = name
        self.log = workdir / f"{name}.log"
        full_env = {**os.environ, "PYTHONPATH": str(ROOT / "server"), **(env or {})}
        with self.log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env=full_env, cwd=ROOT)  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: re.Pattern[str], count: int = 1, timeout: float = 30.0
                 ) -> list[str]:  # fmt: skip
        """The first ``count`` matches of ``pattern`` in the log (group 1)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = pattern.findall(self.text())
            if len(found) >= count:
                return found[:count]
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not start:\n{self.text()[-3000:]}")

    def samples(self) -> list[Any]:
        """The samples on fairlimit's /metrics (every worker's); [] before it serves."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        found = _ADMIN.search(self.text())
        if not found:
            return []
        url = f"http://127.0.0.1:{found.group(1)}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return [sample for family in text_string_to_metric_families(text)
                for sample in family.samples]  # fmt: skip

    def metrics(self, samples: list[Any] | None = None) -> dict[str, float]:
        """fairlimit's /metrics (every worker's, summed): backend errors, shed calls, calls,
        and hits within/over the two-replica rule (route=shared); from ``samples`` when
        given (one reading of ``samples()`` serving other figures too)."""
        if samples is None:
            samples = self.samples()
        if not samples:
            return {}
        wanted = {"fairlimit_backend_errors_total": "backend_errors",
                  "fairlimit_rpc_shed_total": "shed",
                  "fairlimit_rpc_duration_seconds_count": "rpc_calls"}  # fmt: skip
        totals = dict.fromkeys([*wanted.values(), "shared_within", "shared_over"], 0.0)
        for sample in samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
            elif "shared" in sample.labels.get("rule", "") and sample.name in (
                "ratelimit_within_limit_total", "ratelimit_over_limit_total"
            ):
                key = "shared_within" if "within" in sample.name else "shared_over"
                totals[key] += sample.value
        return totals

    def refusals(self) -> dict[str, int]:
        """fairlimit_rpc_refused_total for rate-limit calls, by reason (those above 0)."""
        return {
            sample.labels["reason"]: int(sample.value)
            for sample in self.samples()
            if sample.name == "fairlimit_rpc_refused_total"
            and sample.labels["kind"] == "rls" and sample.value
        }  # fmt: skip

    def grpc_port(self, processes: int = 1) -> int:
        ports = {int(p) for p in self.wait_for(_PORT, processes)}
        if len(ports) != 1:
            raise RuntimeError(f"{self.name}: workers on different ports {ports}")
        return ports.pop()

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


@contextlib.contextmanager
def starved(pid: int, loops: int) -> Iterator[None]:
    """Process ``pid`` (every thread) on CPU 0 beside ``loops`` busy loops, until the end
    (Linux's taskset): a loaded machine, as the process sees it."""
    if not loops:
        yield
        return
    cpu = "0"
    subprocess.run(["taskset", "-a", "-p", "-c", cpu, str(pid)], check=True, capture_output=True)
    spin = [sys.executable, "-c", "import time\nend = time.monotonic() + 120\n"
            "while time.monotonic() < end: pass"]  # fmt: skip
    hogs = [subprocess.Popen(["taskset", "-c", cpu, *spin]) for _ in range(loops)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def noop(workdir: Path, name: str = "noop", *extra: str) -> tuple[Proc, int]:
    """bench/noop.py with ``extra`` flags (``--answer statuses``)."""
    proc = Proc(name, [sys.executable, str(BENCH / "noop.py"), "--addr", "127.0.0.1:0", *extra],
                workdir)  # fmt: skip
    return proc, proc.grpc_port()


def fairlimit(workdir: Path, name: str, backend: str, workers: int = 1, *extra: str,
              config: Path = BENCH / "bench.yaml",
              server: Path = ROOT / "server") -> tuple[Proc, int]:  # fmt: skip
    """``fairlimit serve`` with bench/bench.yaml (or ``config``) and ``extra`` flags, from
    ``server`` (a checkout's server/: this one's unless told); several workers share one
    port."""
    port = free_port() if workers > 1 else 0  # workers need one known port to share
    command = [sys.executable, "-m", "fairlimit", "serve", "--config", str(config),
               "--backend", backend, "--grpc-addr", f"127.0.0.1:{port}",
               "--admin-addr", "127.0.0.1:0", "--workers", str(workers), *extra]  # fmt: skip
    proc = Proc(name, command, workdir, {"PYTHONPATH": str(server)})
    return proc, proc.grpc_port(workers)


class Redis:
    """A throwaway redis-server: no persistence, loopback only."""

    def __init__(self, binary: str, workdir: Path, wrapper: Sequence[str] = (),
                 timeout: float = 10.0) -> None:  # fmt: skip
        """``wrapper``: what runs redis-server (valgrind and its flags); ``timeout``: how
        long it may take to answer once started."""
        import redis  # the bench runs where fairlimit's dependencies are installed

        self.port = free_port()
        self._command = [*wrapper, binary, "--port", str(self.port), "--bind", "127.0.0.1",
                         "--save", "", "--appendonly", "no", "--dir", str(workdir)]  # fmt: skip
        self._workdir = workdir
        self._timeout = timeout
        self.client = redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)
        self.start()

    def start(self) -> None:
        """Start redis-server (again, on the same port: empty, as after a crash) and wait
        until it answers."""
        import redis

        self.proc = Proc("redis", self._command, self._workdir)
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                self.client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.process.poll() is not None:
                    raise RuntimeError("redis-server did not start:\n" + self.proc.text()) from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def calls(self) -> int:
        """Commands Redis has processed so far (INFO stats)."""
        return int(self.client.info("stats")["total_commands_processed"])

    def script_calls(self) -> int:
        """EVALSHA + EVAL calls so far (INFO commandstats)."""
        stats = self.client.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))

    def round_trips(self) -> int:
        """Network reads Redis served (INFO stats total_reads_processed): a pipeline of many
        calls is one read when it arrives in one packet."""
        return int(self.client.info("stats")["total_reads_processed"])

    def flush(self) -> None:
        self.client.flushall()
        self.client.config_resetstat()

    def kill(self) -> None:
        """SIGKILL: a crash (start() brings an empty one back)."""
        self.proc.process.kill()
        self.proc.process.wait(5)

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()
