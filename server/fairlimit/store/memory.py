"""In-process store: fixed-window counters and fair-share caps, idle state expires.

Every ``admit`` runs without awaiting, so on one event loop it is atomic by construction.
The state is kept by concept: counters and meters (store/counters.py), fair-share caps
(store/caps.py), concurrency pools (store/slots.py) and token budgets
(store/reservations.py); this module runs the admission rule over them (core/admission.py,
the rule Redis's admit script, store/redis/lua/admit/, runs too). Expiry runs in steps, and
the memory it frees is handed back (store/sweep.py).
"""

from collections.abc import Callable, Mapping, Sequence

from fairlimit.core.admission import Outcome, admits
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.fairshare import CapReport
from fairlimit.core.plan import Plan
from fairlimit.core.reserve import (
    Settle,
    Settled,
    Usage,
    levels,
    own_counter,
    record_key,
    settlement,
)
from fairlimit.core.units import window_start
from fairlimit.errors import ReservationOpen
from fairlimit.store.capped import admit_many, admit_one
from fairlimit.store.caps import MemoryCaps
from fairlimit.store.counters import MemoryCounter, MemoryCounters, MemoryMeter
from fairlimit.store.counters import charge as charge_counters
from fairlimit.store.deadlines import Due
from fairlimit.store.reservations import MemoryReservations
from fairlimit.store.slots import MemorySlots
from fairlimit.store.sweep import EXPIRE_STEP, Sweep, fix_mmap_threshold


class MemoryStore:
    """The default backend: state in this process only.

    ``seed``: the count a counter starts a window at, by its key and the window's start
    (0 without one): the local store of ``--failure-mode local`` starts each counter at what
    the shared store last showed of it (policy/local.py).
    """

    # a plan with one share (most under a cap): admit_many's steps without its lists
    one_share = staticmethod(admit_one)

    def __init__(self, seed: Callable[[str, int], int] | None = None) -> None:
        self._due = due = Due()  # the earliest a table has something due: one look a call
        self.counters = MemoryCounters(seed, due)  # counters and meters (store/counters.py)
        self.fair = MemoryCaps(due)  # fair-share caps (store/caps.py)
        self.slots = MemorySlots()  # concurrency pools (store/slots.py)
        self.reservations = MemoryReservations(due=due)  # token budgets (store/reservations.py)
        # RLQS demand by consumer (until, report): quota services sharing this store
        self._demand: dict[str, tuple[float, str]] = {}
        self._sweep = Sweep(self._step, self._compact_due, self._compact, due)
        fix_mmap_threshold()

    def __len__(self) -> int:
        """How many counters and caps are held (for tests and memory accounting)."""
        return len(self.counters) + len(self.fair)

    def expire(self, now: float) -> None:
        """One step of expiry at ``now``, on the request path; the rest in the background
        (store/sweep.py).

        A counter, meter or cap past its deadline but not yet dropped is never used as if
        live (``counter`` and ``shaped`` start a new window; a reservation's own expiry is
        checked), so what a step leaves is memory only, never a count."""
        self._sweep.expire(now)

    def _step(self, now: float) -> bool:
        """Drop what ended by ``now``, EXPIRE_STEP deadlines of each table at most; True
        when more is due."""
        dropped = self._sweep.dropped
        more = self.counters.expire(now, EXPIRE_STEP, dropped)
        more = self.fair.expire(now, EXPIRE_STEP) or more
        more = self.reservations.expire(now, EXPIRE_STEP, dropped) or more
        self._due.at = min(self.counters.first(), self.fair.first(), self.reservations.first())
        return more

    def _compact_due(self) -> bool:
        return self.counters.compact_due or self.reservations.compact_due

    def _compact(self) -> None:
        self.counters.compact()
        self.reservations.compact()

    def sweep(self) -> None:
        """Everything due at the latest time a call came with, at once, then the compaction
        (where no event loop runs: nothing is waiting)."""
        self._sweep.sweep()

    async def swept(self) -> None:
        """Wait for a background sweep that is out (tests, benches)."""
        await self._sweep.swept()

    def admits_now(self) -> Callable[[Plan, float], Outcome] | None:
        """``admit`` as a plain function, for a caller that would only await it
        (policy/guarded.py): it never waits. None when a subclass answers ``admit`` its
        own way (the tests' faulty stores), which is then to be awaited."""
        return self.admit_now if type(self).admit is MemoryStore.admit else None

    async def admit(self, plan: Plan, now: float) -> Outcome:
        return self.admit_now(plan, now)

    def admit_now(self, plan: Plan, now: float) -> Outcome:
        """``admit``, without a coroutine (it never waits)."""
        self.expire(now)
        if plan.reserve:
            self._refuse_open(plan, now)
        for c in plan.counters:  # any() of a generator, without one (every request)
            if c.shape is not None:
                return self._admit_shaped(plan, now)
        counters = [self.counters.counter(c.key, c.window, now) for c in plan.counters]
        counts = tuple([c.count for c in counters])
        if not plan.shares:
            admitted = admits(plan, counts, (), ())
            for counter, spec in zip(counters, plan.counters, strict=True):
                if admitted or spec.force:
                    counter.count += spec.hits
            if admitted and plan.reserve:
                self._keep(plan, now)
            return Outcome(admitted, counts, (), ())
        return self._admit_shared(plan, now, counters, counts)

    def _admit_shaped(self, plan: Plan, now: float) -> Outcome:
        """A plan with calendar, sliding or GCRA counters: as any, then when each is full."""
        table = self.counters
        counters = [
            table.counter(c.key, c.window, now) if c.shape is None else table.shaped(c, now)
            for c in plan.counters
        ]
        counts = tuple([c.count for c in counters])
        outcome = self._admit_shared(plan, now, counters, counts)
        full_at = [0.0] * len(counters)
        for i, (counter, spec) in enumerate(zip(counters, plan.counters, strict=True)):
            if isinstance(counter, MemoryMeter):
                full_at[i] = counter.until = counter.full_at(spec)
        outcome.full_at = tuple(full_at)
        return outcome

    def _admit_shared(
        self,
        plan: Plan,
        now: float,
        counters: Sequence[MemoryCounter | MemoryMeter],
        counts: tuple[int, ...],
    ) -> Outcome:
        if not plan.shares:
            admitted = admits(plan, counts, (), ())
            charge_counters(counters, plan, admitted, now)
            outcome = Outcome(admitted, counts, (), ())
        elif len(plan.shares) == 1:
            outcome = self.one_share(self.fair, plan, now, counters, counts)
        else:
            outcome = admit_many(self.fair, plan, now, counters, counts)
        # kept whatever the plan counts besides (a sliding, GCRA or calendar limit too)
        if outcome.admitted and plan.reserve:
            self._keep(plan, now)
        return outcome

    def _refuse_open(self, plan: Plan, now: float) -> None:
        """Raise ReservationOpen when a reservation's id still holds an open one: two
        requests by one id would settle each other's (the admit script refuses them too)."""
        for reserve in plan.reserve:
            own = own_counter(plan, reserve.descriptor)
            if own is not None:
                key = record_key(plan.counters[own].key, reserve.request_id)
                if self.reservations.is_open(key, now):
                    raise ReservationOpen(f"request id {reserve.request_id!r} is reserving")

    def _keep(self, plan: Plan, now: float) -> None:
        """Keep the reservations of an admitted plan (core/reserve.py)."""
        for reserve in plan.reserve:
            own = own_counter(plan, reserve.descriptor)
            if own is not None:
                spec = plan.counters[own]
                key = record_key(spec.key, reserve.request_id)
                if self.reservations.keep(key, reserve.hits, now, reserve.ttl):
                    counter = self.counters.table.get(spec.key)
                    if counter is not None and counter.start <= now < counter.end:
                        counter.reserved += reserve.hits

    async def settle(self, plan: Plan, settle: Settle, now: float) -> Settled:
        """Settle the reservation of ``settle.request_id`` at the levels of ``plan``'s one
        descriptor: give back the unused part in the windows it was reserved in, or charge
        the excess as debt now (settle.lua is the same rule for Redis)."""
        self.expire(now)
        own = own_counter(plan, 0)
        if own is None:
            return Settled(False)
        key = record_key(plan.counters[own].key, settle.request_id)
        record = self.reservations.settle(key, now)
        if record is None:
            return Settled(False)
        refund, debt = settlement(record.hits, settle.amount, settle.negative)
        mine = self.counters.table.get(plan.counters[own].key)
        if mine is not None and mine.start <= record.at < mine.end:
            mine.reserved -= min(record.hits, mine.reserved)
        counters, shares = levels(plan, 0)
        for i in counters:
            spec = plan.counters[i]
            if refund:
                counter = self.counters.table.get(spec.key)
                if counter is not None and counter.start == window_start(spec.window, record.at):
                    counter.count -= min(refund, counter.count)
            if debt:
                self.counters.counter(spec.key, spec.window, now).count += debt
        self.fair.settle(plan, shares, record.at, now, refund, debt)
        return Settled(True, refund, debt)

    async def usage(self, plan: Plan, now: float) -> Usage:
        own = own_counter(plan, 0)
        counter = None if own is None else self.counters.table.get(plan.counters[own].key)
        if counter is None or not counter.start <= now < counter.end:
            return Usage(0, 0)
        return Usage(counter.count, counter.reserved)

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        return self.slots.acquire(claims, now)

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        return self.slots.release(claims, now)

    async def exchange_demand(
        self, consumer: str, report: str, now: float, ttl: float
    ) -> Mapping[str, str]:
        self._demand[consumer] = (now + ttl, report)
        gone = [c for c, (until, _) in self._demand.items() if until <= now]
        for c in gone:
            del self._demand[c]
        return {c: text for c, (_, text) in self._demand.items() if c != consumer}

    async def caps(self) -> Mapping[str, CapReport]:
        return self.fair.reports()

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._sweep.close()
        self.counters.clear()
        self.fair.clear()
        self.slots.clear()
        self.reservations.clear()
