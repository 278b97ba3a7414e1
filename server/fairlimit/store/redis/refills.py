"""The block calls of a process's plan shapes, one at a time each, and who waits for them.

A request of a leased shape that no block serves takes the shape's next block call on: it
goes to the store, whose script call asks for a block (store/redis/leasing.py). The
shape's requests that come while that call is out wait for it; those its block cannot
serve (the block was sized by the shape's rate, not by them) do not each go to the store:
one of them takes the next call on, the others wait for it, and it asks for their hits
too. A request that waited for a call since before it was sent is admitted from its block
even past the block's end (core/lease.Leases.take): it came before the call's script ran.
So a burst of a shape's requests, or those at a window's turn (where every block has
ended), costs a call or two, not one each (issue 41).
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from fairlimit.core import lease
from fairlimit.core.admission import Outcome
from fairlimit.core.plan import Plan

Shape = tuple[str, ...]


@dataclass(eq=False, slots=True)
class Refill:
    """A block call of one shape, and the hits of the requests waiting for it."""

    done: asyncio.Future[None]
    owner: asyncio.Task[object] | None  # the request that makes the call
    early: int = 0  # hits of the requests waiting since before it was sent
    sent: bool = False
    answered: bool = False  # Redis answered it (a failed call leads nobody on)
    asked: int = 0  # the block's hits it asked for
    shared: bool = False  # sent asking for none: another shape charges its levels here
    block: lease.Block | None = None  # the block it was granted


class Refills:
    """The block call out (or about to be) of each shape of one process's ``leases``."""

    def __init__(self, leases: lease.Leases, caller_clock: bool) -> None:
        self._leases = leases
        self._caller_clock = caller_clock  # each request brings its own clock: no waiting
        self._out: dict[Shape, Refill] = {}

    def __bool__(self) -> bool:
        return bool(self._out)

    def take_on(self, shape: Shape) -> Refill:
        """The next block call of ``shape``, made by the current request."""
        refill = Refill(asyncio.get_running_loop().create_future(), asyncio.current_task())
        self._out[shape] = refill
        return refill

    def asking(self, plan: Plan, shape: Shape, base: float) -> tuple[Refill, bool, int]:
        """The block call of ``shape`` that ``plan``'s script call belongs to, whether it
        is this request's to make (else another is out: it asks for none), and the hits
        it asks for: about LEASE_SECONDS of the shape's demand (``Leases.want``) and those
        of the requests waiting for it."""
        refill = self._out.get(shape)
        if refill is None:
            refill = self.take_on(shape)
        if refill.owner is not asyncio.current_task() or refill.sent:
            return refill, False, 0
        refill.sent = True
        refill.shared = self._leases.shared(plan, shape, base)
        if not refill.shared:
            want = self._leases.want(plan, shape, base)
            refill.asked = min(self._leases.max_block, want + refill.early)
        return refill, True, refill.asked

    def settle(self, shape: Shape, refill: Refill) -> None:
        """``refill`` is over: its waiters go on."""
        if self._out.get(shape) is refill:
            del self._out[shape]
        if not refill.done.done():
            refill.done.set_result(None)

    def abandon(self, shape: Shape) -> None:
        """The call this request took on for ``shape`` and did not make (it was answered
        another way, or failed): its waiters go on without it."""
        refill = self._out.get(shape)
        if refill is not None and not refill.sent and refill.owner is asyncio.current_task():
            self.settle(shape, refill)

    async def wait(
        self, plan: Plan, shape: Shape, base: Callable[[], float], leasable: Callable[[], bool]
    ) -> Outcome | None:
        """``plan`` (no block serving it now) admitted from the block of the call it waits
        for, when one is out (``base()``: the consumer's clock then); else None, and it
        takes the next call on when ``leasable()`` (its keys in one slot)."""
        refill = self._out.get(shape)
        if refill is None:
            if leasable():
                self.take_on(shape)
            return None
        hits = plan.counters[0].hits
        while True:
            early = not refill.sent
            if early:
                refill.early += hits
            try:
                await asyncio.shield(refill.done)
            except asyncio.CancelledError:
                if not refill.sent:
                    refill.early -= hits
                raise
            # the block of a call this request waited for since before it was sent admits
            # it past its end (not on the caller's clock, which each request brings)
            waited = refill.block if early and not self._caller_clock else None
            local = self._leases.take(plan, shape, base(), waited)
            if local is not None:
                return local
            if not refill.answered or refill.shared or (refill.asked and refill.block is None):
                return None  # no block for the shape now: the exact path
            following = self._out.get(shape)
            if following is None:  # this request takes the next call on, for all left
                self.take_on(shape)
                await asyncio.sleep(0)  # those woken with it wait for it, from before
                return None
            refill = following
