"""The failure policy: a Store around the store, with one failure behaviour for every call.

A flow calls it as it would the store, and never asks how the store is doing. A call the
store fails, or does not answer in time, or that the breaker keeps from it (policy/breaker.py)
is counted, and answered by the failure mode:

- ``closed``: StoreUnavailable is raised (the gRPC layer answers UNAVAILABLE);
- ``open``: an answer of the store's own type marked ``Unanswered`` (policy/answers.py): an
  admit let through, an acquire that holds nothing, a settlement that settles nothing;
- ``local``: admits and acquires are decided by this process's part of the limits
  (policy/alone.py), settlements as under ``open``.

Releases never fail a call: one the store cannot take is logged, and the slots expire after
their rule's max_duration. A call whose caller's deadline has passed, or leaves the store no
time, is shed (``shed``): answered by the failure mode at once, and counted. ``usage`` and
``exchange_demand`` are reports, not decisions: the store's error is their caller's.

An in-process store's admit (store/memory.py) never waits: the policy asks it without a
coroutine (``_admit_now``), under the same breaker and failure mode, and notes no wait (a
call that never suspends can be neither stalled nor given up).
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TypeVar

from fairlimit.core.admission import Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome, taken
from fairlimit.core.fairshare import CapReport
from fairlimit.core.plan import Plan
from fairlimit.core.reserve import Settle, Settled, Usage
from fairlimit.errors import DeadlineExceeded, GivenUp, StoreUnavailable
from fairlimit.policy.alone import Alone
from fairlimit.policy.answers import Unheld, Unlimited, Unsettled
from fairlimit.policy.breaker import HEAR, Breaker
from fairlimit.policy.local import LocalLimits
from fairlimit.settings import FailureMode
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from fairlimit.store.replicas import Replicas
from fairlimit.store.waits import Waits
from fairlimit.telemetry import Telemetry

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class FailurePolicy:
    """``store`` under a failure mode: the Store protocol, answered whatever the store does."""

    def __init__(
        self,
        store: Store,
        mode: FailureMode,
        now: Callable[[], float],
        telemetry: Telemetry,
        replicas: Replicas | None = None,
    ) -> None:
        self.store = store
        self.mode = mode
        self._now = now
        self._telemetry = telemetry
        self.healthy = True
        self.breaker = Breaker()
        self.waits = Waits()  # the calls waiting on the store (a full call budget gives one up)
        self.alone: Alone | None = None  # --failure-mode local: the limits of this process
        if mode is FailureMode.LOCAL:
            local = LocalLimits(replicas or Replicas())
            self.alone = Alone(local, store, now, telemetry, self._state)
        # the store's admit without a coroutine, when it never waits (and not alone)
        admit = store.admits_now() if isinstance(store, MemoryStore) else None
        self._admit_now = None if self.alone is not None else admit

    @property
    def local(self) -> LocalLimits | None:
        """The local limits under ``--failure-mode local``, else None."""
        return None if self.alone is None else self.alone.local

    @property
    def steady(self) -> bool:
        """Whether a store's answer changes nothing here (else ``_state`` notes it): no
        failure counted, not tripped, healthy. The one-step paths decide only then."""
        breaker = self.breaker
        return not (breaker.failures or breaker.tripped or not self.healthy)

    @property
    def admits_now(self) -> Callable[[Plan, float], Outcome] | None:
        """``admit`` as a plain function, when the store never waits (a flow calls it
        without a coroutine); None when ``admit`` is to be awaited."""
        return None if self._admit_now is None else self._admitted_now

    async def admit(self, plan: Plan, now: float) -> Outcome:
        if self._admit_now is not None:
            return self._admitted_now(plan, now)
        alone = self.alone
        if alone is not None:
            return await alone.admit(plan, now, lambda: self._call(self.store.admit(plan, now)))
        outcome = await self._call(self.store.admit(plan, now))
        return Unlimited(True, (), (), ()) if outcome is None else outcome

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        held = await self._call(self.store.acquire(claims, now))
        if held is not None:
            return held
        if self.alone is not None:
            return await self.alone.acquire(claims)
        return Unheld(True, (), ())

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        """Give slots back (those taken alone too); one the store cannot take back is logged,
        and given back by its expiry: nothing is counted as given."""
        local = self.local
        if local is not None:
            await local.release(claims, now)  # those taken alone, if any
        try:
            return await self.waits.wait(self.store.release(claims, now), now)
        except StoreUnavailable as exc:
            self._state(exc)
            log.warning("slots not released (they expire after max_duration): %s", exc)
            return tuple(False for _ in taken(claims))

    async def settle(self, plan: Plan, settle: Settle, now: float) -> Settled:
        """A settlement; a store that is down leaves the reservation as charged."""
        settled = await self._call(self.store.settle(plan, settle, now))
        return Unsettled(False) if settled is None else settled

    async def usage(self, plan: Plan, now: float) -> Usage:
        return await self.store.usage(plan, now)

    async def exchange_demand(
        self, consumer: str, report: str, now: float, ttl: float
    ) -> Mapping[str, str]:
        return await self.store.exchange_demand(consumer, report, now, ttl)

    async def caps(self) -> Mapping[str, CapReport]:
        """The store's caps; a failure is counted, and raised."""
        try:
            return await self.store.caps()
        except StoreUnavailable as exc:
            self._state(exc)
            raise

    async def ping(self) -> None:
        """Return when the store answers (a success closes the breaker); raise
        StoreUnavailable, counted, when it does not."""
        try:
            await self.store.ping()
        except StoreUnavailable as exc:
            self._state(exc)
            raise
        self._state(None)

    async def close(self) -> None:
        """Let a write-back that is out finish (for at most a second). The store it wraps
        is closed by its owner (the app), which may share it (quota/)."""
        if self.alone is not None:
            await self.alone.close()

    def relieve(self, among: Collection[asyncio.Task[object]]) -> bool:
        """Give up the longest wait on the store of one of ``among``'s calls if the store has
        answered nothing since it began, HEAR seconds or more ago: a stalled store's (a full
        gRPC call budget asks, grpc_api/guards.py). A wait on a store that answers others is
        a queue, soon served: giving it up at once, as a full budget did, answers calls by
        the failure mode under a mere burst; waiting 0.25 s instead kept deadline-bound
        callers behind a stopped Redis (``python bench/hung_redis.py``: OK 48% against
        60-86%, issue 41's stop)."""
        before = self._now() - HEAR
        return self.waits.give_up(among, before, self.breaker.answered_at)

    def shed(self) -> None:
        """A call past (or too near) its caller's deadline: counted; raised when closed."""
        self._telemetry.shed()
        if self.mode is FailureMode.CLOSED:
            raise DeadlineExceeded("the call's deadline passed before it could be decided")

    async def watch(self) -> None:
        """While this process limits alone: ping the store (so that it comes back as soon as
        the store does, traffic or not), and drop the local state when that is due."""
        alone = self.alone
        if alone is None or not alone.local.active:
            return
        if alone.local.returned_at is None:
            with contextlib.suppress(StoreUnavailable):  # counted: still alone
                await self.ping()
        else:
            alone.end_if_due(self._now())

    async def _call(self, call: Awaitable[_T]) -> _T | None:
        """A store call's answer; None when the store is down and the failure mode is not
        closed. StoreUnavailable (GivenUp included) is counted and, under ``closed``,
        raised; a deadline error is raised as it is. While the breaker is open the store is
        not called: the answer is the failure mode's at once."""
        skip = await self._skip()
        if skip is not None:
            if hasattr(call, "close"):
                call.close()  # never awaited: the store is not asked
            self._failed(StoreUnavailable(f"backend unavailable ({skip})"), False)
            return None
        try:
            answer = await self.waits.wait(call, self._now())
        except DeadlineExceeded:
            raise  # a StoreUnavailable too, but shed, not a backend failure
        except StoreUnavailable as exc:
            if not isinstance(exc, GivenUp) and self.breaker.trips(self._now()):
                await self._listen()  # answers heard meanwhile reset the count
            self._failed(exc, True)
            return None
        breaker = self.breaker
        breaker.answered_at = self._now()
        if not self.steady:
            self._state(None)
        return answer

    async def _skip(self) -> str | None:
        """Why the store is not to be asked now, or None (breaker.py): a wait that seems to
        have stalled trips the breaker only if no answer comes while the loop listens."""
        breaker, waits = self.breaker, self.waits
        now = self._now()
        skip = breaker.skip(now, waits)
        if skip is not None or breaker.stalled(now, waits) is None:
            return skip
        if not await self._listen():
            return "given up while the backend seemed stalled"
        now = self._now()
        skip = breaker.skip(now, waits)  # another call's may have opened it meanwhile
        oldest = breaker.stalled(now, waits)
        return breaker.stall(now, waits, oldest) if skip is None and oldest is not None else skip

    async def _listen(self) -> bool:
        """Let the loop run for HEAR, as a wait on the store: a full call budget may give
        it up as it gives up any (a call listening holds its place like one waiting; the
        budget found 32 listening and none to give up, and refused a call under a stalled
        Redis). False when given up."""
        try:
            await self.waits.wait(asyncio.sleep(HEAR), self._now())
        except GivenUp:
            return False
        return True

    def _admitted_now(self, plan: Plan, now: float) -> Outcome:
        """The in-process store's admit (it never waits) under the policy, as ``_call``
        would: the breaker first, a failure counted (raised when closed), the answer noted
        as given when it was asked (nothing waited in between)."""
        admit = self._admit_now
        assert admit is not None
        at = self._now()
        skip = self.breaker.skip(at, self.waits)  # its admit never waits: it cannot stall
        if skip is not None:
            self._failed(StoreUnavailable(f"backend unavailable ({skip})"), False)
            return Unlimited(True, (), (), ())
        try:
            outcome = admit(plan, now)
        except DeadlineExceeded:
            raise
        except StoreUnavailable as exc:
            self._failed(exc, True)
            return Unlimited(True, (), (), ())
        breaker = self.breaker
        breaker.answered_at = at
        if not self.steady:
            self._state(None)
        return outcome

    def _failed(self, exc: StoreUnavailable, asked: bool) -> None:
        """A store call that failed (``asked``) or was not made: counted; raised when
        closed."""
        self._state(exc, asked)
        if self.mode is FailureMode.CLOSED:
            raise exc

    def _state(self, error: StoreUnavailable | None, asked: bool = True) -> None:
        """Count a failed store call; log each healthy <-> unavailable transition once.

        Every answer the store gives (calls, readiness pings, the fairness refresh) moves
        the breaker: a success closes it, a failure of a call it was asked counts towards
        opening it. A call the open breaker answered (not ``asked``) counts as an error but
        does not hold it open."""
        alone = self.alone
        if error is None:
            self.breaker.answered(self._now())
            if alone is not None and alone.local.active:
                alone.back()
        else:
            self._telemetry.backend_error()
            if alone is not None:
                alone.local.returned_at = None  # away again: alone, without the store
            if asked:
                self.breaker.failed(self._now())
        if (error is None) == self.healthy:
            return
        self.healthy = error is None
        if error is None:
            log.info("backend healthy again")
        else:
            log.error("backend unavailable: %s", error or type(error).__name__)
            if alone is not None:
                alone.begun()
