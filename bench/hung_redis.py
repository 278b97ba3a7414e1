"""Answers while Redis hangs: fairlimit on a local redis-server (``--failure-mode open``,
default ``?timeout=``), 64 callers each asking every 20 ms with a 20 ms deadline, for 3 s
while the redis-server is SIGSTOPped. Prints the answers by gRPC code.

    python bench/hung_redis.py

docs/failure-modes.md quotes it (the backend breaker).
"""

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


async def main() -> None:
    binary = procs.ensure_debian_package("redis-server", "redis-server")
    if binary is None:
        raise SystemExit("redis-server is needed (Debian package redis-server)")
    workdir = Path(tempfile.mkdtemp())
    redis = procs.Redis(binary, workdir)
    proc, port = procs.fairlimit(workdir, "hung", redis.url)
    body = wire.message("public", "hot")
    codes: Counter[str] = Counter()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(wire.METHOD)
            await call(body, timeout=5)
            os.kill(redis.proc.pid, signal.SIGSTOP)
            end = time.monotonic() + SECONDS

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
            os.kill(redis.proc.pid, signal.SIGCONT)
    finally:
        proc.stop()
        redis.proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    total = sum(codes.values())
    shares = ", ".join(f"{code} {n} ({n / total:.1%})" for code, n in codes.most_common())
    print(f"{total} answers while Redis was stopped: {shares}")


if __name__ == "__main__":
    asyncio.run(main())
