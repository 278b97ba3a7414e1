"""Calls through a SIGTERM: how the calls that reached the server end.

    python bench/drain.py [--calls 40] [--rate 0] [--delay 0] [--runs 3]

Starts ``fairlimit serve`` (memory backend, bench/bench.yaml); ``--calls`` calls of 64
descriptors each (route=public, a client each) over 4 connections (at most 16 streams each,
so that no call is refused by the connection's stream limit), and SIGTERM 10 ms after they
are sent. With ``--rate R``: R calls a second instead (one descriptor each, as Envoy sends,
100 clients), SIGTERM after 0.5 s, the load going on
for ``--drain-delay`` (``--delay``) plus 0.5 s after it, then stopping. Prints each run's
codes and the time between the log's "draining" and "stopped". Issue 38: 30 of 40 ended
CANCELLED, the drain and the stop 9 ms apart.
"""

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import grpc
import procs
import wire

CONNECTIONS = 4
DETAILS = "--details" in sys.argv
_STAMP = re.compile(r"^(\S+ \S+) .*?(draining: health|stopped)", re.MULTILINE)


def heavy(tag: str) -> bytes:
    """64 descriptors (the most a request may have), each a client of route=public."""
    d = wire._D
    route = d.Entry(key="route", value="public")
    descriptors = [d(entries=[route, d.Entry(key="client_id", value=f"{tag}{i}")])
                   for i in range(64)]  # fmt: skip
    return wire.rls_pb2.RateLimitRequest(domain="edge", descriptors=descriptors).SerializeToString()


async def _code(channel: grpc.aio.Channel, payload: bytes) -> str:
    try:
        await channel.unary_unary(wire.METHOD)(payload, timeout=30)
    except grpc.aio.AioRpcError as error:
        return f"{error.code().name}" + (f" ({error.details()[:40]})" if DETAILS else "")
    return "OK"


async def one_run(calls: int, rate: float, delay: float) -> None:
    workdir = Path(tempfile.mkdtemp())
    proc, port = procs.fairlimit(workdir, "drain", "memory://", 1, "--drain-delay", str(delay))
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options)
                for _ in range(CONNECTIONS)]  # fmt: skip
    try:
        for channel in channels:
            await _code(channel, heavy("warm"))
        sent: list[asyncio.Task[str]] = []
        if rate <= 0:
            sent = [asyncio.create_task(_code(channels[i % CONNECTIONS], heavy(f"c{i}-")))
                    for i in range(calls)]  # fmt: skip
            await asyncio.sleep(0.01)
            proc.process.terminate()
        else:
            start, signalled = time.monotonic(), False
            end = start + 0.5 + delay + 0.5
            while time.monotonic() < end:
                if not signalled and time.monotonic() >= start + 0.5:
                    proc.process.terminate()
                    signalled = True
                channel = channels[len(sent) % CONNECTIONS]
                body = wire.message("public", f"c{len(sent) % 100}")
                sent.append(asyncio.create_task(_code(channel, body)))
                await asyncio.sleep(max(0.0, start + len(sent) / rate - time.monotonic()))
        codes = Counter(await asyncio.gather(*sent))
        await asyncio.to_thread(proc.process.wait, 30)
    finally:
        for channel in channels:
            await channel.close()
        proc.stop()
    stamps = {what: datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f")
              for at, what in _STAMP.findall(proc.text())}  # fmt: skip
    apart = (stamps["stopped"] - stamps["draining: health"]).total_seconds() * 1000
    print(f"{sum(codes.values())} calls: {dict(codes)}; exit {proc.process.returncode}; "
          f"drain to stop {apart:.0f} ms")
    shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--details", action="store_true", help="codes with their details")
    args = parser.parse_args()
    for _ in range(args.runs):
        asyncio.run(one_run(args.calls, args.rate, args.delay))


if __name__ == "__main__":
    sys.exit(main())
