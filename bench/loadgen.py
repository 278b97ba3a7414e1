"""A small asyncio gRPC load generator for workloads h2load cannot send: many distinct clients.

h2load posts one fixed body (``-d``) for every request, so it can only be a single client.
This tool cycles through ``--clients`` pre-serialized requests ``(route=R),(client_id=cN)``
over ``--connections`` channels with ``--streams`` calls in flight on each, for a fixed
time after a warm-up, and prints one JSON line: requests/s, p50/p99 latency, answer codes.
It is Python, so it is slower than h2load and shares the CPU with the server under test;
compare its figures only with its own run against the no-op ceiling.

    python bench/loadgen.py --target 127.0.0.1:8081 --clients 10000 --seconds 5
"""

import argparse
import asyncio
import json
import time
from collections import Counter

import grpc
from wire import METHOD, message, overall_code


async def _worker(call: grpc.aio.UnaryUnaryMultiCallable, bodies: list[bytes], start: int,
                  step: int, until: float, warm_until: float,
                  latencies: list[float], codes: Counter[str]) -> None:  # fmt: skip
    i = start
    while True:
        began = time.perf_counter()
        if began >= until:
            return
        response = await call(bodies[i % len(bodies)], timeout=10)
        ended = time.perf_counter()
        if began >= warm_until:
            latencies.append(ended - began)
            codes[overall_code(response)] += 1
        i += step


async def run(target: str, route: str, clients: int, connections: int, streams: int,
              seconds: float, warmup: float) -> dict[str, object]:  # fmt: skip
    bodies = [message(route, f"c{i:07d}") for i in range(clients)]
    options = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(connections)]
    for channel in channels:
        await channel.channel_ready()
    calls = [ch.unary_unary(METHOD) for ch in channels]  # bytes in, bytes out
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    now = time.perf_counter()
    warm_until, until = now + warmup, now + warmup + seconds
    workers = connections * streams
    await asyncio.gather(*(
        _worker(calls[w % connections], bodies, w, workers, until, warm_until, latencies, codes)
        for w in range(workers)
    ))  # fmt: skip
    for channel in channels:
        await channel.close()
    latencies.sort()
    n = len(latencies)
    return {
        "rps": round(n / seconds, 1),
        "p50_ms": round(latencies[n // 2] * 1000, 3) if n else None,
        "p99_ms": round(latencies[min(n - 1, int(n * 0.99))] * 1000, 3) if n else None,
        "done": n,
        "codes": dict(codes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--route", default="public")
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    a = parser.parse_args()
    result = asyncio.run(run(a.target, a.route, a.clients, a.connections, a.streams,
                             a.seconds, a.warmup))  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
