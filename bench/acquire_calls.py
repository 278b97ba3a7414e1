"""One acquire.lua call at a concurrency cap with many clients refused (issue 41).

    python bench/acquire_calls.py --clients 10000
    python bench/acquire_calls.py --clients 10000 --baseline ../main --turns 2

Starts a throwaway redis-server with SLOWLOG logging every command (slowlog-log-slower-than
0), then, per checkout in turns (``--baseline`` first), a process of that checkout's
server/ that fills a full concurrency cap (6 slots held) with ``--clients`` clients refused
in this demand period (one real refusal, the rest written as acquire.lua wrote it, in a
pipeline; the want hash then outlives the run) and makes ``--calls`` acquires of one more
client, each refused. Per checkout it prints the Redis time of each acquire.lua call
(SLOWLOG's µs: median, 90th percentile, slowest), INFO commandstats' usec_per_call of
EVALSHA over those calls, the fields each call handed back, the CPU the checkout's process
spent per call, and the costliest commands inside the script (INFO commandstats, µs per
call). Everything binds 127.0.0.1 and is stopped at the end.
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import procs

CAP = """
domain: edge
descriptors:
  - key: route
    value: public
    concurrency: {max_in_flight: 6, max_duration: 300}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 4, max_duration: 300}
"""
T0 = 1_700_000_000.0


async def _take(limiter: object, client: str, rid: str) -> bool:
    from fairlimit.core.admission import Code
    from fairlimit.core.request import Descriptor, Request

    entries = (("route", "public"), ("client_id", client), ("request_id", rid))
    decision = await limiter.should_rate_limit(  # type: ignore[attr-defined]
        Request("edge", (Descriptor(entries, None, None),))
    )
    return bool(decision.code is Code.OK)


async def _run(url: str, clients: int, calls: int) -> dict[str, object]:
    """In a checkout's process: fill the cap, then time ``calls`` refused acquires."""
    import redis

    from fairlimit.config.loader import parse_domain
    from fairlimit.core.concurrency import split
    from fairlimit.core.matching import Matcher
    from fairlimit.core.request import Descriptor, Request
    from fairlimit.core.rules import Config, Loaded
    from fairlimit.limiter import Limiter
    from fairlimit.store.redis import open_redis
    from fairlimit.store.redis.slots import pool_keys

    class Clock:
        def now(self) -> float:
            return T0

    loaded = Loaded(Config.of([parse_domain(CAP, "bench.yaml")]), (), ())
    store = open_redis(url + "?clock=caller&leases=off&timeout=30&local_cache=0")
    limiter = Limiter(loaded, store, Clock())  # type: ignore[arg-type]
    sync = redis.Redis.from_url(url, decode_responses=True)
    try:
        for i in range(6):
            assert await _take(limiter, f"h{i}", f"r{i}")
        assert not await _take(limiter, "w0", "q0")
        entries = (("route", "public"), ("client_id", "w0"), ("request_id", "x"))
        request = Request("edge", (Descriptor(entries, None, None),))
        pool = split(request, Matcher(loaded.config)).acquire[0].pools[0]
        want = pool_keys("fairlimit:", pool, False)["want"]
        sync.pexpire(want, 600_000)  # before its second is up
        written = sync.hgetall(want)
        pipe = sync.pipeline(transaction=False)
        for first in range(1, clients, 500):
            fields: dict[str, str] = {}
            for i in range(first, min(clients, first + 500)):
                fields |= {f"r:w{i}": "1", f"l:w{i}": written["l:w0"], f"w:w{i}": written["w:w0"]}
            pipe.hset(want, mapping=fields)
        pipe.execute()
        sizes: list[int] = []
        call = store._slots._call  # type: ignore[attr-defined]

        async def recorded(script: object, keys: object, args: object) -> object:
            reply = await call(script, keys, args)
            sizes.append(sum(len(x) for s in reply[4] for x in s if isinstance(x, list)) // 2)
            return reply

        store._slots._call = recorded  # type: ignore[attr-defined]
        sync.config_resetstat()
        sync.slowlog_reset()
        started = time.process_time()
        for i in range(calls):
            assert not await _take(limiter, "w1", f"p{i}")
        cpu = (time.process_time() - started) / calls
        stats = sync.info("commandstats")
        stat = stats["cmdstat_evalsha"]
        inside = {name.removeprefix("cmdstat_"): round(v["usec"] / calls, 1)
                  for name, v in stats.items()
                  if name not in ("cmdstat_evalsha", "cmdstat_info", "cmdstat_slowlog|reset",
                                  "cmdstat_config|resetstat")}  # fmt: skip
        slow = sync.slowlog_get(calls + 100)
        us = sorted(int(e["duration"]) for e in slow
                    if _text(e["command"]).upper().startswith("EVALSHA"))  # fmt: skip
        return {
            "want fields": sync.hlen(want), "calls": stat["calls"],
            "usec_per_call": float(stat["usec_per_call"]),
            "slowlog median us": statistics.median(us),
            "slowlog p90 us": us[int(0.9 * (len(us) - 1))], "slowlog max us": us[-1],
            "fields handed back, max": max(sizes),
            "client CPU ms per call": round(cpu * 1000, 2),
            "inside, us per call": dict(sorted(inside.items(), key=lambda kv: -kv[1])[:6]),
        }  # fmt: skip
    finally:
        sync.close()
        await store.close()  # type: ignore[attr-defined]


def _text(command: object) -> str:
    return command.decode(errors="replace") if isinstance(command, bytes) else str(command)


def _child(url: str, clients: int, calls: int) -> None:
    print(json.dumps(asyncio.run(_run(url, clients, calls))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another checkout, run first in turns")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.clients, args.calls)
        return 0
    binary = procs.ensure_debian_package("redis-server", "redis-server") or "redis-server"
    with tempfile.TemporaryDirectory() as tmp:
        redis = procs.Redis(binary, Path(tmp))
        try:
            redis.client.config_set("slowlog-log-slower-than", 0)
            redis.client.config_set("slowlog-max-len", args.calls + 1000)
            for turn in range(args.turns):
                for label, server in procs.servers(args.baseline):
                    redis.flush()
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", redis.url,
                         "--clients", str(args.clients), "--calls", str(args.calls)],
                        env={"PYTHONPATH": f"{server}:{procs.BENCH}", "PATH": "/usr/bin:/bin"},
                        capture_output=True, text=True, check=False,
                    )  # fmt: skip
                    if out.returncode != 0:
                        raise RuntimeError(f"{label}: {out.stderr[-3000:]}")
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    shown = "this checkout" if label == "this" else str(args.baseline)
                    print(f"turn {turn + 1}, {shown}: {json.dumps(row)}")
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
