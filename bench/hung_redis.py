"""Answers while Redis hangs or is gone: fairlimit on a local redis-server (default
``?timeout=``), under load while the redis-server is SIGSTOPped (or SIGKILLed and started
again). Prints the answers by gRPC code (and by overall code for OK answers).

    python bench/hung_redis.py                     # 64 callers, 20 ms deadline, 3 s SIGSTOP
    python bench/hung_redis.py --rate 200 --deadline 1 --mode open --fault stop   # issue 38
    python bench/hung_redis.py --rate 200 --deadline 1 --fault stalls   # ten 300 ms stops
    python bench/hung_redis.py --rate 200 --deadline 1 --fault kill     # down 3 s, restarted

Without ``--rate``: CALLERS callers each asking every 20 ms with a 20 ms deadline (closed
loop), for the 3 s Redis is stopped. With ``--rate R``: R calls a second, open loop, over
``--connections`` connections (4), each with ``--deadline`` seconds, from 0.5 s before the
fault to 0.3 s after it; the answers counted are those sent while Redis was stopped or down.
``--mode`` is the server's ``--failure-mode`` (``--replicas 1``). docs/failure-modes.md
quotes it (the backend breaker).
"""

import argparse
import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import procs
import wire

CALLERS, EVERY, SECONDS = 64, 0.02, 3.0


async def _closed_loop(call: grpc.aio.UnaryUnaryMultiCallable, body: bytes, end: float,
                       codes: Counter[str]) -> None:  # fmt: skip
    async def caller() -> None:
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                await call(body, timeout=EVERY)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] += 1
            await asyncio.sleep(max(0.0, EVERY - (time.monotonic() - started)))

    await asyncio.gather(*(caller() for _ in range(CALLERS)))


async def _one(call: grpc.aio.UnaryUnaryMultiCallable, body: bytes, deadline: float) -> str:
    try:
        reply = await call(body, timeout=deadline)
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    return wire.overall_code(reply)


async def _fault(redis: procs.Redis, fault: str) -> list[tuple[float, float]]:
    """Stop (or kill) Redis as ``fault`` says; the (from, to) spans it was away."""
    spans = []
    stops = [(0.0, SECONDS)] if fault != "stalls" else [(0.3, 0.3)] * 10
    for pause, seconds in stops:
        await asyncio.sleep(pause)
        began = time.monotonic()
        if fault == "kill":
            redis.kill()
            await asyncio.sleep(seconds)
            await asyncio.to_thread(redis.start)
        else:
            os.kill(redis.proc.pid, signal.SIGSTOP)
            await asyncio.sleep(seconds)
            os.kill(redis.proc.pid, signal.SIGCONT)
        spans.append((began, time.monotonic()))
    return spans


async def _open_loop(target: str, body: bytes, args: argparse.Namespace, redis: procs.Redis,
                     codes: Counter[str]) -> None:  # fmt: skip
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options) for _ in range(args.connections)]
    calls = [channel.unary_unary(wire.METHOD) for channel in channels]
    for call in calls:
        await call(body, timeout=5)
    sent: list[tuple[float, asyncio.Task[str]]] = []
    start = time.monotonic()
    fault: asyncio.Task[list[tuple[float, float]]] | None = None
    end = None
    while end is None or time.monotonic() < end:
        now = time.monotonic()
        if fault is None and now >= start + 0.5:
            fault = asyncio.create_task(_fault(redis, args.fault))
        if end is None and fault is not None and fault.done():
            end = now + 0.3
        task = asyncio.create_task(_one(calls[len(sent) % len(calls)], body, args.deadline))
        sent.append((now, task))
        await asyncio.sleep(max(0.0, start + len(sent) / args.rate - time.monotonic()))
    assert fault is not None
    spans = await fault
    for at, task in sent:
        code = await task
        if any(began <= at <= ended for began, ended in spans):
            codes[code] += 1
    for channel in channels:
        await channel.close()


async def main(args: argparse.Namespace) -> None:
    binary = procs.ensure_debian_package("redis-server", "redis-server")
    if binary is None:
        raise SystemExit("redis-server is needed (Debian package redis-server)")
    workdir = Path(tempfile.mkdtemp())
    redis = procs.Redis(binary, workdir)
    proc, port = procs.fairlimit(workdir, "hung", redis.url, 1, "--failure-mode", args.mode,
                                 "--replicas", "1")  # fmt: skip
    body = wire.message("public", "hot")
    codes: Counter[str] = Counter()
    try:
        if args.rate:
            await _open_loop(f"127.0.0.1:{port}", body, args, redis, codes)
        else:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(wire.METHOD)
                await call(body, timeout=5)
                os.kill(redis.proc.pid, signal.SIGSTOP)
                await _closed_loop(call, body, time.monotonic() + SECONDS, codes)
                os.kill(redis.proc.pid, signal.SIGCONT)
    finally:
        if redis.proc.process.poll() is None:
            os.kill(redis.proc.pid, signal.SIGCONT)
        proc.stop()
        redis.proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    total = sum(codes.values())
    shares = ", ".join(f"{code} {n} ({n / total:.1%})" for code, n in codes.most_common())
    what = {"stop": "stopped", "stalls": "stopped (10 x 0.3 s)", "kill": "down"}[args.fault]
    print(f"--failure-mode {args.mode}: {total} answers while Redis was {what}: {shares}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["open", "closed", "local"], default="open")
    parser.add_argument("--fault", choices=["stop", "stalls", "kill"], default="stop")
    parser.add_argument("--rate", type=float, default=0.0, help="calls a second (open loop)")
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--connections", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
