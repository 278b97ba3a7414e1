"""Fairness live: two fairlimit replicas on one real Redis, real gRPC clients straight to them.

A batch job hammers one replica while users load pages (a burst of 8 requests each, in the
first three quarters of a second) through the other, on a fair-share cap of 200/s: the
users are counted from their first request and get their pages (max-min gives them all of
it), the batch job gets most of the rest, and the cap holds across both replicas.
Wall-clock, so the bounds are generous; the exact figures are
tests/simulate/test_fairness_cases.py's, on an injected clock.
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

CAPACITY = 200
CONFIG = flat_config(CAPACITY, "second", CAPACITY, active=8)
SECONDS = 6.0  # of traffic, after a second of warm-up for the batch job alone
USERS = 10  # each loads a page of 8 requests every 2 s, at its own offset
PAGE = 8
BATCH_CALLS = 8  # the batch job's calls in flight


async def _batch(stub: rls_pb2_grpc.RateLimitServiceStub, until: float, got: list[float]) -> int:
    """One of the batch job's callers: asks back to back until ``until``; admitted times."""
    asked = 0
    while time.monotonic() < until and asked < 100_000:  # bounded either way
        asked += 1
        if await ask(stub, "batch"):
            got.append(time.monotonic())
    return asked


async def _user(
    stub: rls_pb2_grpc.RateLimitServiceStub, name: str, offset: float, start: float
) -> tuple[int, int]:
    """A user loading a page every 2 s from ``start + offset``: (asked, admitted)."""
    asked = admitted = 0
    at = start + offset
    while at + 0.1 < start + SECONDS:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        answers = await asyncio.gather(*(ask(stub, name) for _ in range(PAGE)))
        asked += PAGE
        admitted += sum(answers)
        at += 2.0
    return asked, admitted


def _offset(k: int) -> float:
    """User k's first page: in the first three quarters of one of the first two seconds
    (a page due in a window's last moments may lose a request: docs/fairness.md)."""
    return (k % 2) + 0.1 + 0.13 * (k // 2)


@pytest.fixture
def replicas(redis_server: RedisProcess, tmp_path: Path) -> Iterator[list[ServerProcess]]:
    with replicas_on(redis_server, tmp_path, CONFIG) as servers:
        yield servers


class TestTwoReplicasOnOneRedis:
    async def test_page_loads_beside_a_batch_job_get_their_pages(
        self, replicas: list[ServerProcess]
    ) -> None:
        """Users through one replica get their pages while a batch job floods the other;
        the batch job still gets most of the rest, and the cap holds across both."""
        async with (
            grpc.aio.insecure_channel(replicas[0].target) as to_batch,
            grpc.aio.insecure_channel(replicas[1].target) as to_users,
        ):
            batch_stub = rls_pb2_grpc.RateLimitServiceStub(to_batch)
            user_stub = rls_pb2_grpc.RateLimitServiceStub(to_users)
            # the traffic starts on a whole second of the machine's clock (Redis TIME's, on
            # this machine), a second after the batch job
            wall, mono = time.time(), time.monotonic()
            warm = mono + (math.floor(wall) + 2.0 - wall)
            admitted: list[float] = []
            batch = [
                asyncio.create_task(_batch(batch_stub, warm + SECONDS, admitted))
                for _ in range(BATCH_CALLS)
            ]
            await asyncio.sleep(max(0.0, warm - time.monotonic()))
            users = await asyncio.gather(
                *(_user(user_stub, f"user{k}", _offset(k), warm) for k in range(USERS))
            )
            await asyncio.gather(*batch)
        asked = sum(a for a, _ in users)
        got = sum(g for _, g in users)
        assert asked >= USERS * PAGE * 2  # every user loaded at least two pages
        # max-min: all of them; wall-clock on a loaded 2-core machine, so 80% (alone it gets
        # 100%; beside the whole suite under -n 2 it measured 81-83%)
        assert got >= 0.80 * asked, (got, asked)
        in_traffic = [t for t in admitted if warm <= t < warm + SECONDS]
        # the batch job's max-min share is the rest of the cap; wall-clock: at least half
        assert len(in_traffic) >= 0.5 * (CAPACITY * SECONDS - asked), len(in_traffic)
        # the cap across both replicas: the seconds of traffic measured here straddle
        # Redis's windows, so at most one window more
        assert len(in_traffic) + got <= CAPACITY * (SECONDS + 1)
