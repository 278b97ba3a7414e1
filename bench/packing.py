"""What packing a Redis command costs the server: a script call with the keys and arguments
of a real admit call (bench/bench.yaml, a client under the fair cap and one on plain
counters, ``?leases=off``'s exact path), sent through redis-py's own connection class and
through fairlimit's (store/redis/packing.py: hiredis packs it in one call), in turns in one
process on the event loop ``fairlimit serve`` runs (uvloop), against a redis-server
started here. The script is ``return 1``, so Redis's own work is the same and small: what
differs is this process's CPU per call (its main thread, ``time.thread_time``), shown as
the least and the median of the rounds.

    python bench/packing.py              # about 30 s
    python bench/packing.py --rounds 4   # a smoke run
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

import procs  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from redis.asyncio.connection import BlockingConnectionPool, Connection  # noqa: E402

from fairlimit.cli import loop_factory  # noqa: E402
from fairlimit.config.loader import load  # noqa: E402
from fairlimit.core.matching import Matcher  # noqa: E402
from fairlimit.core.plan import plan as make_plan  # noqa: E402
from fairlimit.core.request import Descriptor, Request  # noqa: E402
from fairlimit.store.redis import script  # noqa: E402
from fairlimit.store.redis.keys import slot_groups  # noqa: E402
from fairlimit.store.redis.packing import PackedConnection  # noqa: E402
from fairlimit.store.redis.script import ADMIT  # noqa: E402

CONFIG = ROOT / "bench" / "bench.yaml"
CALLS = 2000  # a round's calls of one kind
Call = tuple[list[str], list[str | int]]  # an admit call's keys and arguments


def admit_call(route: str) -> Call:
    """The keys and arguments fairlimit's admit script gets for ``route``'s hot client."""
    matcher = Matcher(load([CONFIG]).config)
    request = Request("edge", (Descriptor((("route", route), ("client_id", "hot"))),))
    plan = make_plan(request, matcher)
    (group,) = slot_groups(plan, "fairlimit:", False)
    args = script.admit_args(plan, group, repr(1_700_000_000.25), (True, 50), {})
    return script.keys(ADMIT, group), args


async def measure(port: int, rounds: int, calls: dict[str, Call]
                  ) -> dict[tuple[str, str], list[float]]:  # fmt: skip
    clients = {
        name: aioredis.Redis.from_pool(BlockingConnectionPool(
            port=port, connection_class=cls, decode_responses=True, max_connections=2))
        for name, cls in (("redis-py", Connection), ("fairlimit", PackedConnection))
    }  # fmt: skip
    sha = await clients["redis-py"].script_load("return 1")
    cpu: dict[tuple[str, str], list[float]] = {(n, r): [] for n in clients for r in calls}
    for _ in range(rounds):
        for name, client in clients.items():
            for route, (keys, args) in calls.items():
                for _ in range(CALLS // 10):  # warm
                    await client.evalsha(sha, len(keys), *keys, *args)
                began = time.thread_time()
                for _ in range(CALLS):
                    await client.evalsha(sha, len(keys), *keys, *args)
                cpu[(name, route)].append((time.thread_time() - began) / CALLS * 1e6)
    for client in clients.values():
        await client.aclose()
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    binary = procs.ensure_debian_package("redis-server", "redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH (Debian package redis-server)")
    calls = {route: admit_call(route) for route in ("public", "plain")}
    with tempfile.TemporaryDirectory() as tmp:
        redis = procs.Redis(binary, Path(tmp))
        try:
            with asyncio.Runner(loop_factory=loop_factory()) as runner:  # as `serve` runs
                cpu = runner.run(measure(redis.port, args.rounds, calls))
        finally:
            redis.stop()
    print(f"EVALSHA of `return 1` with an admit call's keys and arguments, {args.rounds} "
          f"rounds of {CALLS} calls in turns; main thread CPU µs per call")  # fmt: skip
    print(f"{'route':8} {'arguments':>9}  {'redis-py least / median':>24}  "
          f"{'fairlimit least / median':>25}")  # fmt: skip
    for route, (_, arguments) in calls.items():
        n = len(arguments)
        stock, ours = cpu[("redis-py", route)], cpu[("fairlimit", route)]
        print(f"{route:8} {n:>9}  {min(stock):>11.1f} / {statistics.median(stock):>10.1f}  "
              f"{min(ours):>12.1f} / {statistics.median(ours):>10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
