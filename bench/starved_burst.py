"""Rate-limit calls at once on a starved server: are they all answered? (issue 41's stop)

    python bench/starved_burst.py [--calls 1000] [--rounds 6] [--starve 6]
                                  [-- SERVE FLAGS...]

Starts fairlimit (the quick start's descriptors, memory backend), pins it (every thread) to
CPU 0 beside --starve busy loops, and sends --calls ShouldRateLimit calls at once on one
connection, --rounds times. Prints each round's codes (OK, OVER_LIMIT or the gRPC error)
and, at the end, fairlimit's refusals (fairlimit_rpc_refused_total by reason).

A starved event loop starts calls faster than it reads their messages. Before calls beyond
a full budget waited for a place, each took at once the place of the call that had waited
longest for its message, though that one had sent it: it ended RESOURCE_EXHAUSTED, which
Envoy counts as a failed call and lets through (a CI run lost 7 of 200).
"""

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "support")]

import procs  # noqa: E402
import wire  # noqa: E402
from fresh_envoy import QUICKSTART, refusals, starved  # noqa: E402


async def burst(port: int, calls: int) -> Counter[str]:
    """``calls`` calls for alice at once on one connection: how many ended each way."""
    payload = wire.message("public", "alice")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        ask = channel.unary_unary(wire.METHOD)

        async def one() -> str:
            try:
                return wire.overall_code(await ask(payload, timeout=30))
            except grpc.aio.AioRpcError as error:
                return str(error.code().name)

        return Counter(await asyncio.gather(*(one() for _ in range(calls))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--starve", type=int, default=6, metavar="N",
                        help="busy loops beside fairlimit on CPU 0")  # fmt: skip
    args, serve = parser.parse_known_args()
    serve = [a for a in serve if a != "--"]
    print(f"{args.calls} calls at once, fairlimit {' '.join(serve) or '(defaults)'} on CPU 0 "
          f"beside {args.starve} busy loops")  # fmt: skip
    total: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as workdir:
        server, port = procs.fairlimit(Path(workdir), "fairlimit", "memory://", 1, *serve,
                                       config=QUICKSTART)  # fmt: skip
        try:
            with starved(server.process.pid, args.starve):
                for i in range(args.rounds):
                    codes = asyncio.run(burst(port, args.calls))
                    total.update(codes)
                    print(f"  round {i + 1}: {dict(codes)}")
            print(f"all rounds: {dict(total)}; fairlimit refused {refusals(server)}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
