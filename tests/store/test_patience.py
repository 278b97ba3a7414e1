"""A store call's timeout blames the store only for its silence (store/patience.py, issue 41).

The store here is a future the test answers, and ``Heard`` is what the store's other calls
would note: each test states what the store did, and the answer ``within`` gives."""

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from fairlimit.errors import DeadlineExceeded
from fairlimit.store import deadline
from fairlimit.store.patience import Heard, within

pytestmark = pytest.mark.unit

TIMEOUT = 0.01  # the store's own timeout (``?timeout=``)


@pytest.fixture
async def answering() -> AsyncIterator[Heard]:
    """A store answering other calls every millisecond meanwhile."""
    heard = Heard()
    loop = asyncio.get_running_loop()

    async def others() -> None:
        while True:
            heard.at = loop.time()
            await asyncio.sleep(0.001)

    task = asyncio.create_task(others())
    yield heard
    task.cancel()


async def _answered_after(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "answer"


async def _never() -> str:
    await asyncio.Event().wait()
    return "never"


class TestWithin:
    async def test_a_call_waits_on_while_the_store_answers_others(
        self, answering: Heard
    ) -> None:
        """Past its timeout, a call whose store answers other calls gets its own answer."""
        call = within(lambda: _answered_after(5 * TIMEOUT), answering, TIMEOUT)
        assert await asyncio.wait_for(call, 5) == "answer"

    async def test_a_silent_store_is_blamed(self) -> None:
        """A store that answers nothing: TimeoutError (a backend failure)."""
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(within(_never, Heard(), TIMEOUT), 5)

    async def test_past_the_callers_deadline_the_call_is_shed(self, answering: Heard) -> None:
        """A call bounded by its caller's deadline is given up at it; the store answering
        others, it is shed (DeadlineExceeded), not a backend failure."""
        token = deadline.DEADLINE.set(time.monotonic() + 5 * TIMEOUT)
        try:
            with pytest.raises(DeadlineExceeded):
                await asyncio.wait_for(within(_never, answering, 1.0), 5)
        finally:
            deadline.DEADLINE.reset(token)

    async def test_past_the_callers_deadline_a_silent_store_is_blamed(self) -> None:
        token = deadline.DEADLINE.set(time.monotonic() + 5 * TIMEOUT)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(within(_never, Heard(), 1.0), 5)
        finally:
            deadline.DEADLINE.reset(token)

    async def test_an_answer_is_noted(self) -> None:
        heard = Heard()
        assert await within(lambda: _answered_after(0), heard, TIMEOUT) == "answer"
        assert heard.since(asyncio.get_running_loop().time() - 1)
