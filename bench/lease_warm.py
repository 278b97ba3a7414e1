"""Warm clients on Redis: script calls per request, on an injected clock (issue 41).

    python bench/lease_warm.py                          # this checkout
    python bench/lease_warm.py --baseline ../base       # and another checkout's server/

Not timed: ``--clients`` clients each ask every ``--gap`` seconds (in turns, the clock
moved by the caller, ``?clock=caller``) for ``--seconds``, through one in-process limiter on
a redis-server started here, on ``route=plain`` (a client limit) and ``route=public`` (under
a fair_share cap) of bench/bench.yaml, and with every level counting refused hits
(``--charge-when-over-limit``, upstream's semantics) on ``route=plain``. Each checkout runs
with ``leases=off`` and ``leases=on``; the store is closed (blocks given back, refused hits
counted) before Redis's EVALSHA + EVAL count is read. Prints one line per run.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import procs

_RUN = """
import asyncio, json, sys
from pathlib import Path
from fairlimit.config.loader import load
from fairlimit.core.request import Descriptor, Request
from fairlimit.limiter import Limiter
from fairlimit.store.redis import open_redis

url, route, clients, gap, seconds, upstream = sys.argv[1:7]
clients, gap, seconds = int(clients), float(gap), float(seconds)

class Clock:
    t = 1_700_000_000.0
    def now(self):
        return self.t

async def main():
    loaded = load([Path(sys.argv[7])], charge_over_limit=upstream == "1")
    store = open_redis(url)
    clock = Clock()
    limiter = Limiter(loaded, store, clock)
    asked = 0
    for step in range(round(seconds / gap)):
        for c in range(clients):
            clock.t = 1_700_000_000.0 + step * gap + c * gap / clients
            entries = (("route", route), ("client_id", f"c{c}"))
            await limiter.should_rate_limit(Request("edge", (Descriptor(entries),)))
            asked += 1
    await store.close()
    print(json.dumps({"requests": asked}))

asyncio.run(main())
"""


def run(redis: procs.Redis, server: Path, label: str, leases: str, route: str, upstream: bool,
        args: argparse.Namespace) -> dict[str, object]:  # fmt: skip
    prefix = f"{label}-{leases}-{route}-{int(upstream)}:"
    url = f"{redis.url}?clock=caller&timeout=1&leases={leases}&key_prefix={prefix}"
    before = redis.script_calls()
    command = [sys.executable, "-c", _RUN, url, route, str(args.clients), f"{args.gap:g}",
               f"{args.seconds:g}", "1" if upstream else "0",
               str(procs.BENCH / "bench.yaml")]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600,
                         env={"PYTHONPATH": str(server), "PATH": "/usr/bin:/bin"})  # fmt: skip
    asked = json.loads(out.stdout.strip().splitlines()[-1])["requests"]
    calls = redis.script_calls() - before
    return {"server": label, "leases": leases, "route": route, "upstream": upstream,
            "requests": asked, "script_calls_per_request": round(calls / max(1, asked), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between a client's asks")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also run that checkout's server/")
    args = parser.parse_args()
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    if redis_binary is None:
        print("lease_warm: redis-server not found", file=sys.stderr)
        return 2
    servers = procs.servers(args.baseline)
    with tempfile.TemporaryDirectory(prefix="fairlimit-lease-warm-") as tmp:
        redis = procs.Redis(redis_binary, Path(tmp))
        try:
            for label, server in servers:
                for route, upstream in (("plain", False), ("public", False), ("plain", True)):
                    for leases in ("off", "on"):
                        row = run(redis, server, label, leases, route, upstream, args)
                        print(json.dumps(row), flush=True)
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
