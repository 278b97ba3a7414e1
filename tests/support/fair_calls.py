"""What the live fairness tests share: two replicas on one Redis, the rate-limit call they
make, one client under the `fair` domain's `route=api` cap (fairness_cases.flat_config),
over a real gRPC stub, and a batch job flooding a replica from a process of its own.

Run as a program it is that batch job (``batch_job``):

    python tests/support/fair_calls.py TARGET CLIENT CALLS

``CALLS`` callers ask back to back; it prints "ready" once the first is answered, and the
calls it made once a line on its standard input stops it.
"""

import asyncio
import os
import sys
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


async def _flood(target: str, client: str, calls: int) -> int:
    """``calls`` callers asking back to back for ``client``: "ready" on stdout once the
    first is answered, then on until a line (or the end) on stdin; the calls made."""
    stop = asyncio.Event()

    async def caller(stub: rls_pb2_grpc.RateLimitServiceStub) -> int:
        asked = 0
        while not stop.is_set() and asked < 100_000:  # bounded either way
            asked += 1
            await ask(stub, client)
            if asked == 1 and not ready.done():
                ready.set_result(None)
        return asked

    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        callers = asyncio.gather(*(caller(stub) for _ in range(calls)))
        await ready
        print("ready", flush=True)
        await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), BATCH_SECONDS)
        stop.set()
        return sum(await callers)


class BatchJob:
    """A batch job flooding a replica from a process of its own (its calls in the test's
    event loop delayed the test's other calls by up to seconds on a loaded machine)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def stop(self) -> int:
        """Stop it: the calls it made."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stop\n")
        out, _ = await asyncio.wait_for(self.proc.communicate(), timeout=60)
        assert self.proc.returncode == 0, f"the batch job exited with {self.proc.returncode}"
        return int(out)


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
        yield BatchJob(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


if __name__ == "__main__":
    target, client, calls = sys.argv[1:]
    print(asyncio.run(_flood(target, client, int(calls))))
