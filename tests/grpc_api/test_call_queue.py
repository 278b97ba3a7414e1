"""A full call budget: calls beyond it wait for a place (grpc_api/guards.py, Pool).

Before, each call beyond --grpc-max-concurrent took at once the place of the call that had
waited longest for its message. On a loaded machine the event loop starts calls faster than
it reads their messages, so a burst ended calls that had sent theirs RESOURCE_EXHAUSTED,
and Envoy let those requests through (CI: 7 of 200 on a fresh Envoy; `python
bench/grpc_burst.py --starve 6` has the figures). Here the pool and the reader run on a real event
loop; a call's message arrives when the test delivers it.
"""

import asyncio
from collections.abc import Callable

import pytest

from fairlimit.grpc_api import guards

pytestmark = pytest.mark.behaviour

LONG = 60.0  # a read deadline, or a stalled age, that never passes in a test


class Call:
    """The side of a gRPC call the reader sees: its message comes when ``deliver`` is
    called (never, if it is not)."""

    def __init__(self) -> None:
        self.message: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def read(self) -> bytes:
        return await self.message

    def deliver(self) -> None:
        self.message.set_result(b"request")


async def serve(pool: guards.Pool, reader: guards.Reader, call: Call, hold: asyncio.Event) -> str:
    """A call as the servicer serves it: a place, its message, then its work (until
    ``hold`` is set); how it ended."""
    if not pool.admit() and not await pool.wait_for_place():
        return "busy"
    try:
        await reader.first(call, pool, asyncio.current_task())  # type: ignore[arg-type]
        await hold.wait()
        return "served"
    except guards.TooSlow as slow:
        return slow.why
    finally:
        pool.leave()


async def settle() -> None:
    """Let every task that can run do so."""
    for _ in range(10):
        await asyncio.sleep(0)


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, "not within the time"
        await asyncio.sleep(0.005)


async def ended(task: "asyncio.Task[str]") -> str:
    """How ``task`` ended, within 5 s (a call that never ends fails the test)."""
    return await asyncio.wait_for(task, 5)


def start(
    pool: guards.Pool, reader: guards.Reader, calls: list[Call], hold: asyncio.Event
) -> list["asyncio.Task[str]"]:
    return [asyncio.create_task(serve(pool, reader, call, hold)) for call in calls]


async def one_then_another(
    pool: guards.Pool, reader: guards.Reader, hold: asyncio.Event, first: Call, then: Call
) -> tuple["asyncio.Task[str]", "asyncio.Task[str]"]:
    """``first`` takes the place of a budget of 1, then ``then`` comes: their tasks."""
    held = start(pool, reader, [first], hold)[0]
    await settle()
    return held, start(pool, reader, [then], hold)[0]


class TestBurst:
    async def test_calls_started_faster_than_their_messages_are_read_are_all_served(
        self,
    ) -> None:
        """40 calls start before any message is read (a busy loop), under a budget of 4:
        4 take places, 36 wait, none is ended; once the messages are in, all are served,
        never more than 4 at once. Before, each call past the 4th ended the oldest one
        still waiting for its message: 36 RESOURCE_EXHAUSTED."""
        pool, reader, hold = guards.Pool("rls", 4, "calls"), guards.Reader(LONG), asyncio.Event()
        calls = [Call() for _ in range(40)]
        tasks = start(pool, reader, calls, hold)
        await settle()
        assert (pool.busy, len(pool.queue)) == (4, 36)
        most = 0
        for call in calls:
            call.deliver()
        hold.set()
        for _ in range(10_000):  # bounded: a call that never ends fails below
            if all(task.done() for task in tasks):
                break
            most = max(most, pool.busy)
            await asyncio.sleep(0)
        assert [task.result() for task in tasks] == ["served"] * 40
        assert most <= 4 and pool.busy == 0 and not pool.queue

    async def test_calls_get_places_in_the_order_they_came(self) -> None:
        """A budget of 1 held by a call at work; 5 more wait. Each takes the place, and
        reads its message, once the one before has ended: first come, first served."""
        pool, reader = guards.Pool("rls", 1, "calls"), guards.Reader(LONG)
        holds = [asyncio.Event() for _ in range(6)]
        read: list[int] = []
        calls = [Reading(i, read) for i in range(6)]
        tasks = [
            asyncio.create_task(serve(pool, reader, call, hold))
            for call, hold in zip(calls, holds, strict=True)
        ]
        await settle()
        for i in range(6):
            assert read == list(range(i + 1)) and pool.busy == 1
            holds[i].set()
            await until(lambda i=i: tasks[i].done())
            await settle()
        assert [task.result() for task in tasks] == ["served"] * 6


class Reading(Call):
    """A call whose message is in, that notes its number in ``read`` when it is read."""

    def __init__(self, number: int, read: list[int]) -> None:
        super().__init__()
        self.number, self.read_by = number, read
        self.deliver()

    async def read(self) -> bytes:
        self.read_by.append(self.number)
        return await super().read()


class TestStalledCalls:
    async def test_a_real_call_after_a_flood_of_stalled_ones_is_served_first(self) -> None:
        """A budget of 2, then 10 calls that never send their message (2 in places, 8
        waiting), then a real call: once the stalled calls in places have waited the
        stalled age (0.05 s), they give their places up, and the waiting calls are then
        that old, so the newest, the real one, takes a place first and is served; the
        stalled calls it passed are still waiting."""
        pool = guards.Pool("rls", 2, "calls", stalled=0.05)
        reader, hold = guards.Reader(LONG), asyncio.Event()
        hold.set()
        flood = start(pool, reader, [Call() for _ in range(10)], hold)
        await settle()
        assert (pool.busy, len(pool.queue)) == (2, 8)
        real = Call()
        real.deliver()
        served = start(pool, reader, [real], hold)[0]
        assert await ended(served) == "served"
        assert [task.result() for task in flood[:2]] == ["evicted"] * 2
        assert sum(not task.done() for task in flood) == 8  # 2 in places, 6 waiting
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        assert pool.busy == 0 and not pool.queue

    async def test_a_call_without_its_message_gives_its_place_once_stalled(self) -> None:
        """A budget of 1 held by a call that never sends its message: a new call waits, and
        takes the place once the first has waited the stalled age (here 0.05 s), not
        before; the first ends evicted."""
        pool = guards.Pool("rls", 1, "calls", stalled=0.05)
        reader, hold = guards.Reader(LONG), asyncio.Event()
        stalled, waiting = Call(), Call()
        waiting.deliver()
        hold.set()
        loop = asyncio.get_running_loop()
        began = loop.time()
        first, second = await one_then_another(pool, reader, hold, stalled, waiting)
        await settle()
        assert len(pool.queue) == 1 and not first.done()
        assert await ended(second) == "served"
        assert loop.time() - began >= 0.05
        assert await ended(first) == "evicted"

    async def test_a_call_waiting_on_the_store_is_relieved_once_stalled(self) -> None:
        """A full budget asks its relief (the servicer's: give up a wait on a stalled store,
        tests/policy/test_breaker.py) while a call waits for a place, again and again; the
        place it frees goes to the waiting call."""
        pool = guards.Pool("rls", 1, "calls", stalled=LONG)
        reader, hold = guards.Reader(LONG), asyncio.Event()
        asked: list[None] = []

        def relieve() -> bool:
            asked.append(None)
            if len(asked) < 3:
                return False
            hold.set()  # the store wait given up: that call ends
            return True

        pool.relieve = relieve
        working, waiting = Call(), Call()
        working.deliver()
        waiting.deliver()
        tasks = await one_then_another(pool, reader, hold, working, waiting)
        assert [await ended(task) for task in tasks] == ["served", "served"]
        assert len(asked) == 3
        assert pool.busy == 0


class TestBounds:
    async def test_a_call_is_refused_when_the_queue_is_full(self) -> None:
        """A budget of 1 and 2 places in the queue, all taken: a fourth call is refused at
        once (busy); the others are served."""
        pool = guards.Pool("rls", 1, "calls", queued=2, stalled=LONG)
        reader, hold = guards.Reader(LONG), asyncio.Event()
        calls = [Call() for _ in range(4)]
        for call in calls:
            call.deliver()
        tasks = start(pool, reader, calls[:3], hold)
        await settle()
        assert len(pool.queue) == 2
        fourth = start(pool, reader, calls[3:], hold)[0]
        assert await ended(fourth) == "busy"
        hold.set()
        assert [await ended(task) for task in tasks] == ["served"] * 3

    async def test_the_default_queue_is_a_multiple_of_the_budget_and_rlqs_has_none(
        self,
    ) -> None:
        assert guards.Pool("rls", 32, "calls").queued == 32 * guards.QUEUED_PER_PLACE
        assert guards.Pool("rlqs", 64, "streams", queued=0).queued == 0

    async def test_a_call_waits_for_a_place_no_longer_than_the_read_deadline(self) -> None:
        """A budget of 1 held by a call at work: a new call waits, and ends busy once it
        has waited the read deadline (0.2 s), found by the reader's sweep."""
        pool = guards.Pool("rls", 1, "calls", stalled=LONG)
        reader, hold = guards.Reader(0.2), asyncio.Event()
        reader.pools = [pool]
        sweep = asyncio.create_task(reader.sweep())
        try:
            working, waiting = Call(), Call()
            working.deliver()
            waiting.deliver()
            loop = asyncio.get_running_loop()
            began = loop.time()
            first, second = await one_then_another(pool, reader, hold, working, waiting)
            assert await ended(second) == "busy"
            assert loop.time() - began >= 0.2
            assert not first.done() and pool.busy == 1 and not pool.queue
            hold.set()
            assert await ended(first) == "served"
        finally:
            sweep.cancel()

    async def test_a_call_that_ends_while_waiting_leaves_no_trace(self) -> None:
        """A waiting call cancelled (its deadline, its client gone) leaves the queue; the
        place later freed is not lost, and the budget ends empty."""
        pool, reader, hold = guards.Pool("rls", 1, "calls"), guards.Reader(LONG), asyncio.Event()
        calls = [Call() for _ in range(3)]
        for call in calls:
            call.deliver()
        first, second, third = start(pool, reader, calls, hold)
        await settle()
        second.cancel()
        await settle()
        assert second.cancelled() and len(pool.queue) == 1
        hold.set()
        assert (await ended(first), await ended(third)) == ("served", "served")
        assert pool.busy == 0 and not pool.queue

    async def test_a_call_cancelled_as_it_is_handed_a_place_gives_it_on(self) -> None:
        """The place handed to a waiting call that is cancelled before it runs goes to the
        next waiting call."""
        pool = guards.Pool("rls", 1, "calls")
        assert pool.admit()  # a call holds the place
        first = asyncio.create_task(pool.wait_for_place())
        second = asyncio.create_task(pool.wait_for_place())
        await settle()
        assert len(pool.queue) == 2
        pool.leave()  # the holder ends: the place is handed to the first waiting call,
        first.cancel()  # which is cancelled before it runs
        await settle()
        assert first.cancelled()
        assert second.done() and second.result() is True
        assert pool.busy == 1 and not pool.queue
        pool.leave()
        assert pool.busy == 0
