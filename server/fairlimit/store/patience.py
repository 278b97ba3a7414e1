"""A store call's timeout that blames the store only for the answers it did not give.

A timeout runs on the wall clock, but a process short of CPU (a loaded machine, or its own
event loop busy with other calls) reads the store's answers late: the timer fires in the
same loop iteration that reads an answer that came in time, before the call is handed it.
Such calls were answered by the failure mode and counted as backend errors with a healthy
Redis (issue 41: 378 to 1,571 in a run of bench/run.py), and their failures in a row opened
the breaker, which answered every call by the failure mode for a while.

So when a call's timeout passes, the store is blamed only if it has answered no call for
``limit`` seconds, the loop having run on time (a timer that fires late, the process held,
gives the store ``limit`` more: the call itself may have been sent late) and read what had
arrived (LISTEN iterations). A store that answers other calls is alive, only slower than
this process: a call bounded by the store's own timeout waits on, up to deadline.CEILING;
one bounded by its caller's deadline is shed at that deadline (DeadlineExceeded: the caller
has gone), not a backend failure. A stopped or cut-off Redis answers nothing, and is still
blamed at the timeout."""

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fairlimit.errors import DeadlineExceeded
from fairlimit.store import deadline

_T = TypeVar("_T")

# Loop iterations for what has arrived on a socket to reach its call: the iteration that
# reads it wakes the reader, which hands a pipeline's replies to their calls, which wake
# in the next; one more for a reply read in two parts.
LISTEN = 5


class Heard:
    """When the store last answered a call (the loop's clock)."""

    def __init__(self) -> None:
        self.at = -math.inf

    def since(self, instant: float) -> bool:
        """Whether the store has answered a call after ``instant``."""
        return self.at > instant


async def within(call: Callable[[], Awaitable[_T]], heard: Heard, default: float) -> _T:
    """The answer of the store call ``call()`` makes, noted in ``heard``; TimeoutError when
    the store did not answer in time (above), DeadlineExceeded when the caller's deadline
    passed while the store was answering others, or left it no time (deadline.timeout)."""
    limit = deadline.timeout(default)
    caller = deadline.DEADLINE.get() is not None
    shed = caller and limit < deadline.CEILING  # the caller's deadline bounds this call
    last = limit if caller else max(default, deadline.CEILING)
    loop = asyncio.get_running_loop()
    watch: _Watch | None = None
    try:
        async with asyncio.timeout(None) as bound:
            watch = _Watch(loop, bound, heard, limit, loop.time() + last)
            try:
                answer = await call()
            finally:
                watch.handle.cancel()
    except TimeoutError:
        if shed and watch is not None and watch.expired and not watch.blamed:
            raise DeadlineExceeded("the caller's deadline passed, the store not silent") from None
        raise
    heard.at = loop.time()
    return answer


class _Watch:
    """The timer of one call: when due it gives the call up, or lets it wait on."""

    def __init__(self, loop: asyncio.AbstractEventLoop, bound: asyncio.Timeout, heard: Heard,
                 limit: float, last: float) -> None:  # fmt: skip
        self.loop, self.bound, self.heard = loop, bound, heard
        self.limit, self.last = limit, last
        self.began = loop.time()
        self.expired = False
        self.blamed = True  # the store's silence, not this process's, timed the call out
        self.late = False  # the timer fired late: the process did not run
        self.due = min(self.began + limit, last)
        self.handle: asyncio.Handle = loop.call_at(self.due, self._check, 0)

    def _check(self, hops: int) -> None:
        """Due again ``limit`` later if the loop ran late (the process held: the store had
        no time it was heard in, nor perhaps the call itself, sent late), unless ``last``
        (the caller's deadline, or the most a call waits) has come. Else, once the loop
        has listened (an answer read meanwhile ends the call): due again ``limit`` later
        if the store has answered a call in the last ``limit`` and ``last`` has not come;
        else given up, the store blamed unless it answered since the call began or the
        loop ran late."""
        now = self.loop.time()
        final = self.due >= self.last
        if hops == 0:
            self.late = now - self.due > self.limit / 2
            if self.late and not final:
                self._again(now)
                return
        if hops < LISTEN:
            self.handle = self.loop.call_soon(self._check, hops + 1)
            return
        if not final and self.heard.since(self.due - self.limit):
            self._again(now)
            return
        self.blamed = not self.late and not self.heard.since(self.began)
        self.expired = True
        self.bound.reschedule(now)  # the call is cancelled: TimeoutError

    def _again(self, now: float) -> None:
        self.due = min(now + self.limit, self.last)
        self.handle = self.loop.call_at(self.due, self._check, 0)
