"""Instructions per rate-limit call, in-process, counted by valgrind (callgrind): a figure
that other load on the machine does not move, where CPU time and req/s do (issue 41).

    python bench/instructions.py                       # plain and public, about 3 minutes
    python bench/instructions.py --baseline ../main    # and another checkout's server/

The call is bench/inproc.py's servicer path (request bytes -> servicer -> limiter -> memory
store -> response bytes, telemetry on as `serve` installs it) for one hot client, on
route=plain (a client limit) and route=public (a client limit under a fair_share cap).
Each count is two runs under callgrind, of FEW and FEW + CALLS calls after the same start:
their difference over CALLS is what one more call costs, start-up and imports left out.
Needs valgrind (Debian valgrind, installed here where missing).
"""

import argparse
import asyncio
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import procs

FEW, CALLS, WARMUP = 200, 1000, 300
_COLLECTED = re.compile(r"Collected : (\d+)")


class _Context:
    """A call's context as the servicer reads it (bench/inproc.py's, which imports this
    checkout's server: here the server is the one asked for)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def read(self) -> bytes:
        return self.body

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("user-agent", "h2load"), ("te", "trailers"))

    def time_remaining(self) -> float | None:
        return 0.02  # Envoy's default rate-limit timeout


def calls(server: str, route: str, count: int) -> None:
    """``count`` hot calls on ``route`` through the servicer of ``server`` (a checkout's
    server/), after WARMUP: the child."""
    sys.path.insert(0, server)
    from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
    from fairlimit.config.loader import load
    from fairlimit.grpc_api.servicer import RateLimitServicer
    from fairlimit.limiter import Limiter
    from fairlimit.store.memory import MemoryStore
    from fairlimit.telemetry import Telemetry
    from fairlimit.telemetry import sdk as otel_sdk

    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[entry(key="route", value=route), entry(key="client_id", value="hot")]
    )
    body = rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor]).SerializeToString()
    sdk = otel_sdk.install({})
    telemetry = Telemetry(rpc_latency=sdk.latency)
    limiter = Limiter(load([procs.BENCH / "bench.yaml"]), MemoryStore(), telemetry=telemetry)
    servicer, context = RateLimitServicer(limiter, telemetry), _Context(body)

    async def run() -> None:
        for _ in range(WARMUP + count):
            (await servicer.ShouldRateLimit(None, context)).SerializeToString()

    asyncio.run(run())
    sdk.shutdown()


def _collected(server: Path, route: str, count: int) -> int:
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
               __file__, "--child", str(server), route, str(count)]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_call(server: Path, route: str, pool: ThreadPoolExecutor) -> int:
    few, more = pool.map(lambda n: _collected(server, route, n), (FEW, FEW + CALLS))
    return round((more - few) / CALLS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also another checkout's server/ (e.g. a worktree of main)")
    parser.add_argument("--routes", default="plain,public", help="comma-separated")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        calls(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if procs.ensure_debian_package("valgrind", "valgrind") is None:
        print("instructions: valgrind not found and not installable", file=sys.stderr)
        return 2
    servers = {"this": procs.ROOT / "server"}
    if args.baseline is not None:
        servers["base"] = args.baseline.resolve() / "server"
    jobs = [(name, route) for route in args.routes.split(",") for name in servers]
    with ThreadPoolExecutor(4) as pool, ThreadPoolExecutor(len(jobs)) as outer:
        counts = dict(zip(jobs, outer.map(
            lambda job: per_call(servers[job[0]], job[1], pool), jobs), strict=True))  # fmt: skip
    print(f"instructions per call, in-process (callgrind, {FEW} and {FEW + CALLS} calls after "
          f"{WARMUP} warm-up ones; one hot client, memory://, telemetry on)")  # fmt: skip
    for route in args.routes.split(","):
        this = counts["this", route]
        line = f"route={route:<8} this checkout {this:>9,}"
        if "base" in servers:
            base = counts["base", route]
            line += f"   {args.baseline}: {base:>9,}   {(this - base) / base:+.1%}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
