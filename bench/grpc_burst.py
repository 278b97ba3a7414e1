"""Rate-limit calls at once on one fresh gRPC channel: are they all answered? (issue 37)

    python bench/grpc_burst.py [--calls 30] [--rounds 20] [--starve N] [-- SERVE FLAGS...]

Starts ``fairlimit serve`` (the quick start's descriptors, memory backend), opens one
channel and makes --calls ShouldRateLimit calls at once, --rounds times one after another;
prints how the calls ended, and fairlimit's own refusals (fairlimit_rpc_refused_total by
reason). With ``-- --grpc-max-streams-per-connection 16`` (the old default) calls past 16
on the fresh connection ended ``UNAVAILABLE`` (RST_STREAM, error code 7): a limit the
client had not read yet.

``--starve N`` pins fairlimit (every thread) to CPU 0 beside N busy loops, as a loaded
machine starves it: its event loop then starts calls faster than it reads their messages.
Before calls waited for a place in a full budget, each call beyond --grpc-max-concurrent
ended the call that had waited longest for its message though it had sent it
(RESOURCE_EXHAUSTED, ``evicted``): ``--calls 1000 --rounds 6 --starve 6`` lost 4 and 15
in two runs (issue 41's stop; a CI run of the fresh-Envoy test lost 7 of 200 through Envoy).
"""

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import procs  # noqa: E402
import wire  # noqa: E402

QUICKSTART = ROOT / "examples" / "envoy" / "descriptors" / "quickstart.yaml"


async def calls(target: str, n: int, rounds: int) -> Counter[str]:
    ended: Counter[str] = Counter()
    request = wire.message("public", "alice")
    async with grpc.aio.insecure_channel(target) as channel:
        rls = channel.unary_unary(wire.METHOD)

        async def one() -> None:
            try:
                await rls(request, timeout=10)
                ended["answered"] += 1
            except grpc.aio.AioRpcError as error:
                ended[f"{error.code().name}: {error.details()}"] += 1

        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(n)))
    return ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--starve", type=int, default=0, metavar="N",
                        help="pin fairlimit to CPU 0 beside N busy loops")  # fmt: skip
    args, serve = parser.parse_known_args()
    serve = [a for a in serve if a != "--"]
    with tempfile.TemporaryDirectory() as workdir:
        server, port = procs.fairlimit(
            Path(workdir), "fairlimit", "memory://", 1, *serve, config=QUICKSTART
        )
        try:
            with procs.starved(server.process.pid, args.starve):
                ended = asyncio.run(calls(f"127.0.0.1:{port}", args.calls, args.rounds))
            refused = server.refusals()
        finally:
            server.stop()
    print(f"{args.calls} calls at once x {args.rounds} on one channel, fairlimit "
          f"{' '.join(serve) or '(defaults)'}"
          + (f", starved by {args.starve} busy loops" if args.starve else "") + ":")  # fmt: skip
    for outcome, count in ended.most_common():
        print(f"  {count:5}  {outcome}")
    print(f"fairlimit refused {refused}")


if __name__ == "__main__":
    main()
