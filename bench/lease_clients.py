"""Many clients with leases on: Redis script calls per request (issue 41).

    python bench/lease_clients.py                         # this checkout, 10,000 clients
    python bench/lease_clients.py --baseline ../main      # and another checkout, in turns
    python bench/lease_clients.py --query '' --upstream   # the backend's defaults; every
                                                          # level counting refused hits

`fairlimit serve` on a redis-server started here with ``?leases=on`` (``--query``), driven by
bench/loadgen.py cycling ``--clients`` distinct clients on ``route=plain`` (a client limit,
no cap) and ``route=public`` (under a fair_share cap) for ``--seconds``; each server is
stopped (giving its blocks back) before Redis's EVALSHA + EVAL count is read, so a block
given back counts as the call it is. Prints one line per run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import procs


def run(redis: procs.Redis, workdir: Path, server: Path, label: str, route: str,
        args: argparse.Namespace) -> dict[str, object]:  # fmt: skip
    clients, seconds = args.clients, args.seconds
    query = f"{args.query}&" if args.query else ""
    url = f"{redis.url}?{query}key_prefix={label}-{route}-{os.getpid()}:"
    extra = ["--charge-when-over-limit", "true"] if args.upstream else []
    proc, port = procs.fairlimit(workdir, f"lease-{label}-{route}", url, 1, *extra, server=server)
    try:
        calls = redis.script_calls()
        load = [sys.executable, str(procs.BENCH / "loadgen.py"), "--target", f"127.0.0.1:{port}",
                "--route", route, "--clients", str(clients), "--seconds", f"{seconds:g}",
                "--warmup", "0"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(server)}
        out = subprocess.run(load, capture_output=True, text=True, check=True,
                             timeout=seconds + 60, env=env)  # fmt: skip
        row = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proc.stop()  # its blocks go back now: their calls count
    done = max(1, int(row["done"]))
    return {"server": label, "route": route, "requests": row["done"], "rps": row["rps"],
            "script_calls_per_request": round((redis.script_calls() - calls) / done, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--query", default="leases=on",
                        help="the backend URL's options ('' for the defaults)")
    parser.add_argument("--upstream", action="store_true",
                        help="upstream's semantics: every level counts refused hits")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also `fairlimit serve` from that checkout's server/, in turns")
    args = parser.parse_args()
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    if redis_binary is None:
        print("lease_clients: redis-server not found", file=sys.stderr)
        return 2
    servers = procs.servers(args.baseline)
    with tempfile.TemporaryDirectory(prefix="fairlimit-lease-") as tmp:
        redis = procs.Redis(redis_binary, Path(tmp))
        try:
            for _ in range(args.rounds):
                for label, server in servers:
                    for route in ("plain", "public"):
                        row = run(redis, Path(tmp), server, label, route, args)
                        print(json.dumps(row), flush=True)
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
