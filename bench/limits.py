"""Several limits on one rule: what a request costs on a rule of 1 limit and on one of 3
(fixed per-second, sliding per-minute, GCRA with a burst), plain and under a fair_share cap,
on memory and on Redis, beside the ceilings measured in the same run (bench/limits.yaml).

    python bench/limits.py               # about 1.5 minutes on 2 cores
    python bench/limits.py --quick       # a smoke test, 15-20 s
    python bench/limits.py --skip grpc   # in-process only (no h2load needed)

In-process, through the Limiter, no gRPC; the rules take turns for PASSES passes and the
best pass is shown (other load on the machine only adds):
- memory: µs per request, each driven straight through (the memory store never awaits);
  the floor is an unlimited rule (no counter, no store call).
- Redis (a redis-server started here), one request in flight: wall µs per request, this
  process's CPU µs per request and Redis's own (INFO commandstats: the usec of every
  command), beside the ceiling of a script call that does nothing (EVALSHA of
  ``return 1`` through a client made as the store's is: the round trip alone); script
  calls and commands per request (the commands the scripts run inside Redis included).
gRPC: h2load (one hot client, 16 connections x 2 streams, no warm-up) on the no-op
ceiling (bench/noop.py) and on fairlimit memory:// and redis:// serving bench/limits.yaml,
on route=limits-1 and route=limits-3, in turns for ROUNDS rounds: req/s, p50 and p99 of
the median round, and the CPU µs per request of the target process (and of redis-server)
from /proc, the least of the rounds.
``python bench/run.py`` runs this too (``--skip limits`` leaves it out).
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2load
import procs
import report
import wire
from h2load import Load
from inproc import drive

sys.path.insert(0, str(procs.ROOT / "server"))

from fairlimit.config.loader import load
from fairlimit.core.admission import Code
from fairlimit.core.request import Descriptor, Request
from fairlimit.limiter import Decision, Limiter
from fairlimit.store.memory import MemoryStore
from fairlimit.store.redis import open_redis, parse_url
from fairlimit.store.redis.client import client_for

CONFIG = procs.BENCH / "limits.yaml"
RULES = dict(report.LIMIT_RULES)  # route -> what it is; the first is memory's floor
NOTHING = "script-return-1"  # the Redis ceiling: a script call that does nothing
GRPC_ROUTES = ("limits-1", "limits-3")
# Generous: the failure mode must not answer for a call that a preempted process made late
# (the per-call timeout changes no cost); the figures count such answers anyway.
REDIS_OPTIONS = "?timeout=1&key_prefix=lim:"
ROUNDS = 3


def _request(route: str) -> Request:
    return Request("edge", (Descriptor((("route", route), ("client_id", "hot"))),))


def _admitted(decision: Decision) -> bool:
    return decision.code is Code.OK and not decision.backend_failed


def memory_costs(passes: int, size: int) -> dict[str, Any]:
    """µs per request on the memory store, by rule: the best of ``passes`` passes of
    ``size`` requests (the rules taking turns; other load on the machine only adds), and
    every pass."""
    limiter = Limiter(load([CONFIG]), MemoryStore())
    requests = {route: _request(route) for route in RULES}
    for request in requests.values():
        for _ in range(200):  # warm: counters, the cap's rows, the plan's caches
            drive(limiter.should_rate_limit(request))
    runs: dict[str, list[float]] = {route: [] for route in RULES}
    refused = dict.fromkeys(RULES, 0)
    for _ in range(passes):
        for route, request in requests.items():
            started = time.perf_counter()
            for _ in range(size):
                if not _admitted(drive(limiter.should_rate_limit(request))):
                    refused[route] += 1
            runs[route].append((time.perf_counter() - started) / size * 1e6)
    return {route: {"us_per_request": round(min(us), 2),
                    "passes_us": [round(x, 2) for x in us], "not_admitted": refused[route]}
            for route, us in runs.items()}  # fmt: skip


def _stats(redis: "procs.Redis") -> dict[str, tuple[int, int, int]]:
    """INFO commandstats: (calls, failed calls, usec) by command, INFO itself left out."""
    stats = redis.client.info("commandstats")
    return {key.removeprefix("cmdstat_"): (int(v["calls"]), int(v["failed_calls"]),
                                           int(v["usec"]))
            for key, v in stats.items() if key != "cmdstat_info"}  # fmt: skip


def _delta(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]
           ) -> tuple[int, int, int]:  # fmt: skip
    """(script calls that ran, commands, usec) between two snapshots."""
    calls = commands = usec = 0
    for name, (n, failed, us) in after.items():
        n0, failed0, us0 = before.get(name, (0, 0, 0))
        commands += n - n0
        usec += us - us0
        if name in ("evalsha", "eval", "fcall"):
            calls += (n - n0) - (failed - failed0)
    return calls, commands, usec


async def _redis_costs(redis: "procs.Redis", passes: int, size: int) -> dict[str, Any]:
    url = redis.url + REDIS_OPTIONS
    store = open_redis(url)
    limiter = Limiter(load([CONFIG]), store)
    probe = client_for(parse_url(url))  # a client as the store's (hiredis, its pool)
    nothing = probe.register_script("return 1")
    requests = {route: _request(route) for route in RULES}

    async def ask(route: str) -> bool:
        if route == NOTHING:
            return int(await nothing(keys=[], args=[])) == 1
        return _admitted(await limiter.should_rate_limit(requests[route]))

    names = [NOTHING, *RULES]
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    inside: dict[str, list[float]] = {name: [] for name in names}  # Redis's usec
    totals = {name: [0, 0] for name in names}  # script calls, commands
    refused = dict.fromkeys(names, 0)
    try:
        for name in names:
            for _ in range(100):  # warm: the scripts loaded, connections open
                await ask(name)
        for _ in range(passes):
            for name in names:
                before = _stats(redis)
                started, cpu_started = time.perf_counter(), time.process_time()
                for _ in range(size):
                    if not await ask(name):
                        refused[name] += 1
                wall[name].append((time.perf_counter() - started) / size * 1e6)
                cpu[name].append((time.process_time() - cpu_started) / size * 1e6)
                calls, commands, usec = _delta(before, _stats(redis))
                totals[name][0] += calls
                totals[name][1] += commands
                inside[name].append(usec / size)
    finally:
        await store.close()
        await probe.aclose()
    n = passes * size
    return {name: {"wall_us": round(min(wall[name]), 1),
                   "cpu_us": round(min(cpu[name]), 1),
                   "redis_us": round(min(inside[name]), 1),
                   "script_calls_per_request": round(totals[name][0] / n, 3),
                   "commands_per_request": round(totals[name][1] / n, 2),
                   "passes_wall_us": [round(x, 1) for x in wall[name]],
                   "not_admitted": refused[name]}
            for name in names}  # fmt: skip


def redis_costs(redis: "procs.Redis", passes: int, size: int) -> dict[str, Any]:
    """Per request on Redis, by rule and for the do-nothing script (see the docstring):
    µs the best pass of each, calls and commands over every pass."""
    return asyncio.run(_redis_costs(redis, passes, size))


def _ask(port: int, route: str) -> str:
    """One ShouldRateLimit through a real channel: what the target answers."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(wire.METHOD)
        return wire.overall_code(call(wire.message(route, "hot"), timeout=10))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _one_run(label: str, port: int, pid: int, body: Path, load_: Load, workdir: Path,
             redis: "procs.Redis | None") -> dict[str, Any]:  # fmt: skip
    """One h2load run with the CPU time per request of the target over it (and, with
    ``redis``, of redis-server, and its script calls and commands per request)."""
    stats = _stats(redis) if redis is not None else {}
    cpu = cpu_seconds(pid)
    redis_cpu = cpu_seconds(redis.proc.pid) if redis is not None else 0.0
    result = h2load.run(h2load.grpc_url(port), load_, workdir, body=body,
                        label=f"limits-{label.replace(' ', '-')}")  # fmt: skip
    done = max(1, result.done)
    row: dict[str, Any] = result.as_dict()
    row["cpu_us"] = round((cpu_seconds(pid) - cpu) / done * 1e6, 1)
    if redis is not None:
        calls, commands, _ = _delta(stats, _stats(redis))
        row["redis_cpu_us"] = round((cpu_seconds(redis.proc.pid) - redis_cpu) / done * 1e6, 1)
        row["script_calls_per_request"] = round(calls / done, 3)
        row["commands_per_request"] = round(commands / done, 2)
    return row


def grpc_costs(workdir: Path, redis: "procs.Redis | None", seconds: float, rounds: int
               ) -> dict[str, Any]:  # fmt: skip
    """h2load on the no-op and on fairlimit's targets by rule, in turns for ``rounds``:
    req/s, p50 and p99 of the median round (by req/s) of each, every round's req/s, and
    the CPU µs per request (the least of the rounds: other load only adds) of the target
    and, on Redis, of redis-server. No warm-up, so that the CPU over a run is that of the
    requests h2load counts (the targets have answered before, and take turns)."""
    starts: list[tuple[str, Callable[[], tuple[procs.Proc, int]]]] = [
        ("noop", lambda: procs.noop(workdir, "limits-noop")),
        ("memory", lambda: procs.fairlimit(workdir, "limits-memory", "memory://",
                                           config=CONFIG)),
    ]  # fmt: skip
    if redis is not None:
        url = redis.url + "?key_prefix=limg:"
        starts.append(("redis", lambda: procs.fairlimit(workdir, "limits-redis", url,
                                                        config=CONFIG)))  # fmt: skip
    running: dict[str, tuple[procs.Proc, int]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for name, start in starts:
            running[name] = start()
        labels: list[tuple[str, int, int, Path]] = []
        for name, (proc, port) in running.items():
            for route in GRPC_ROUTES[:1] if name == "noop" else GRPC_ROUTES:
                answer = _ask(port, route)
                if answer != "OK":
                    raise RuntimeError(f"{name} answered {answer} on route={route}")
                body = wire.write_body(workdir / f"limits-{route}.bin", route, "hot")
                label = name if name == "noop" else f"{name} {route}"
                labels.append((label, port, proc.pid, body))
        load_ = Load(clients=16, streams=2, seconds=seconds, warmup=0.0)
        for i in range(rounds):
            for label, port, pid, body in labels:
                print(f"== limits, round {i + 1}/{rounds}: {label}", file=sys.stderr)
                on = redis if label.startswith("redis") else None
                run = _one_run(f"{label}-{i}", port, pid, body, load_, workdir, on)
                runs.setdefault(label, []).append(run)
    finally:
        for proc, _ in running.values():
            proc.stop()
    out: dict[str, Any] = {}
    for label, results in runs.items():
        ordered = sorted(results, key=lambda r: r["rps"])
        row = {**ordered[len(ordered) // 2], "rounds_rps": [r["rps"] for r in results]}
        for key in ("cpu_us", "redis_cpu_us"):
            if key in row:
                row[key] = min(r[key] for r in results)
        out[label] = row
    return out


def measure(workdir: Path, redis_binary: str | None, *, quick: bool, seconds: float,
            grpc: bool = True, inproc: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every part, on a redis-server of its own (when there is one): the results dict."""
    passes = 3 if quick else 7
    sizes = (2000, 500) if quick else (5000, 2000)
    results: dict[str, Any] = {"passes": passes, "memory_size": sizes[0],
                               "redis_size": sizes[1], "notes": []}  # fmt: skip
    redis = procs.Redis(redis_binary, workdir) if redis_binary else None
    if redis is None:
        results["notes"].append("redis-server missing: the Redis figures are left out")
    try:
        if inproc:
            print("== limits: in-process, memory", file=sys.stderr)
            results["memory"] = memory_costs(passes, sizes[0])
            if redis is not None:
                print("== limits: in-process, redis", file=sys.stderr)
                results["redis"] = redis_costs(redis, passes, sizes[1])
                redis.flush()
        if grpc:
            if h2load.binary() is None:
                results["notes"].append("h2load missing: the gRPC figures are left out")
            else:
                results["grpc"] = grpc_costs(workdir, redis, seconds, 1 if quick else ROUNDS)
    finally:
        if redis is not None:
            redis.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter passes")
    parser.add_argument("--seconds", type=float, help="length of each h2load run (default 4)")
    parser.add_argument("--skip", action="append", default=[], choices=["inproc", "grpc"],
                        help="leave a part out")  # fmt: skip
    args = parser.parse_args()
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    grpc = "grpc" not in args.skip
    if grpc:
        procs.ensure_debian_package("h2load", "nghttp2-client")
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fairlimit-limits-") as tmp:
        results = measure(Path(tmp), redis_binary, quick=args.quick, seconds=seconds,
                          grpc=grpc, inproc="inproc" not in args.skip)  # fmt: skip
    results["seconds"] = round(time.monotonic() - started, 1)
    out = procs.BENCH / "results" / time.strftime("limits-%Y%m%dT%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(report.limits_rows(results)))
    print(f"\n(JSON: {out.relative_to(procs.ROOT)}; {results['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
