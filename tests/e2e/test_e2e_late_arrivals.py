"""Late arrivals live (issue 40): two fairlimit replicas on one real Redis, real gRPC clients.

A batch job hammers one replica while users load pages late in the second (at 0.9 of it,
every 2 s) through the other, on a fair-share cap of 100/s over buckets of 100/s. From a
user's third page on the cap expects it back (docs/fairness.md, late arrivals) and holds
its page back from the batch job: the users get their pages. Wall-clock on a loaded
machine, so the bound is generous, the batch job runs in a process of its own (in the test's
event loop it delayed the pages by up to seconds), and a page counts only where the promise
holds: decided before 0.97 of its second, after two pages decided in theirs. The exact
figures are tests/simulate/test_late_arrivals.py's, on an injected clock.
"""

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from fair_calls import ask, batch_job, replicas_on
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc
from fairness_cases import flat_config
from redis_servers import RedisProcess
from servers import ServerProcess

pytestmark = [pytest.mark.process, pytest.mark.asyncio]

CAPACITY = 100
CONFIG = flat_config(CAPACITY, "second", CAPACITY, active=5)
SECONDS = 12  # of traffic at least, after a second of warm-up for the batch job alone
MAX_SECONDS = 40  # of traffic at most: until WANTED pages count, however loaded the machine
WANTED = 18  # pages that count (decided where the promise holds), 3 of each user's
USERS = 6  # three start in each of the first two seconds; each loads a page every 2 s
PAGE = 5
PHASE = 0.9  # of the second, where every page starts
PROMISED = 0.97  # of the second: a page decided before it gets its max-min share
BATCH_CALLS = 8  # the batch job's calls in flight (in a process of its own)


class Page(NamedTuple):
    second: int  # the wall-clock second it was due in
    sent: float  # wall-clock, when its first call went out
    received: float  # when its last answer came back
    admitted: int  # of PAGE

    @property
    def in_its_second(self) -> bool:
        """Decided in the second it was due in: the cap saw the user's gap as it is."""
        return self.second <= self.sent and self.received < self.second + 1

    @property
    def promised(self) -> bool:
        """Decided in its second before PROMISED of it, where docs/fairness.md promises it."""
        return self.in_its_second and self.received < self.second + PROMISED


async def _user(
    stub: rls_pb2_grpc.RateLimitServiceStub,
    name: str,
    first: int,
    start: float,
    everyone: list[list[Page]],
) -> None:
    """A user loading a page every 2 s at PHASE of the wall-clock second ``start + first``,
    ``start + first + 2``, ... into a list of its own in ``everyone``: for SECONDS, then
    until WANTED pages of everyone's count (or MAX_SECONDS)."""
    pages: list[Page] = []
    everyone.append(pages)
    second = first
    while second + 1 <= SECONDS or (
        second + 1 <= MAX_SECONDS and sum(len(expected(p)) for p in everyone) < WANTED
    ):
        await asyncio.sleep(max(0.0, start + second + PHASE - time.time()))
        sent = time.time()
        answers = await asyncio.gather(*(ask(stub, name) for _ in range(PAGE)))
        pages.append(Page(int(start) + second, sent, time.time(), sum(answers)))
        second += 2


def expected(pages: list[Page]) -> list[Page]:
    """The pages the cap expects and promises: from the third on, each decided before
    PROMISED of its second, after two pages decided in theirs (a page the loaded machine
    pushed into the next second changed the user's gap, docs/fairness.md: booked in the
    wrong window)."""
    return [
        page
        for k, page in enumerate(pages)
        if k >= 2 and page.promised and pages[k - 1].in_its_second
        and pages[k - 2].in_its_second
    ]  # fmt: skip


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
            batch_job(replicas[0].target, "batch", BATCH_CALLS) as batch,
            grpc.aio.insecure_channel(replicas[1].target) as to_users,
        ):
            # the users start on a whole second of the machine's clock (Redis TIME's, on
            # this machine), a second or more after the batch job
            start = math.floor(time.time()) + 2.0
            user_stub = rls_pb2_grpc.RateLimitServiceStub(to_users)
            users: list[list[Page]] = []
            await asyncio.gather(
                *(_user(user_stub, f"user{k}", k % 2, start, users) for k in range(USERS))
            )
            asked = await batch.stop()
        assert asked > CAPACITY * SECONDS, asked  # the batch job asked more than the cap
        pages = [page for each in users for page in expected(each)]
        # a loaded machine delays some pages past the promise (in one run 11 of the first 24
        # counted): the users went on until WANTED did
        assert len(pages) >= WANTED, ("too few pages decided in time", users)
        got, of = sum(page.admitted for page in pages), PAGE * len(pages)
        # max-min: all of them; wall-clock on a loaded 2-core machine, so 80% (measured: 99
        # and 120 of 120; main before issue 40: 45 of 120)
        assert got >= 0.80 * of, (got, of, users)
