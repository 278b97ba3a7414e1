"""The backend breaker (issue 26): while the store keeps failing, calls are answered by the
failure mode at once instead of each waiting for its own timeout (a stopped Redis held every
call that long, and queued calls filled --grpc-max-concurrent: fail-open answers turned into
RESOURCE_EXHAUSTED). After BREAK_SECONDS the store is asked again."""

import asyncio
from pathlib import Path

import pytest

from fairlimit.core.admission import Code
from fairlimit.errors import StoreUnavailable
from fairlimit.limiter import BREAK_AFTER, BREAK_SECONDS, STALLED, Limiter
from fairlimit.policy.breaker import HEAR
from fairlimit.settings import FailureMode
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, desc, load_text, req

CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 100}
"""


PAST_STALLED = STALLED + 0.001  # (the clock's floats: 1.7e9 + 0.05 - 1.7e9 < 0.05)
TIMEOUT = 0.05  # seconds a failing call takes (a Redis timeout), on the injected clock


class FlakyStore(MemoryStore):
    """A memory store that can be made to fail each call after its timeout (moving the
    injected clock, when given, by TIMEOUT), as a stopped Redis does; counts the calls that
    reached it."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        super().__init__()
        self.down = False
        self.calls = 0
        self.clock = clock

    async def admit(self, plan, now):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.down:
            await asyncio.sleep(0.01)
            if self.clock is not None:
                self.clock.advance(TIMEOUT)
            raise StoreUnavailable("redis: timed out")
        return await super().admit(plan, now)

    async def ping(self) -> None:
        if self.down:
            raise StoreUnavailable("redis: timed out")


class FailingNow(MemoryStore):
    """A memory store whose own admit, asked without a coroutine (policy/guarded.py's path
    for a store that never waits), fails after its timeout on the injected clock when
    ``down``; counts the calls that reached it."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.down = False
        self.calls = 0
        self.clock = clock

    def admit_now(self, plan, now):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.down:
            self.clock.advance(TIMEOUT)
            raise StoreUnavailable("in-process store failed")
        return super().admit_now(plan, now)


@pytest.fixture(params=["awaited", "in-process"])
def failing_store(request: pytest.FixtureRequest) -> type[FlakyStore] | type["FailingNow"]:
    """A failing store of each path the policy takes: one whose admit is awaited, and an
    in-process one asked without a coroutine; both fail after TIMEOUT when ``down``."""
    return FlakyStore if request.param == "awaited" else FailingNow


async def _ask(limiter: Limiter) -> Code:
    return (await limiter.should_rate_limit(req("edge", desc("client_id=a")))).code


@pytest.mark.behaviour
class TestBreaker:
    async def test_a_failing_store_is_left_alone_for_a_while(
        self, tmp_path: Path, failing_store: type[FlakyStore] | type[FailingNow]
    ) -> None:
        clock = FakeClock()
        store = failing_store(clock)
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)
        assert await _ask(limiter) is Code.OK and store.calls == 1
        store.down = True
        answers = [await _ask(limiter) for _ in range(BREAK_AFTER + 20)]
        assert set(answers) == {Code.OK}  # failure mode open
        assert store.calls == 1 + BREAK_AFTER  # the rest never waited for the store
        assert not limiter.backend_healthy
        clock.advance(BREAK_SECONDS)
        store.down = False
        assert await _ask(limiter) is Code.OK
        assert store.calls == 2 + BREAK_AFTER and limiter.backend_healthy
        assert await _ask(limiter) is Code.OK and store.calls == 3 + BREAK_AFTER

    async def test_fewer_failures_do_not_open_it(
        self, tmp_path: Path, failing_store: type[FlakyStore] | type[FailingNow]
    ) -> None:
        clock = FakeClock()
        store = failing_store(clock)
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)
        for _ in range(5):
            store.down = True
            for _ in range(BREAK_AFTER - 1):
                await _ask(limiter)
            store.down = False
            await _ask(limiter)  # a success resets the count
        assert store.calls == 5 * BREAK_AFTER

    async def test_closed_mode_raises_while_open(
        self, tmp_path: Path, failing_store: type[FlakyStore] | type[FailingNow]
    ) -> None:
        clock = FakeClock()
        store = failing_store(clock)
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock,
                          failure_mode=FailureMode.CLOSED)  # fmt: skip
        store.down = True
        for _ in range(BREAK_AFTER + 3):
            with pytest.raises(StoreUnavailable):
                await _ask(limiter)
        assert store.calls == BREAK_AFTER

    async def test_a_readiness_ping_that_answers_closes_it(self, tmp_path: Path) -> None:
        """Open, then the store is back and /readyz's ping reaches it: calls go to the
        store at once, without waiting out BREAK_SECONDS."""
        clock = FakeClock()
        store = FlakyStore(clock)
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)
        store.down = True
        for _ in range(BREAK_AFTER + 2):
            await _ask(limiter)
        assert store.calls == BREAK_AFTER
        store.down = False
        assert await limiter.ping()
        assert await _ask(limiter) is Code.OK and store.calls == BREAK_AFTER + 1

    async def test_failures_while_the_store_still_answers_do_not_open_it(
        self, tmp_path: Path
    ) -> None:
        """A loaded store: timeouts in a row, but it answered within BREAK_QUIET (the clock
        does not move): every call still asks it (the breaker opened under load before,
        answering thousands of calls without a decision)."""
        store = FlakyStore()  # failures take no time on the injected clock
        limiter = Limiter(load_text(tmp_path, CONFIG), store, FakeClock())
        assert await _ask(limiter) is Code.OK
        store.down = True
        for _ in range(3 * BREAK_AFTER):
            await _ask(limiter)
        assert store.calls == 1 + 3 * BREAK_AFTER


class HungStore(MemoryStore):
    """A memory store whose admit waits until released while ``hung`` (a stopped Redis
    before its timeout); counts the calls that reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = False
        self.calls = 0
        self.release = asyncio.Event()

    async def admit(self, plan, now):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.hung:
            await self.release.wait()
            raise StoreUnavailable("redis: timed out")
        return await super().admit(plan, now)


async def _started(limiter: Limiter) -> "asyncio.Task[Code]":
    """A call in its own task (as each gRPC call is), run until it waits on the store."""
    task = asyncio.create_task(_ask(limiter))
    for _ in range(5):
        await asyncio.sleep(0)
    return task


@pytest.mark.behaviour
class TestStalledStore:
    """A stopped Redis fails nothing until each call's timeout passes: the calls waiting
    held their places, and fail-open answered RESOURCE_EXHAUSTED (issue 38)."""

    @pytest.mark.parametrize("mode", [FailureMode.OPEN, FailureMode.CLOSED, FailureMode.LOCAL])
    async def test_a_call_that_waited_with_no_answer_opens_it(
        self, tmp_path: Path, mode: FailureMode
    ) -> None:
        """A call waits STALLED with no answer from the store: the next call is answered by
        the failure mode at once, and so is the one waiting (its wait given up)."""
        clock = FakeClock()
        store = HungStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock, failure_mode=mode)
        assert await _ask(limiter) is Code.OK
        clock.advance(0.001)  # the waits below begin after the store's last answer
        store.hung = True
        waiting = await _started(limiter)
        clock.advance(PAST_STALLED)
        if mode is FailureMode.CLOSED:
            with pytest.raises(StoreUnavailable):
                await _ask(limiter)
            with pytest.raises(StoreUnavailable):
                await waiting
        else:
            assert await _ask(limiter) is Code.OK  # open, or this process's part (local)
            assert await waiting is Code.OK
        assert store.calls == 2  # the third call did not wait on the store
        assert not limiter.backend_healthy

    async def test_a_shorter_wait_leaves_it_closed(self, tmp_path: Path) -> None:
        """Waits shorter than STALLED, or with an answer since they began, ask the store."""
        clock = FakeClock()
        store = HungStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)
        store.hung = True
        waiting = await _started(limiter)
        clock.advance(STALLED / 2)
        second = await _started(limiter)
        assert store.calls == 2 and not waiting.done() and not second.done()
        store.release.set()
        assert {await waiting, await second} == {Code.OK}  # failed open, each on its own

    async def test_after_the_break_one_call_tries_the_store_at_a_time(
        self, tmp_path: Path
    ) -> None:
        """Past BREAK_SECONDS one call tries the still-stalled store; the others are
        answered at once until it gets an answer, which closes the breaker."""
        clock = FakeClock()
        store = HungStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)
        store.hung = True
        waiting = await _started(limiter)
        clock.advance(PAST_STALLED)
        assert await _ask(limiter) is Code.OK and await waiting is Code.OK
        clock.advance(BREAK_SECONDS)
        trying = await _started(limiter)
        assert store.calls == 2
        assert [await _ask(limiter) for _ in range(5)] == [Code.OK] * 5
        assert store.calls == 2 and not trying.done()
        store.hung = False
        store.release.set()  # the trying call fails; the store answers the next one
        assert await trying is Code.OK
        clock.advance(BREAK_SECONDS)
        assert await _ask(limiter) is Code.OK and store.calls == 3
        assert limiter.backend_healthy

    async def test_a_call_listening_before_a_trip_can_be_given_up(self, tmp_path: Path) -> None:
        """A call that finds a wait stalled listens for HEAR before it trips the breaker,
        holding its place in the call budget meanwhile: a full budget gives it up as it
        gives up a wait on the store, and the failure mode answers it at once, the store
        not asked. Before, the budget could not (CI: 32 calls in progress, none to give
        up, and a call under a stalled Redis refused RESOURCE_EXHAUSTED)."""
        clock = FakeClock()
        store = HungStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)
        assert await _ask(limiter) is Code.OK
        clock.advance(0.001)  # the wait below begins after the store's last answer
        store.hung = True
        waiting = await _started(limiter)
        clock.advance(PAST_STALLED)
        listening = await _started(limiter)
        assert store.calls == 2 and not listening.done()  # listening, the store not asked
        clock.advance(HEAR)
        assert limiter.policy.relieve({listening})
        assert await listening is Code.OK and store.calls == 2
        store.release.set()
        assert await waiting is Code.OK

    async def test_a_full_call_budget_gives_up_a_wait_on_a_stalled_store(
        self, tmp_path: Path
    ) -> None:
        """relieve (what a full gRPC call budget asks) answers by the failure mode the
        longest wait of the calls named, once the store has answered nothing for HEAR since
        it began. Left waiting: a call not named, a wait younger than HEAR, and a wait on a
        store that has answered since it began (a queue, soon served: giving it up at once,
        as a full budget did, answered calls of a mere burst by the failure mode)."""
        clock = FakeClock()
        store = HungStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)
        assert await _ask(limiter) is Code.OK  # the store's last answer
        clock.advance(0.001)
        store.hung = True
        first, second = await _started(limiter), await _started(limiter)
        relieve = limiter.policy.relieve
        assert not relieve({first, second})  # not HEAR yet
        clock.advance(HEAR)
        assert not relieve(set())
        assert relieve({first, second})
        assert await first is Code.OK and not second.done()
        limiter.policy.breaker.answered(clock.now())  # the store answers another call
        clock.advance(1.0)
        assert not relieve({second})
        store.release.set()
        assert await second is Code.OK


@pytest.mark.behaviour
class TestInProcessStore:
    """An in-process store is asked without a coroutine, under the same breaker and
    failure modes as any."""

    async def test_it_is_asked_without_a_coroutine(self, tmp_path: Path) -> None:
        clock = FakeClock()
        store = FailingNow(clock)
        assert store.admits_now() is not None  # the path under test here
        assert FlakyStore().admits_now() is None  # its own admit: awaited
