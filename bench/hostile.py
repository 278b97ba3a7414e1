"""Real rate-limit calls while hostile calls hold the server: their codes and latency.

    python bench/hostile.py [--rlqs 20] [--stalled 20] [--calls 200] [-- SERVE FLAGS...]
    python bench/hostile.py --rlqs 0 --stalled 0 --oversized 32    # issue 38

Starts ``fairlimit serve`` (memory backend, a small config), opens ``--rlqs`` RLQS streams
that never send a report and ``--stalled`` rate-limit calls that send headers and never
their message, each on its own connection, then makes ``--calls`` real calls from another
connection, one every 10 ms for as long as the hostile ones are held, each with a 1 s
deadline. Prints the real calls' codes, p50/p99/max latency, and how the hostile calls
ended. Issue 26: 32 such calls of either kind made every real call RESOURCE_EXHAUSTED.

``--oversized N`` sends N requests of 10,000 descriptors (200 kB, under the receive limit,
past the 64 allowed), each on its own connection, together with the first real call, and
prints how they ended and when the last was refused. Issue 38: 32 of them took up to 1.7 s
to refuse, and a real call meanwhile waited up to 562 ms.
"""

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import flood  # noqa: E402
import wire  # noqa: E402

RLQS = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas"


async def _silence(release: asyncio.Event) -> AsyncIterator[bytes]:
    await release.wait()
    if False:  # an async generator that yields nothing
        yield b""


async def _ended(call: "grpc.aio.Call") -> str:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call
    except grpc.aio.AioRpcError as error:
        return str(error.code().name)
    return "OK"


def _oversized() -> bytes:
    """A RateLimitRequest of 10,000 one-entry descriptors."""
    d = wire._D
    entries = [d(entries=[d.Entry(key="client_id", value=f"c{i}")]) for i in range(10_000)]
    return wire.rls_pb2.RateLimitRequest(domain="edge", descriptors=entries).SerializeToString()


async def _refused(target: str, payload: bytes, started: float) -> tuple[str, float]:
    """One oversized call on its own connection: its code and when it ended (s)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(target, options) as channel:
        code = await _ended(channel.unary_unary(wire.METHOD)(payload, timeout=30))
    return code, time.perf_counter() - started


async def run(target: str, rlqs: int, stalled: int, calls: int, oversized: int = 0) -> None:
    release = asyncio.Event()
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(target, options) as channel:
        warm = channel.unary_unary(wire.METHOD)  # the server's first call imports: ~0.8 s
        await warm(wire.message("public", "warm"), timeout=10)
    channels = [grpc.aio.insecure_channel(target, options) for _ in range(rlqs + stalled)]
    hostile = []
    for i, channel in enumerate(channels):
        await channel.channel_ready()
        if i < rlqs:
            call = channel.stream_stream(RLQS)(_silence(release), timeout=60)
        else:
            call = channel.stream_unary(wire.METHOD)(_silence(release), timeout=60)
        hostile.append(asyncio.create_task(_ended(call)))
    await asyncio.sleep(0.5)  # every hostile call has reached the server
    codes: Counter[str] = Counter()
    seconds = []
    async with grpc.aio.insecure_channel(target, options) as channel:
        ask = channel.unary_unary(wire.METHOD)
        payload = wire.message("public", "real")
        big, flood_started = _oversized(), time.perf_counter()
        floods = [asyncio.create_task(_refused(target, big, flood_started))
                  for _ in range(oversized)]  # fmt: skip
        for _ in range(calls):
            started = time.perf_counter()
            try:
                await ask(payload, timeout=1)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
            seconds.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
    release.set()
    if floods:
        refused = await asyncio.gather(*floods)
        codes_of = dict(Counter(c for c, _ in refused))
        print(f"{oversized} requests of 10,000 descriptors: {codes_of}, "
              f"the last ended after {max(t for _, t in refused) * 1000:.0f} ms")  # fmt: skip
    ended = Counter(await asyncio.gather(*hostile))
    for channel in channels:
        await channel.close()
    seconds.sort()
    p50, p99 = seconds[len(seconds) // 2], seconds[int(len(seconds) * 0.99) - 1]
    print(f"{rlqs} idle RLQS streams + {stalled} stalled calls: real calls {dict(codes)}, "
          f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {seconds[-1] * 1000:.1f} ms; "
          f"hostile calls ended {dict(ended)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rlqs", type=int, default=20)
    parser.add_argument("--stalled", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--oversized", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    parser.add_argument("flags", nargs="*", help="extra serve flags (after --)")
    args = parser.parse_args()
    server, target = flood.start_server(args.workdir, args.flags)
    try:
        asyncio.run(run(target, args.rlqs, args.stalled, args.calls, args.oversized))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
