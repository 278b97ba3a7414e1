"""Late arrivals live (issue 40): two fairlimit replicas on one real Redis, real gRPC clients.

A batch job floods one replica while users load pages late in the second (at 0.9 of it,
every 2 s) through the other, on a fair-share cap of 100/s over buckets of 100/s. From a
user's third page on the cap expects it back (docs/fairness.md, late arrivals) and holds
its page back from the batch job (the reserve): the users get their pages. Without the
reserve the batch job holds 100·(0.9 + 1/32) = 93 hits by 0.9 and the three pages due
find 7 of their 15; with it, 85·(0.9 + 1/32) = 79, and all 15.

Wall-clock on a loaded machine, so the batch job runs in a process of its own (in the test's
event loop it delayed the pages by up to seconds) and reports what it asked tenth of a second
by tenth, and a second counts only where the promise holds and the cap's answer tells (see
``counted``): every page due decided in time after two pages decided in theirs, none of an
earlier second decided in it, the batch job flooding up to the pages. The exact figures are
tests/simulate/test_late_arrivals.py's, on an injected clock.
"""

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from fair_calls import BatchJob, ask, batch_job, replicas_on
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc
from fairness_cases import flat_config
from redis_servers import RedisProcess
from servers import ServerProcess

pytestmark = [pytest.mark.process, pytest.mark.asyncio]

CAPACITY = 100
CONFIG = flat_config(CAPACITY, "second", CAPACITY, active=5)
SECONDS = 12  # of traffic at least, after a second of warm-up for the batch job alone
MAX_SECONDS = 40  # of traffic at most: until WANTED pages count, however loaded the machine
WANTED = 18  # pages that count (``counted``): six seconds' pages
USERS = 6  # three start in each of the first two seconds; each loads a page every 2 s
PAGE = 5
PHASE = 0.9  # of the second, where every page starts
PROMISED = 0.97  # of the second: a page decided before it gets its max-min share
BATCH_CALLS = 8  # the batch job's calls in flight (in a process of its own)
BOUND = 0.75  # of the pages' requests that count, admitted
FLOOD = 3 * CAPACITY  # asks a second, at least, the batch job makes before a page that counts


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
    batch: BatchJob,
    everyone: list[list[Page]],
) -> None:
    """A user loading a page every 2 s at PHASE of the wall-clock second ``start + first``,
    ``start + first + 2``, ... into a list of its own in ``everyone``: for SECONDS, then
    until WANTED pages of everyone's count (or MAX_SECONDS)."""
    pages: list[Page] = []
    everyone.append(pages)
    second = first
    while second + 1 <= SECONDS or (
        second + 1 <= MAX_SECONDS and len(counted(everyone, batch)) < WANTED
    ):
        await asyncio.sleep(max(0.0, start + second + PHASE - time.time()))
        sent = time.time()
        answers = await asyncio.gather(*(ask(stub, name) for _ in range(PAGE)))
        pages.append(Page(int(start) + second, sent, time.time(), sum(answers)))
        second += 2


def flooded(batch: BatchJob, second: int) -> bool:
    """Whether the batch job asked FLOOD a second or more from the second before ``second``
    up to PHASE of it, and at that pace in each of the two tenths before PHASE: so its
    history has it ask for more than the reserve later in the window (else the reserve goes
    back to it before the pages come) and it presses on its paced bound when they come
    (else it leaves them room whether the cap holds any back or not). Measured, a batch job
    held to about 100 calls a second left the pages 0.71 of theirs with the reserve and 0.62
    without; at 170 and 250 a second, 1.00 and 0.47 (and 300 to 1,700 in these runs)."""
    asks = batch.asked(second - 1, second + PHASE)
    return sum(asks) >= FLOOD * (1 + PHASE) and min(asks[-2:]) >= FLOOD / 10


def expected(pages: list[Page], k: int) -> bool:
    """Whether the cap expects and promises a user's page ``k``: from its third on, decided
    before PROMISED of its second, after two pages decided in theirs (a page the loaded
    machine pushed into the next second changed the user's gap, docs/fairness.md: booked in
    the wrong window)."""
    return k >= 2 and pages[k].promised and all(p.in_its_second for p in pages[k - 2 : k])


def counted(users: list[list[Page]], batch: BatchJob) -> list[Page]:
    """The pages of the seconds in which every page due is ``expected``, no page of an
    earlier second was still being decided (a stalled machine once pushed a second's pages
    into the next, where they took 15 hits before that second's pages came), and the batch
    job ``flooded``. A second counts whole or not at all: which of its pages a loaded
    machine decides late is not chance (without the reserve the first decided take what the
    cap has left, and the late ones, left out, go without)."""
    due: dict[int, list[Page]] = {}
    held: dict[int, int] = {}  # second -> its pages expected
    spilled: set[int] = set()  # seconds into which a page of an earlier one was decided
    for pages in users:
        for k, page in enumerate(pages):
            due.setdefault(page.second, []).append(page)
            held[page.second] = held.get(page.second, 0) + expected(pages, k)
            spilled.update(range(page.second + 1, math.floor(page.received) + 1))
    return [
        page
        for second, pages in sorted(due.items())
        if len(pages) == held[second] == USERS // 2
        and second not in spilled
        and flooded(batch, second)
        for page in pages
    ]


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
                *(_user(user_stub, f"user{k}", k % 2, start, batch, users) for k in range(USERS))
            )
            asked = await batch.stop()
        assert asked > CAPACITY * SECONDS, asked  # the batch job asked more than the cap
        pages = counted(users, batch)
        # a loaded machine delays some pages past the promise, or the batch job: the users
        # went on until WANTED pages counted
        assert len(pages) >= WANTED, ("too few pages counted", users)
        got, of = sum(page.admitted for page in pages), PAGE * len(pages)
        print(f"\nlate arrivals live: {got} of {of} ({got / of:.2f}); batch job {asked} calls")
        # max-min: all of them. Measured on a loaded 2-core machine (load average 6 to 8),
        # 10 runs each: 1.00 in every run (90 to 120 of as many); without the reserve
        # (reserve() 0 in core/sharing.py and admit/verdict.lua) 0.46 to 0.52, 7 of a
        # second's 15 but where the batch job paused just before the pages; v3 (main at
        # 2ac7625, before issue 40) 0.42 to 0.44 in 4 runs. BOUND lies between, a quarter off each
        assert got >= BOUND * of, (got, of, users)
