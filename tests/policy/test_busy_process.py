"""A healthy Redis read late by a busy process is not a failed store (issue 41).

On a loaded machine the server's event loop may not run for longer than a timeout (its
process descheduled, or busy with other calls): Redis answered in time, but the timer fired
in the loop iteration that read the answer, before the call was handed it. The call was
answered by the failure mode and counted as a backend error, and a call waiting past
STALLED tripped the breaker, which answered every call by the failure mode for
BREAK_SECONDS (bench/run.py, --workers 2: 759 such answers at 80% of its maximum). Here a
real redis-server answers while the test holds the loop (time.sleep, as a starved process
is held); a stopped one (SIGSTOP) is still blamed.
"""

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from fairlimit.core.admission import Code
from fairlimit.flows.decision import Decision
from fairlimit.limiter import STALLED, Limiter
from fairlimit.store.redis import open_redis
from fairlimit.store.redis.store import RedisStore
from helpers import FakeClock, desc, load_text, req
from redis_servers import RedisProcess, suite_url

pytestmark = pytest.mark.behaviour

CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 100}
"""
HELD = 0.2  # seconds the test holds the loop: Redis answers meanwhile, the process reads not
PAST_STALLED = STALLED + 0.001


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of this test's own (one test stops it)."""
    server = RedisProcess(tmp_path).start()
    yield server
    if server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


@pytest.fixture
async def limiter_of(
    redis: RedisProcess, tmp_path: Path
) -> AsyncIterator[Callable[[float], Limiter]]:
    """Limiters on the Redis (leases off: each call asks it) with a store ``timeout``."""
    stores: list[RedisStore] = []

    def make(timeout: float, clock: FakeClock | None = None) -> Limiter:
        store = open_redis(suite_url(redis.url, timeout=timeout))
        assert isinstance(store, RedisStore)
        stores.append(store)
        return Limiter(load_text(tmp_path, CONFIG), store, clock or FakeClock())

    yield make  # type: ignore[misc]
    for store in stores:
        await store.close()


async def _decide(limiter: Limiter, remaining: float | None = None) -> Decision:
    return await limiter.decide(limiter.prepare(req("edge", desc("client_id=a"))), remaining)


async def _sent(limiter: Limiter, redis: RedisProcess) -> "asyncio.Task[Decision]":
    """A call in its own task (as each gRPC call is), sent to a stopped Redis (SIGSTOP),
    which is then let go while the test holds the loop past the timeout: Redis answers
    meanwhile, the process reads not. (Stopped, not busy with a script: the call cannot be
    answered before the hold, however late a loaded machine runs the test.)"""
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        task = asyncio.create_task(_decide(limiter))
        for _ in range(20):  # sent within a few iterations; no answer while stopped
            await asyncio.sleep(0)
        assert limiter.waits.busy
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    time.sleep(HELD)  # the process does not run; Redis answers meanwhile
    return task


async def _waiting(limiter: Limiter) -> "asyncio.Task[Decision]":
    """A call in its own task, run until it waits on the store (a stopped Redis)."""
    task = asyncio.create_task(_decide(limiter))
    for _ in range(200):
        await asyncio.sleep(0)
        if limiter.waits.busy:
            return task
    raise AssertionError("the call never waited on the store")


async def _warm(limiter: Limiter) -> int:
    """Ask until Redis answers (the first call makes the connection and loads the script,
    which may take past a 15 ms timeout on a loaded machine); the remaining hits."""
    for _ in range(20):
        decision = await _decide(limiter)
        if not decision.backend_failed:
            return _remaining(decision)
        await asyncio.sleep(0.05)
    raise AssertionError("Redis never answered")


def _remaining(decision: Decision) -> int:
    """What the store answered: the limit's remaining hits (the failure mode has none)."""
    assert not decision.backend_failed and not decision.shed
    return decision.statuses[0].limit_remaining


class TestALateRead:
    async def test_an_answer_read_after_the_timeout_is_the_answer(
        self, limiter_of: Callable[[float], Limiter], redis: RedisProcess
    ) -> None:
        """Redis answers while the loop is held past the store's timeout (15 ms): the call
        gets Redis's answer, not the failure mode's, and no backend error is counted."""
        limiter = limiter_of(0.015)
        left = await _warm(limiter)
        waiting = await _sent(limiter, redis)
        assert _remaining(await waiting) == left - 1
        assert limiter.backend_healthy

    async def test_a_wait_past_stalled_with_an_answer_unread_does_not_trip_it(
        self, limiter_of: Callable[..., Limiter], redis: RedisProcess
    ) -> None:
        """A call has waited past STALLED (the injected clock) while the loop was held, its
        answer unread: the next call asks Redis too, and both get Redis's answers."""
        clock = FakeClock()
        limiter = limiter_of(1.0, clock)
        left = await _warm(limiter)
        clock.advance(0.001)  # the wait below begins after Redis's last answer
        waiting = await _sent(limiter, redis)
        clock.advance(PAST_STALLED)
        assert _remaining(await _decide(limiter)) in (left - 1, left - 2)
        assert _remaining(await waiting) in (left - 1, left - 2)
        assert limiter.backend_healthy


class TestAStoppedRedis:
    async def test_it_is_still_blamed_at_the_timeout(
        self, limiter_of: Callable[[float], Limiter], redis: RedisProcess
    ) -> None:
        """Redis stopped (SIGSTOP) answers nothing: the call is answered by the failure
        mode once the store's timeout has passed, as before."""
        limiter = limiter_of(0.015)
        await _warm(limiter)
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGSTOP)
        decision = await asyncio.wait_for(_decide(limiter), 5)
        assert decision.code is Code.OK and decision.backend_failed
        assert not limiter.backend_healthy

    async def test_a_wait_past_stalled_trips_it(
        self, limiter_of: Callable[..., Limiter], redis: RedisProcess
    ) -> None:
        """A call waits past STALLED on a stopped Redis: the next is answered by the failure
        mode without asking it, and the waiting call is given up."""
        clock = FakeClock()
        limiter = limiter_of(1.0, clock)
        await _warm(limiter)
        clock.advance(0.001)
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGSTOP)
        waiting = await _waiting(limiter)
        time.sleep(HELD)
        clock.advance(PAST_STALLED)
        round_trips = limiter.store.round_trips  # type: ignore[attr-defined]
        decision = await asyncio.wait_for(_decide(limiter), 5)
        assert decision.backend_failed and limiter.store.round_trips == round_trips  # type: ignore[attr-defined]
        assert (await asyncio.wait_for(waiting, 5)).backend_failed
