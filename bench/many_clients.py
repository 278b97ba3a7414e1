"""Many clients on Redis (issue 41): plain counters beside a fair_share cap, same clients.

    python bench/many_clients.py --clients 10000 --seconds 8
    python bench/many_clients.py --clients 100000 --seconds 8 --prefill

Starts a throwaway redis-server (SLOWLOG at 1 ms) and fairlimit on it (bench/bench.yaml),
with leases on as the server has them by default (``--leases off``: the exact path; the
bench's default until 2026-12-07, so the passes of docs/benchmarks.md before then name it),
then runs bench/loadgen.py on route=plain (a per-client counter) and route=public (the same
counter under a fair_share cap), taking turns (``--rounds``), and prints one row per route:
requests/s, p99, admit.lua µs per call (INFO commandstats), script calls over 1 ms
(SLOWLOG) and the slowest, with the commands SLOWLOG names (an EVALSHA by its script) and
their median and slowest, and the answers given by the failure mode (fairlimit's backend
errors and shed calls); then the Redis time of the costliest commands per route.
``--prefill`` first gives the cap a row for every client (a copy of one real row, indexed in
the cap's seen set): a run reaches only a few thousand. Each SLOWLOG entry is set beside its
command's mean in the run (INFO commandstats): one FAR times over or more is counted "far",
the command waiting for a core or for something besides its own work; redis-server's
run-queue wait and involuntary switches (/proc/<pid>/schedstat, status) are printed per run,
and ``--redis-sched fifo`` (root) runs it where ordinary processes cannot preempt it.
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
FAR = 20  # a SLOWLOG entry this many times its command's mean µs per call is not its cost
# EVALSHA's sha -> the script it names (store/redis/script.register registers these)
_SHAS = {hashlib.sha1(script.source(name).encode()).hexdigest(): name
         for name in ("admit", "release", "settle", "prune", "acquire", "release_slot", "demand")}
_SHAS[hashlib.sha1(script.text("read_rows").encode()).hexdigest()] = "read_rows"  # registered alone


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


def _by_command(slow: list[dict[str, Any]], own: dict[str, float]) -> dict[str, list[float]]:
    """Per command SLOWLOG logged: how many, the median and slowest ms, and how many took
    FAR times or more the command's own mean in the run (``own``: µs per call by INFO
    commandstats; an EVALSHA's is every script's)."""
    durations: dict[str, list[int]] = {}
    far: dict[str, int] = {}
    for s in slow:
        name = _name(s["command"])
        durations.setdefault(name, []).append(int(s["duration"]))
        mean = own.get(_stat_name(name))
        far[name] = far.get(name, 0) + (mean is not None and s["duration"] >= FAR * mean)
    out = {}
    for name, d in sorted(durations.items(), key=lambda kv: -len(kv[1])):
        d.sort()
        out[name] = [len(d), round(d[len(d) // 2] / 1000, 1), round(d[-1] / 1000, 1), far[name]]
    return out


def _stat_name(name: str) -> str:
    """The INFO commandstats name of a command SLOWLOG logged (``EVALSHA admit``: evalsha)."""
    return name.split()[0].lower()


def _counts(by_name: dict[str, list[float]]) -> str:
    return ", ".join(f"{name} {n} ({mid}/{top} ms, {far:g} far)"
                     for name, (n, mid, top, far) in by_name.items())  # fmt: skip


def _sched(pid: int) -> dict[str, float]:
    """redis-server's main thread as the kernel scheduled it: ms on a CPU, ms waiting for
    one while runnable (/proc/<pid>/schedstat), and involuntary switches (the scheduler took
    the CPU away: /proc/<pid>/status)."""
    try:
        run, wait, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    switches = next(int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("nonvoluntary_ctxt_switches"))  # fmt: skip
    return {"cpu_ms": int(run) / 1e6, "wait_ms": int(wait) / 1e6, "preempted": switches}


def _set_sched(pid: int, how: str) -> None:
    """Diagnostics: redis-server's main thread at nice -10, or SCHED_FIFO (never preempted
    by ordinary processes), so SLOWLOG shows what a command costs, not the wait for a core."""
    if how == "nice":
        os.setpriority(os.PRIO_PROCESS, pid, -10)
    elif how == "fifo":
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(1))


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
    sched = _sched(redis.proc.pid)
    result = _loadgen_route(port, route, clients, seconds)
    sched2 = _sched(redis.proc.pid)
    after = proc.metrics()
    calls2, usec2 = _script_stats(redis)
    commands2 = _command_stats(redis)
    slow = redis.client.slowlog_get(100_000)
    own = {name: (usec - commands.get(name, (0, 0.0))[1]) / (n - commands.get(name, (0, 0.0))[0])
           for name, (n, usec) in commands2.items() if n > commands.get(name, (0, 0.0))[0]}
    slowest = sorted(slow, key=lambda s: -s["duration"])[:5]
    return {
        "route": route,
        "rps": result["rps"],
        "p99_ms": result["p99_ms"],
        "usec_per_call": round((usec2 - usec) / max(1, calls2 - calls), 1),
        "calls": calls2 - calls,
        "slowlog_over_1ms": len(slow),
        "slowest_ms": round(max((s["duration"] for s in slow), default=0) / 1000, 1),
        "slowest": _text(max(slow, key=lambda s: s["duration"])["command"])[:300] if slow else "",
        "slow_commands": _by_command(slow, own),
        "slowest_five": [[round(s["duration"] / 1000, 2),
                          round(own.get(_stat_name(_name(s["command"])), 0.0), 1),
                          _text(s["command"])[:120]] for s in slowest],
        "sched": {k: round(sched2[k] - sched[k], 1) for k in sched2} if sched else {},
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
    reaches a few thousand clients in a run): one real request, its row copied. A row is a
    hash of its own (``<rows key>:<client>``); before, every row was in one hash of the cap
    (``<field>:<client>``): either is filled, as the server found writes it."""
    _loadgen_route(port, "public", 1, 0.5)
    (key,) = redis.client.scan_iter(match="*}r:*")
    (seen,) = redis.client.scan_iter(match="*}a:*")  # the cap's index: client -> written at
    ((first, at),) = redis.client.zrange(seen, 0, 0, withscores=True)
    own = key.endswith(f":{first}")  # a row of its own
    row = {f.partition(":")[0]: v for f, v in redis.client.hgetall(key).items()}
    ttl = int(redis.client.pttl(key))
    prefix = key.removesuffix(f":{first}")
    pipe = redis.client.pipeline(transaction=False)
    for i in range(clients):
        if own:
            pipe.hset(f"{prefix}:c{i:07d}", mapping=row)
            pipe.pexpire(f"{prefix}:c{i:07d}", ttl)
        else:
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
    parser.add_argument("--leases", choices=("on", "off"), default="on",
                        help="the Redis URL's leases option (default on, as the server's; "
                             "off: the exact path)")
    parser.add_argument("--redis-server", default="redis-server")
    parser.add_argument("--log", type=Path, help="keep fairlimit's log here")
    parser.add_argument("--prefill", action="store_true",
                        help="give the cap a row for each of the clients before the runs")
    parser.add_argument("--redis-sched", choices=("normal", "nice", "fifo"), default="normal",
                        help="diagnostics: run redis-server at nice -10 or SCHED_FIFO (root), "
                        "so SLOWLOG is not the wait for a core")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="many-clients-") as tmp:
        work = Path(tmp)
        redis = procs.Redis(a.redis_server, work)
        proc = None
        try:
            _set_sched(redis.proc.pid, a.redis_sched)
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
            rows_keys = [k for k in redis.client.scan_iter(match="*}r:*", count=1000)]
            pipe = redis.client.pipeline(transaction=False)
            for k in rows_keys:
                pipe.hlen(k)
            fields = sum(int(n) for n in pipe.execute())
            memory = int(redis.client.info("memory")["used_memory"])
        finally:
            if proc is not None:
                proc.stop()
                if a.log:
                    a.log.write_text(proc.text())
            redis.stop()
    print(f"clients={a.clients} seconds={a.seconds} leases={a.leases} "
          f"redis-sched={a.redis_sched} row fields={fields} in {len(rows_keys)} keys, "
          f"Redis used_memory {memory / 1e6:.1f} MB")
    print("| route | req/s | p99 ms | admit.lua µs/call | calls | SLOWLOG >1 ms (far) "
          "| slowest ms | slow commands: n (median/slowest ms, far) | failure mode "
          "| redis CPU / wait for a CPU ms, preempted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        far = sum(int(v[3]) for v in r["slow_commands"].values())
        sched = r["sched"]
        print(f"| {r['route']} | {r['rps']} | {r['p99_ms']} | {r['usec_per_call']} | {r['calls']} "
              f"| {r['slowlog_over_1ms']} ({far}) | {r['slowest_ms']} "
              f"| {_counts(r['slow_commands'])} | {r['failure_mode']:g} "
              f"| {sched.get('cpu_ms', 0):.0f} / {sched.get('wait_ms', 0):.0f}, "
              f"{sched.get('preempted', 0):g} |")
    print(f"\n(far: entries of {FAR}x or more their command's mean µs per call in the run, "
          "by INFO commandstats: not the command's own cost)")
    print("\nSlowest entries (ms, the command's mean µs in the run, the command):")
    for r in rows:
        for ms, mean, text in r["slowest_five"]:
            print(f"- {r['route']}: {ms} ms, mean {mean} µs: {text}")
    print("\nRedis time per command (calls, ms in all, µs per call; a script's commands also "
          "count in its EVALSHA):")
    for r in rows:
        print(f"- {r['route']}: " + ", ".join(f"{name} {n} / {ms} ms / {us} µs"
                                               for name, (n, ms, us) in r["redis_time"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
