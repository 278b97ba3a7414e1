"""Many clients on Redis (issue 41): plain counters beside a fair_share cap, same clients.

    python bench/many_clients.py --clients 10000 --seconds 8
    python bench/many_clients.py --clients 100000 --seconds 8 --prefill

Starts a throwaway redis-server (SLOWLOG at 1 ms) and fairlimit on it (bench/bench.yaml),
then runs bench/loadgen.py on route=plain (a per-client counter) and route=public (the same
counter under a fair_share cap), taking turns (``--rounds``), and prints one row per route:
requests/s, p99, admit.lua µs per call (INFO commandstats), script calls over 1 ms
(SLOWLOG) and the slowest, with the commands SLOWLOG names (an EVALSHA by its script) and
their median and slowest, and the answers given by the failure mode (fairlimit's backend
errors and shed calls); then the Redis time of the costliest commands per route. ``--prefill`` first gives the
cap a row for every client (a copy of one real row, indexed in the cap's seen set): a run
reaches only a few thousand.
Everything binds 127.0.0.1 and is stopped at the end.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import procs

from fairlimit.store.redis import script

_FAIL_OPEN = ("backend_errors", "shed")  # answered by the failure mode
# EVALSHA's sha -> the script it names (store/redis/script.register registers these)
_SHAS = {hashlib.sha1(script.source(name).encode()).hexdigest(): name
         for name in ("admit", "release", "settle", "prune", "acquire", "release_slot", "demand")}


def _text(command: object) -> str:
    return command.decode(errors="replace") if isinstance(command, bytes) else str(command)


def _name(command: object) -> str:
    """The command SLOWLOG logged, an EVALSHA named by its script (``EVALSHA admit``)."""
    words = _text(command).split()
    if not words:
        return "?"
    name = words[0].upper()
    if name == "EVALSHA" and len(words) > 1:
        return f"{name} {_SHAS.get(words[1], words[1][:8])}"
    return name


def _by_command(slow: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per command SLOWLOG logged: how many, and the median and slowest ms."""
    durations: dict[str, list[int]] = {}
    for s in slow:
        durations.setdefault(_name(s["command"]), []).append(int(s["duration"]))
    out = {}
    for name, d in sorted(durations.items(), key=lambda kv: -len(kv[1])):
        d.sort()
        out[name] = [len(d), round(d[len(d) // 2] / 1000, 1), round(d[-1] / 1000, 1)]
    return out


def _counts(by_name: dict[str, list[float]]) -> str:
    return ", ".join(f"{name} {n} ({mid}/{top} ms)" for name, (n, mid, top) in by_name.items())


def _script_stats(redis: procs.Redis) -> tuple[int, float]:
    stats = redis.client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


def _command_stats(redis: procs.Redis) -> dict[str, tuple[int, float]]:
    stats = redis.client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
            for k, v in stats.items()}  # fmt: skip


def _redis_time(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]
                ) -> dict[str, list[float]]:  # fmt: skip
    """Per command (those inside scripts too, and inside EVALSHA's own time): calls, Redis
    ms in all and µs per call during a run, the 6 most costly."""
    out = {}
    for name, (calls, usec) in after.items():
        calls0, usec0 = before.get(name, (0, 0.0))
        if calls > calls0 and name not in ("info", "slowlog|get", "slowlog|reset"):
            n, t = calls - calls0, usec - usec0
            out[name] = [n, round(t / 1000, 1), round(t / n, 1)]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1])[:6])


def _run(route: str, redis: procs.Redis, proc: procs.Proc, port: int, clients: int,
         seconds: float) -> dict[str, Any]:  # fmt: skip
    redis.client.slowlog_reset()
    calls, usec = _script_stats(redis)
    commands = _command_stats(redis)
    before = proc.metrics()
    result = _loadgen_route(port, route, clients, seconds)
    after = proc.metrics()
    calls2, usec2 = _script_stats(redis)
    commands2 = _command_stats(redis)
    slow = redis.client.slowlog_get(100_000)
    return {
        "route": route,
        "rps": result["rps"],
        "p99_ms": result["p99_ms"],
        "usec_per_call": round((usec2 - usec) / max(1, calls2 - calls), 1),
        "calls": calls2 - calls,
        "slowlog_over_1ms": len(slow),
        "slowest_ms": round(max((s["duration"] for s in slow), default=0) / 1000, 1),
        "slowest": _text(max(slow, key=lambda s: s["duration"])["command"])[:300] if slow else "",
        "slow_commands": _by_command(slow),
        "redis_time": _redis_time(commands, commands2),
        "failure_mode": sum(after.get(k, 0.0) - before.get(k, 0.0) for k in _FAIL_OPEN),
        "codes": result["codes"],
    }


def _loadgen_route(port: int, route: str, clients: int, seconds: float) -> dict[str, Any]:
    command = [sys.executable, str(procs.BENCH / "loadgen.py"), "--target", f"127.0.0.1:{port}",
               "--route", route, "--clients", str(clients), "--seconds", f"{seconds:g}"]
    env = {**os.environ, "PYTHONPATH": str(procs.ROOT / "server")}
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120,
                         check=True, env=env)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _prefill(redis: procs.Redis, port: int, clients: int) -> None:
    """A row for each client at the fair cap, as if each had asked once (the load generator
    reaches a few thousand clients in a run): one real request, its row copied."""
    _loadgen_route(port, "public", 1, 0.5)
    (key,) = redis.client.scan_iter(match="*}r:*")
    (seen,) = redis.client.scan_iter(match="*}a:*")  # the cap's index: client -> written at
    row = {f.partition(":")[0]: v for f, v in redis.client.hgetall(key).items()}
    ((_, at),) = redis.client.zrange(seen, 0, 0, withscores=True)
    pipe = redis.client.pipeline(transaction=False)
    for i in range(clients):
        pipe.hset(key, mapping={f"{f}:c{i:07d}": v for f, v in row.items()})
        pipe.zadd(seen, {f"c{i:07d}": at + i * 1e-6})  # as if each asked a µs apart
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--leases", choices=("on", "off"), default="off",
                        help="the Redis URL's leases option (default off: the exact path)")
    parser.add_argument("--redis-server", default="redis-server")
    parser.add_argument("--log", type=Path, help="keep fairlimit's log here")
    parser.add_argument("--prefill", action="store_true",
                        help="give the cap a row for each of the clients before the runs")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="many-clients-") as tmp:
        work = Path(tmp)
        redis = procs.Redis(a.redis_server, work)
        proc = None
        try:
            redis.client.config_set("slowlog-log-slower-than", 1000)
            redis.client.config_set("slowlog-max-len", 100_000)
            url = f"{redis.url}?leases={a.leases}"
            proc, port = procs.fairlimit(work, "fairlimit", url)
            if a.prefill:
                _prefill(redis, port, a.clients)
            rows = []
            for _ in range(a.rounds):
                for route in ("plain", "public"):
                    rows.append(_run(route, redis, proc, port, a.clients, a.seconds))
                    print(json.dumps(rows[-1]), file=sys.stderr)
            rows_hash = [k for k in redis.client.scan_iter(match="*}r:*", count=1000)]
            fields = sum(int(redis.client.hlen(k)) for k in rows_hash)
        finally:
            if proc is not None:
                proc.stop()
                if a.log:
                    a.log.write_text(proc.text())
            redis.stop()
    print(f"clients={a.clients} seconds={a.seconds} leases={a.leases} "
          f"rows-hash fields={fields}")
    print("| route | req/s | p99 ms | admit.lua µs/call | calls | SLOWLOG >1 ms | slowest ms "
          "| slow commands: n (median/slowest ms) | failure mode |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['route']} | {r['rps']} | {r['p99_ms']} | {r['usec_per_call']} | {r['calls']} "
              f"| {r['slowlog_over_1ms']} | {r['slowest_ms']} | {_counts(r['slow_commands'])} "
              f"| {r['failure_mode']:g} |")
    print("\nRedis time per command (calls, ms in all, µs per call; a script's commands also "
          "count in its EVALSHA):")
    for r in rows:
        print(f"- {r['route']}: " + ", ".join(f"{name} {n} / {ms} ms / {us} µs"
                                               for name, (n, ms, us) in r["redis_time"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
