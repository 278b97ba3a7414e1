"""Run h2load against a gRPC or HTTP target and read its figures.

h2load has no percentiles of its own; its ``--log-file`` has one line per request (start
time in µs, status, duration in µs), from which p50/p99 are computed. Warm-up requests
(``--warm-up-time``) are not in the figures.
"""

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from wire import METHOD

GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")
_RPS = re.compile(r"finished in [\d.]+\w+, ([\d.]+) req/s")
_DONE = re.compile(r"requests: (\d+) total, \d+ started, (\d+) done, \d+ succeeded, (\d+) failed")
_STATUS = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")


@dataclass(frozen=True)
class Load:
    """How hard to push: h2load's clients (connections), streams each, and pacing."""

    clients: int = 4
    streams: int = 8
    seconds: float = 5.0
    warmup: float = 1.0
    rps_per_client: float | None = None  # None: as fast as the server answers


@dataclass(frozen=True)
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    done: int
    failed: int
    non_2xx: int  # HTTP status other than 2xx (Envoy's 429 included)

    def as_dict(self) -> dict[str, float]:
        return {"rps": round(self.rps, 1), "p50_ms": round(self.p50_ms, 3),
                "p99_ms": round(self.p99_ms, 3), "done": self.done, "failed": self.failed,
                "non_2xx": self.non_2xx}  # fmt: skip


def binary() -> str | None:
    return shutil.which("h2load")


def _percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] / 1000.0


def run(url: str, load: Load, workdir: Path, *, body: Path | None = None,
        headers: tuple[str, ...] = GRPC_HEADERS, label: str = "run",
        keep: bool = False) -> Result:  # fmt: skip
    """One bounded h2load run (duration plus warm-up); raises when h2load fails. ``keep``:
    leave its per-request log (``log_path``) for the caller to read."""
    log = log_path(workdir, label)
    command = [binary() or "h2load", "-t", "1", "-c", str(load.clients), "-m", str(load.streams),
               "-D", f"{round(load.seconds * 1000)}ms",
               f"--warm-up-time={round(load.warmup * 1000)}ms",
               f"--log-file={log}"]  # fmt: skip
    if load.rps_per_client:
        command.append(f"--rps={load.rps_per_client:g}")
    if body is not None:
        command += ["-d", str(body)]
    for header in headers:
        command += ["-H", header]
    command.append(url)
    timeout = load.seconds + load.warmup + 30
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    text = out.stdout
    rps, done, status = _RPS.search(text), _DONE.search(text), _STATUS.search(text)
    if out.returncode != 0 or not (rps and done and status):
        raise RuntimeError(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    durations = sorted(int(line.split("\t")[2]) for line in log.read_text().splitlines() if line)
    if not keep:
        log.unlink()
    return Result(
        rps=float(rps.group(1)),
        p50_ms=_percentile(durations, 0.50),
        p99_ms=_percentile(durations, 0.99),
        done=int(done.group(2)),
        failed=int(done.group(3)),
        non_2xx=sum(int(status.group(i)) for i in (2, 3, 4)),
    )


def log_path(workdir: Path, label: str) -> Path:
    """Where ``run`` writes its per-request log: a line per request, its start (µs since the
    epoch), its status and its duration (µs), tab-separated."""
    return workdir / f"h2load-{label}.tsv"


def grpc_url(port: int) -> str:
    return f"http://127.0.0.1:{port}{METHOD}"
