"""Answers by the failure mode while Redis is healthy (issue 41): one fairlimit target of
bench/run.py, its full-speed rounds and its run at 80% of its own maximum, on their own.

    python bench/healthy_redis.py                       # (d): leases=off, --workers 2
    python bench/healthy_redis.py --workers 1           # (c): leases=off
    python bench/healthy_redis.py --workers 1 --leases on   # (e): the defaults
    python bench/healthy_redis.py --baseline ../main --turns 2   # main's server, then this
    python bench/healthy_redis.py --rate 1000   # only the paced run, at 1000 req/s

The same loads as bench/run.py: h2load 16 connections x 2 streams as fast as the server
answers (``--rounds`` runs of ``--seconds``; the median's req/s is the maximum), then paced at
80% of it over 4 connections with ``grpc-timeout: 20m`` (as Envoy's filter sends it). For
each phase: the calls, and those answered by the failure mode (backend errors and shed calls
from the server's /metrics, and each worker's calls), and what the server logged when the
backend turned unavailable (the first error of each spell).
"""

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import h2load
import procs
import wire
from h2load import Load

# seconds until every worker's figures are in worker 0's /metrics: the others hand theirs
# over every second (telemetry/pooled.py's DUMP_SECONDS)
POOLED = 1.5
_UNAVAILABLE = re.compile(r"backend unavailable: (.*)")


def _reasons(text: str) -> Counter[str]:
    """The log's 'backend unavailable' lines, by reason (numbers blanked)."""
    return Counter(re.sub(r"[\d.]+", "N", m) for m in _UNAVAILABLE.findall(text))


def metrics(proc: procs.Proc, workers: int = 1) -> dict[str, float]:
    """proc.metrics(), and the calls of each worker (``calls_wN``); with several workers,
    once the others' figures have reached worker 0 (POOLED)."""
    if workers > 1:
        time.sleep(POOLED)
    samples = proc.samples()
    assert samples, f"{proc.name}: no admin /metrics"
    totals = proc.metrics(samples)  # the same reading as the calls per worker below
    for sample in samples:
        if sample.name == "fairlimit_rpc_duration_seconds_count":
            key = f"calls_w{sample.labels.get('worker', '0')}"
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    workers = sorted(k for k in after if k.startswith("calls_w"))
    names = ["rpc_calls", "backend_errors", "shed", *workers]
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0)) for k in names}


def measure(args: argparse.Namespace, workdir: Path, redis: procs.Redis, label: str,
            server: Path) -> None:  # fmt: skip
    """One server's full-speed rounds and its run at 80%, printed."""
    url = f"{redis.url}?leases={args.leases}&key_prefix={label}:"
    proc, port = procs.fairlimit(workdir, label, url, args.workers, server=server)
    try:
        body = wire.write_body(workdir / "body.bin", "public", "hot")
        target = h2load.grpc_url(port)
        before = metrics(proc, args.workers)
        full = [h2load.run(target, Load(16, 2, args.seconds, 1.0), workdir, body=body)
                for _ in range(0 if args.rate else args.rounds)]  # fmt: skip
        at_full = metrics(proc, args.workers)
        rps = args.rate / 0.8 if args.rate else statistics.median(r.rps for r in full)
        paced = Load(4, 8, args.seconds, 1.0, rps * 0.8 / 4)
        headers = (*h2load.GRPC_HEADERS, "grpc-timeout: 20m")
        at80 = h2load.run(target, paced, workdir, body=body, headers=headers)
        after = metrics(proc, args.workers)
    finally:
        proc.stop()
        if args.log is not None:
            (args.log / f"{label}.log").write_text(proc.text())
    name = f"{label}: leases={args.leases} --workers {args.workers}"
    if full:
        print(
            f"{name}: full speed, req/s of each round {[round(r.rps) for r in full]}, "
            f"p99 {[round(r.p99_ms, 1) for r in full]} ms: {_delta(at_full, before)}"
        )
    print(
        f"{name}: paced ({at80.rps:.0f} req/s, p50 {at80.p50_ms:.2f} ms, p99 "
        f"{at80.p99_ms:.2f} ms): {_delta(after, at_full)}"
    )
    print(
        f"{name}: backend unavailable (first error of each spell): {dict(_reasons(proc.text()))}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--leases", choices=["on", "off"], default="off")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, help="req/s of the paced run (no full-speed one)")
    parser.add_argument("--turns", type=int, default=1, help="each server this many times")
    parser.add_argument("--baseline", type=Path, help="another checkout, run first in turns")
    parser.add_argument("--log", type=Path, help="keep each server's log in this directory")
    args = parser.parse_args()
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    if redis_binary is None or h2load.binary() is None:
        print("needs redis-server and h2load", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fairlimit-healthy-") as tmp:
        workdir = Path(tmp)
        redis = procs.Redis(redis_binary, workdir)
        try:
            for turn in range(args.turns):
                for label, server in procs.servers(args.baseline):
                    measure(args, workdir, redis, f"{label}{turn}", server)
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
