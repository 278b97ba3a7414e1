"""What the live fairness tests share: two replicas on one Redis, the rate-limit call they
make, one client under the `fair` domain's `route=api` cap (fairness_cases.flat_config),
over a real gRPC stub, and a batch job flooding a replica from a process of its own.

Run as a program it is that batch job (``batch_job``):

    python tests/support/fair_calls.py TARGET CLIENT CALLS

``CALLS`` callers ask back to back; it prints "ready" once the first is answered, then a
line "TENTH ASKED ADMITTED" for each tenth of a second of the wall clock (``TENTH``: the
time's floor in tenths) once it is over, counting the calls answered in it, and "calls N"
(the calls it made) once a line on its standard input stops it.
"""

import asyncio
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from redis_servers import RedisProcess
from servers import ROOT, ServerProcess, replicas_of

BATCH_SECONDS = 300  # a batch job stops by itself after this, if it was not stopped

Entry = ratelimit_pb2.RateLimitDescriptor.Entry


def request(client: str) -> rls_pb2.RateLimitRequest:
    entries = [Entry(key="route", value="api"), Entry(key="client_id", value=client)]
    return rls_pb2.RateLimitRequest(
        domain="fair", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=entries)]
    )


async def ask(stub: rls_pb2_grpc.RateLimitServiceStub, client: str) -> bool:
    """Whether ``client``'s call is admitted (5 s to answer)."""
    reply = await stub.ShouldRateLimit(request(client), timeout=5)
    return bool(reply.overall_code == rls_pb2.RateLimitResponse.OK)


@contextmanager
def replicas_on(redis: RedisProcess, workdir: Path, config: str) -> Iterator[list[ServerProcess]]:
    """Two fairlimit processes serving ``config`` on ``redis``, emptied first."""
    with redis.client() as client:
        client.flushall()
    path = workdir / "fair.yaml"
    path.write_text(config)
    with replicas_of(path, redis.url + "?timeout=1") as servers:
        yield servers


def _tenth(at: float) -> int:
    return math.floor(at * 10)


async def _flood(target: str, client: str, calls: int) -> int:
    """``calls`` callers asking back to back for ``client``: "ready" on stdout once the
    first is answered, then each tenth of a second's calls once it is over, on until a line
    (or the end) on stdin; the calls made."""
    stop = asyncio.Event()
    tenths: dict[int, list[int]] = {}  # tenth -> [asked, admitted], answered in it

    async def caller(stub: rls_pb2_grpc.RateLimitServiceStub) -> int:
        asked = 0
        while not stop.is_set() and asked < 100_000:  # bounded either way
            asked += 1
            admitted = await ask(stub, client)
            counts = tenths.setdefault(_tenth(time.time()), [0, 0])
            counts[0] += 1
            counts[1] += admitted
            if asked == 1 and not ready.done():
                ready.set_result(None)
        return asked

    def report(before: int) -> None:
        for tenth in sorted(t for t in tenths if t < before):
            asked, admitted = tenths.pop(tenth)
            print(tenth, asked, admitted, flush=True)

    async def reporter() -> None:
        while not stop.is_set():
            report(_tenth(time.time()))
            await asyncio.sleep(0.1 - time.time() % 0.1 + 0.005)  # just past the tenth

    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        callers = asyncio.gather(*(caller(stub) for _ in range(calls)))
        await ready
        print("ready", flush=True)
        reporting = asyncio.create_task(reporter())
        await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), BATCH_SECONDS)
        stop.set()
        made = sum(await callers)
        await reporting
        report(max(tenths, default=0) + 1)
        return made


class BatchJob:
    """A batch job flooding a replica from a process of its own (its calls in the test's
    event loop delayed the test's other calls by up to seconds on a loaded machine), and
    what it asked, tenth of a second by tenth, as it reports it."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.tenths: dict[int, tuple[int, int]] = {}  # tenth -> (asked, admitted)
        self.calls = -1  # once stopped
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            words = line.split()
            if words[0] == b"calls":
                self.calls = int(words[1])
            else:
                tenth, asked, admitted = map(int, words)
                self.tenths[tenth] = (asked, admitted)

    def asked(self, start: float, end: float) -> list[int]:
        """The calls answered in each tenth of a second from ``start`` to ``end`` (wall
        clock, whole tenths), as far as reported: a tenth not reported yet asked nothing."""
        tenths = range(round(start * 10), round(end * 10))
        return [self.tenths.get(t, (0, 0))[0] for t in tenths]

    def close(self) -> None:
        """Stop reading its reports (the process is stopped or killed besides)."""
        self._reading.cancel()

    async def stop(self) -> int:
        """Stop it: the calls it made."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stop\n")
        await asyncio.wait_for(asyncio.gather(self._reading, self.proc.wait()), timeout=60)
        assert self.proc.returncode == 0, f"the batch job exited with {self.proc.returncode}"
        return self.calls


@asynccontextmanager
async def batch_job(target: str, client: str, calls: int) -> AsyncIterator[BatchJob]:
    """``calls`` callers asking back to back for ``client`` at ``target`` from a process of
    their own: entered once the first call is answered."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "server")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, target, client, str(calls), env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)  # a loaded start
        assert line == b"ready\n", line
        job = BatchJob(proc)
        try:
            yield job
        finally:
            job.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


if __name__ == "__main__":
    target, client, calls = sys.argv[1:]
    print("calls", asyncio.run(_flood(target, client, int(calls))), flush=True)
