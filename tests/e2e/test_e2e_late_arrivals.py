"""Late arrivals live (issue 40): two fairlimit replicas on one real Redis, real gRPC clients.

A batch job hammers one replica while users load pages late in the second (at 0.9 of it,
every 2 s) through the other, on a fair-share cap of 100/s over buckets of 100/s. From a
user's third page on the cap expects it back (docs/fairness.md, late arrivals) and holds
its page back from the batch job: the users get their pages. Wall-clock on a loaded
machine, so the bound is generous; the exact figures are tests/simulate/test_late_arrivals.py's,
on an injected clock.
"""

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fair_calls import ask, replicas_on
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc
from fairness_cases import flat_config
from redis_servers import RedisProcess
from servers import ServerProcess

pytestmark = [pytest.mark.process, pytest.mark.asyncio]

CAPACITY = 100
CONFIG = flat_config(CAPACITY, "second", CAPACITY, active=5)
SECONDS = 12  # of traffic, after a second of warm-up for the batch job alone
USERS = 6  # three start in each of the first two seconds; each loads a page every 2 s
PAGE = 5
PHASE = 0.9  # of the second, where every page starts
BATCH_CALLS = 8  # the batch job's calls in flight


async def _batch(stub: rls_pb2_grpc.RateLimitServiceStub, until: float) -> int:
    """One of the batch job's callers: asks back to back until ``until``."""
    asked = 0
    while time.monotonic() < until and asked < 100_000:  # bounded either way
        asked += 1
        await ask(stub, "batch")
    return asked


async def _user(
    stub: rls_pb2_grpc.RateLimitServiceStub, name: str, first: int, start: float
) -> list[tuple[int, int]]:
    """A user loading a page every 2 s at PHASE of second ``first``, ``first + 2``, ...
    after ``start``: (asked, admitted) per page."""
    pages = []
    second = first
    while second + 1 <= SECONDS:
        await asyncio.sleep(max(0.0, start + second + PHASE - time.monotonic()))
        answers = await asyncio.gather(*(ask(stub, name) for _ in range(PAGE)))
        pages.append((PAGE, sum(answers)))
        second += 2
    return pages


@pytest.fixture
def replicas(redis_server: RedisProcess, tmp_path: Path) -> Iterator[list[ServerProcess]]:
    with replicas_on(redis_server, tmp_path, CONFIG) as servers:
        yield servers


class TestTwoReplicasOnOneRedis:
    async def test_pages_late_in_the_second_get_through_once_expected(
        self, replicas: list[ServerProcess]
    ) -> None:
        """From their third page on (the cap knows their gap), users whose pages start at
        0.9 of the second get them, while a batch job floods the other replica."""
        async with (
            grpc.aio.insecure_channel(replicas[0].target) as to_batch,
            grpc.aio.insecure_channel(replicas[1].target) as to_users,
        ):
            batch_stub = rls_pb2_grpc.RateLimitServiceStub(to_batch)
            user_stub = rls_pb2_grpc.RateLimitServiceStub(to_users)
            # the traffic starts on a whole second of the machine's clock (Redis TIME's, on
            # this machine), a second after the batch job
            wall, mono = time.time(), time.monotonic()
            start = mono + (math.floor(wall) + 2.0 - wall)
            batch = [
                asyncio.create_task(_batch(batch_stub, start + SECONDS)) for _ in range(BATCH_CALLS)
            ]
            users = await asyncio.gather(
                *(_user(user_stub, f"user{k}", k % 2, start) for k in range(USERS))
            )
            asked = sum(await asyncio.gather(*batch))
        expected = [page for pages in users for page in pages[2:]]
        assert asked > CAPACITY * SECONDS, asked  # the batch job asked more than the cap
        assert len(expected) >= USERS * 3
        got, of = sum(g for _, g in expected), sum(a for a, _ in expected)
        # max-min: all of them; wall-clock on a loaded 2-core machine, so 80% (measured: 99
        # and 120 of 120; main before issue 40: 45 of 120)
        assert got >= 0.80 * of, (got, of, users)
