"""The calls waiting on the store now, oldest first, and giving one of them up.

A store that stalls (a stopped Redis, a partition) holds each call for its timeout. The
limiter answers a call by its failure mode as soon as the store is known to be stalled,
and the gRPC call budget, when full, gives up the call that has waited longest with no
answer from the store since, so that a call waiting for a place gets it (grpc_api/guards.py):
the call given up is answered by the failure mode at once, as if its store call had failed.
Each gRPC call runs in its own task, so a call is its task here.
"""

import asyncio
from collections.abc import Awaitable, Collection
from typing import TypeVar

from fairlimit.errors import GivenUp

_T = TypeVar("_T")


class Waits:
    """Who waits on the store, since when (the limiter's clock)."""

    def __init__(self) -> None:
        self._since: dict[asyncio.Task[object], float] = {}  # oldest first
        self._given_up: set[asyncio.Task[object]] = set()

    def oldest(self) -> float | None:
        """When the longest wait began; None when no call waits."""
        return next(iter(self._since.values()), None)

    @property
    def busy(self) -> bool:
        return bool(self._since)

    async def wait(self, call: Awaitable[_T], now: float) -> _T:
        """``call``'s answer, noted as waited for since ``now``; GivenUp when give_up()
        picked this call (its store call is cancelled, as a timeout would)."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # driven without an event loop (bench/inproc.py): none to give up
            task = None
        if task is None:
            return await call
        self._since[task] = now
        try:
            return await call
        except asyncio.CancelledError:
            if task not in self._given_up:
                raise
            self._given_up.discard(task)
            task.uncancel()  # given up here, not cancelled: the call goes on to its answer
            raise GivenUp("the store did not answer in time (given up)") from None
        finally:
            del self._since[task]
            if task in self._given_up:  # the store call took the cancel and answered
                self._given_up.discard(task)
                task.uncancel()

    def give_up_all(self) -> None:
        """Give up every wait (the store is known to be stalled)."""
        for task in self._since:
            if task not in self._given_up:
                self._given_up.add(task)
                task.cancel()

    def give_up(
        self, among: Collection[asyncio.Task[object]], before: float, answered: float
    ) -> bool:
        """Give up the longest wait of one of ``among``'s calls, if it began at ``before``
        or earlier and after ``answered`` (when the store last answered); False when none
        did."""
        for task, since in self._since.items():
            if since > before:
                return False
            if since > answered and task in among and task not in self._given_up:
                self._given_up.add(task)
                task.cancel()
                return True
        return False
