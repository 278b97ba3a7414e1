"""In-process store: fixed-window counters and fair-share caps, idle state expires.

Every ``admit`` runs without awaiting, so on one event loop it is atomic by construction.
Expiry is driven by deadlines (store/deadlines.py), so memory stays bounded by the live
state. It runs in steps: a call looks at EXPIRE_STEP deadlines of each table at most, and
when more is due (a window of 200k clients ends at one instant) a background task on the
loop takes the rest in steps of the same size. What a step drops is not freed at once but
put in a pile, freed RELEASE_STEP at a time, in the order it was made, once nothing is
due: freed a step at a time between calls, the holes of every memory block would take the
calls' new objects and keep all the blocks (bench/expiry.py measured 21 MB of 32 kept per
100k keys that way, 2-4 freed in these few steps). Then the tables are compacted and the
memory handed back (a full collection, malloc_trim). No call waits for more than one step.
"""

import asyncio
import ctypes
import gc
import heapq
import math
from collections.abc import Callable, Mapping, Sequence

from fairlimit.core import sharing
from fairlimit.core.admission import Outcome, above, admits, demand_seen
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.fairshare import CapReport, FairnessFigures, figures_of
from fairlimit.core.plan import Counter, Plan, Share
from fairlimit.core.reserve import (
    Settle,
    Settled,
    Usage,
    levels,
    own_counter,
    record_key,
    settlement,
)
from fairlimit.core.sharing import (
    FORCES,
    STALE,
    Clock,
    Division,
    Light,
    Row,
    ShareClaim,
    Verdict,
    charge,
    contended,
    divide,
    enter,
    fold,
    last_period,
    leave,
    record,
    roll_light,
    same_window,
    schedule,
    stale_division,
    verdict,
)
from fairlimit.core.smooth import gcra_charged, gcra_count, part, sliding_full_at
from fairlimit.core.units import SLIDING_PARTS, Algorithm, bounds, window_start
from fairlimit.errors import ReservationOpen
from fairlimit.store.deadlines import Deadlines
from fairlimit.store.reservations import MemoryReservations
from fairlimit.store.slots import MemorySlots

_SHRINK = 4  # compact the counter table once it holds under a quarter of its high mark
EXPIRE_STEP = 512  # deadlines of each table a call, or one step of the sweep, looks at
RELEASE_STEP = 65_536  # expired objects freed at once (2 a counter: about 10 ms)
_OUTERMOST = (-1,)  # above() of a plan with one share
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD = 128 * 1024  # glibc's initial value


def _glibc(function: str) -> Callable[..., int] | None:
    """A glibc malloc function, or None where the C library is another (the process's own
    symbols, so no library search: ctypes.util alone would cost 2 MB)."""
    found: Callable[..., int] | None = getattr(ctypes.CDLL(None), function, None)
    return found


def _fix_mmap_threshold() -> None:
    """Keep glibc's mmap threshold where it starts.

    glibc raises it each time a mapped block is freed, so after one spike of clients the
    big tables of the next come from the heap, whose free middle it rarely gives back
    (bench/memory.py: 44 MB left after a second wave of 200k hour clients, 31 MB with this).
    """
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def trim_malloc() -> None:
    """glibc's malloc_trim(0): return free heap pages to the system."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


def _idle(window: int) -> float:
    """How long an untouched cap keeps its rows: two windows, and its history's periods."""
    return max(2 * window + 1, STALE * min(window, 1))


class _Counter:
    """A fixed window's count (epoch-aligned or a calendar one)."""

    __slots__ = ("count", "end", "reserved", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.count = 0
        self.reserved = 0  # hits of this window's reservations not settled (core/reserve.py)


class _Meter:
    """A sliding window's sub-window counts, or GCRA's theoretical arrival time
    (core/smooth.py); ``count`` is the count at the last ``look``."""

    __slots__ = ("count", "parts", "tat", "until")

    def __init__(self, sliding: bool) -> None:
        self.count = 0
        self.tat = 0.0
        self.until = 0.0  # when its state counts nothing any more (full_at, after a charge)
        # per sub-window slot: [index, hits]; SLIDING_PARTS + 1 slots cover a window's parts
        self.parts = [[-1, 0] for _ in range(SLIDING_PARTS + 1)] if sliding else []

    def look(self, spec: Counter, now: float) -> int:
        if not self.parts:
            self.count = gcra_count(spec, self.tat, now)
            return self.count
        newest = part(spec, now)
        self.count = sum(n for i, n in self.parts if newest - SLIDING_PARTS <= i <= newest)
        return self.count

    def add(self, spec: Counter, hits: int, now: float) -> None:
        if not self.parts:
            self.tat = gcra_charged(spec, self.tat, now, hits)
            return
        index = part(spec, now)
        slot = self.parts[index % (SLIDING_PARTS + 1)]
        if slot[0] != index:
            slot[0], slot[1] = index, 0
        slot[1] += hits

    def full_at(self, spec: Counter) -> float:
        """When nothing charged so far is counted any more (its state may go then)."""
        if not self.parts:
            return self.tat
        newest = max((i for i, n in self.parts if n > 0), default=-1)
        return 0.0 if newest < 0 else sliding_full_at(spec, newest)


class _Cap:
    """One cap instance: its client rows and its division (core/sharing.py)."""

    __slots__ = (
        *("capacity", "declared", "division", "figures", "last"),
        *("last_seen", "light", "period", "rows", "window"),
    )

    def __init__(self, share: Share) -> None:
        self.capacity = share.capacity
        self.window = share.window
        self.declared = share.declared
        self.rows: dict[str, Row] = {}
        self.division: Division | None = None
        self.light = Light()  # the light demand it holds room for (core/sharing.py)
        self.period = -1  # the period the figures were last rolled for
        self.figures: FairnessFigures | None = None
        self.last: tuple[list[Row], Clock] | None = None  # for the figures, until asked
        self.last_seen = 0.0

    def divided(self, clock: Clock, now: float) -> Division:
        """The division in force at ``clock``, remade when stale (core/sharing.py)."""
        if clock.period != self.period:
            self.period = clock.period
            # The figures are for telemetry only: worked out when caps() asks, not in the
            # request that rolls the period (at 100k clients they cost twice λ's time).
            self.figures, self.last = None, (list(self.rows.values()), clock)
            # A row is dropped once folding it would give a fresh one: its history gone
            # (STALE periods untouched) and its window neither this one nor the one before
            # (what it asked last window still predicts its demand; an hour cap's client
            # back after 64 s must not start its share afresh; admit.lua keeps rows as long
            # as the cap).
            stale, last = clock.period - STALE, clock.start - clock.window
            if any(row.period < stale and row.window < last for row in self.rows.values()):
                self.rows = {
                    c: r for c, r in self.rows.items() if r.period >= stale or r.window >= last
                }
        division = self.division
        if stale_division(division, clock):
            division = self.division = divide(
                self.rows.items(), self.capacity, clock, closing=self.closing(clock)
            )
        assert division is not None
        self.last_seen = now
        return division

    def closing(self, clock: Clock) -> float | None:
        """λ of the window before, when the division in force already knows it."""
        division = self.division
        return division.closing if division and same_window(division, clock) else None

    def row(self, share: Share, clock: Clock) -> Row:
        """The client's row, folded to ``clock``."""
        row = self.rows.get(share.client)
        if row is None:
            row = self.rows[share.client] = Row(share.client_limit, share.weight)
        row.limit, row.weight = share.client_limit, share.weight
        assert self.division is not None
        fold(row, clock, self.division.closing)
        return row

    def report_figures(self) -> FairnessFigures | None:
        """The last full period's fairness figures (computed on first ask)."""
        if self.last is not None:
            rows, clock = self.last
            period = last_period(rows, self.capacity, clock)
            self.figures = None if period is None else figures_of(period)
            self.last = None
        return self.figures

    @property
    def level(self) -> float | None:
        """λ of the division in force (None while nobody at the cap has any history)."""
        division = self.division
        return None if division is None or division.cold else division.level


def _claim(share: Share) -> ShareClaim:
    return ShareClaim(
        share.hits, share.client_limit, share.weight, share.capacity, share.declared, share.sized
    )


def _settle_row(row: Row, share: Share, at: float, now: float, hits: int) -> None:
    """Move a client's hits at a cap by ``hits`` (never below 0; settle.lua is the same):
    admitted where its row still counts the window and period of ``at`` (when they were
    charged), asked where it counts those of ``now``. So the demand the cap predicts from
    becomes the real cost as settlements come in, whenever the reservation was made."""
    if not hits:
        return
    if row.window == window_start(share.window, at):
        row.admitted = max(0.0, row.admitted + hits)
    if row.period == math.floor(at / share.period):
        row.period_admitted = max(0.0, row.period_admitted + hits)
    if row.window == window_start(share.window, now):
        row.asked = max(0.0, row.asked + hits)
    if row.period == math.floor(now / share.period):
        row.period_asked = max(0.0, row.period_asked + hits)


def _charge(counters: Sequence[_Counter | _Meter], plan: Plan, admitted: bool, now: float) -> None:
    for counter, spec in zip(counters, plan.counters, strict=True):
        if admitted or spec.force:
            if isinstance(counter, _Meter):
                counter.add(spec, spec.hits, now)
            else:
                counter.count += spec.hits


class MemoryStore:
    """The default backend: state in this process only.

    ``seed``: the count a counter starts a window at, by its key and the window's start
    (0 without one): the local store of ``--failure-mode local`` starts each counter at what
    the shared store last showed of it (policy/local.py).
    """

    def __init__(self, seed: Callable[[str, int], int] | None = None) -> None:
        self._seed = seed
        self._counters: dict[str, _Counter] = {}
        self._meters: dict[str, _Meter] = {}  # sliding and GCRA counters
        self._caps: dict[str, _Cap] = {}
        self._counter_deadlines = Deadlines()  # a window's counters end at one instant
        self._meter_deadlines = Deadlines(1.0)  # a meter is dropped up to a second late
        self._cap_deadlines: list[tuple[float, str]] = []
        self._high = 0  # the most counters held since the table was last compacted
        self._now = 0.0
        self._latest = 0.0  # the latest time a call came with: what the sweep expires to
        self._sweeping: asyncio.Task[None] | None = None
        self._dropped: list[object] = []  # what expired, until freed (see the docstring)
        self.slots = MemorySlots()  # concurrency pools (store/slots.py)
        self.reservations = MemoryReservations()  # token budgets (store/reservations.py)
        # RLQS demand by consumer (until, report): quota services sharing this store
        self._demand: dict[str, tuple[float, str]] = {}
        _fix_mmap_threshold()

    def __len__(self) -> int:
        """How many counters and caps are held (for tests and memory accounting)."""
        return len(self._counters) + len(self._meters) + len(self._caps)

    def _counter(self, key: str, window: int, now: float) -> _Counter:
        """The counter of the window at ``now``; a call from a window already closed here
        (it waited while a later call opened the next) counts in the later one, never
        replacing it: the later window's count would start again."""
        start = window_start(window, now)
        counter = self._counters.get(key)
        if counter is None or counter.start < start:
            counter = self._fresh(key, start, start + window)
        return counter

    def _fresh(self, key: str, start: int, end: int) -> _Counter:
        counter = _Counter(start, end)
        if self._seed is not None:
            counter.count = self._seed(key, start)
        self._counters[key] = counter
        self._counter_deadlines.push(end, key)
        return counter

    def _shaped(self, spec: Counter, now: float) -> _Counter | _Meter:
        """A calendar window's counter, or a sliding or GCRA meter, looked at ``now``."""
        shape = spec.shape
        assert shape is not None
        if shape.algorithm is Algorithm.FIXED:
            counter = self._counters.get(spec.key)
            if counter is None or counter.end <= now:  # an older window's call: as _counter
                counter = self._fresh(spec.key, *bounds(spec.window, shape, now))
            return counter
        meter = self._meters.get(spec.key)
        if meter is None:
            meter = self._meters[spec.key] = _Meter(shape.algorithm is Algorithm.SLIDING)
            self._meter_deadlines.push(now + spec.window, spec.key)
        meter.look(spec, now)
        return meter

    def _cap(self, share: Share) -> _Cap:
        cap = self._caps.get(share.cap)
        if cap is None:
            cap = _Cap(share)
            self._caps[share.cap] = cap
            idle = self._now + _idle(share.window)
            heapq.heappush(self._cap_deadlines, (idle, share.cap))
        return cap

    def _expire(self, now: float) -> None:
        """One step of expiry at ``now``, on the request path; the rest in the background.

        A counter, meter or cap past its deadline but not yet dropped is never used as if
        live (``_counter`` and ``_shaped`` start a new window; a reservation's own expiry is
        checked), so what a step leaves is memory only, never a count."""
        self._latest = max(self._latest, now)
        if self._step(now) or self._compact_due():
            self._sweep_soon()

    def _step(self, now: float) -> bool:
        """Drop what ended by ``now``, EXPIRE_STEP deadlines of each table at most; True
        when more is due."""
        more = self._expire_counters(now)
        more = self._expire_meters(now) or more
        more = self._expire_caps(now) or more
        return self.reservations.expire(now, EXPIRE_STEP, self._dropped) or more

    def _expire_counters(self, now: float) -> bool:
        deadlines, counters = self._counter_deadlines, self._counters
        if not deadlines.due(now):
            return False
        self._high = max(self._high, len(counters))
        dropped = self._dropped
        for key in deadlines.take(now, EXPIRE_STEP):
            counter = counters.get(key)
            if counter is not None and counter.end <= now:  # not a later window's
                del counters[key]
                dropped.append(counter)
                dropped.append(key)
        return deadlines.due(now)

    def _expire_meters(self, now: float) -> bool:
        """Drop the meters whose state counts nothing any more (each has one deadline)."""
        deadlines = self._meter_deadlines
        for key in deadlines.take(now, EXPIRE_STEP):
            meter = self._meters[key]
            if meter.until <= now:
                del self._meters[key]
                self._dropped.append(meter)
                self._dropped.append(key)
            else:
                deadlines.push(meter.until, key)
        return deadlines.due(now)

    def _expire_caps(self, now: float) -> bool:
        caps = self._cap_deadlines
        for _ in range(EXPIRE_STEP):
            if not caps or caps[0][0] > now:
                return False
            _, key = heapq.heappop(caps)
            cap = self._caps[key]  # each held cap has one deadline here, and only it
            idle_until = cap.last_seen + _idle(cap.window)
            if idle_until <= now:
                del self._caps[key]
            else:
                heapq.heappush(caps, (idle_until, key))
        return bool(caps) and caps[0][0] <= now

    def _compact_due(self) -> bool:
        return (
            bool(self._dropped)
            or len(self._counters) * _SHRINK < self._high
            or self.reservations.compact_due
        )

    def _sweep_soon(self) -> None:
        """Have the rest of the expiry, and the compaction, done in the background."""
        if self._sweeping is not None and not self._sweeping.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without a loop (bench/inproc.py): nobody waits
            self.sweep()
            return
        self._sweeping = loop.create_task(self._sweep_in_steps())

    async def _sweep_in_steps(self) -> None:
        # each step is EXPIRE_STEP deadlines per table: the calls that come meanwhile are
        # answered between two steps (sleep(0) lets every ready callback run first)
        while self._step(self._latest):
            await asyncio.sleep(0)
        dropped = self._dropped
        while len(dropped) > RELEASE_STEP:
            del dropped[:RELEASE_STEP]
            await asyncio.sleep(0)
        dropped.clear()
        if self._compact_due():
            await asyncio.sleep(0)
            self._shrink()

    def sweep(self) -> None:
        """Everything due at the latest time a call came with, at once, then the compaction
        (where no event loop runs: nothing is waiting)."""
        while self._step(self._latest):
            pass
        self._dropped.clear()
        if self._compact_due():
            self._shrink()

    async def swept(self) -> None:
        """Wait for a background sweep that is out (tests, benches)."""
        if self._sweeping is not None:
            await asyncio.shield(self._sweeping)

    def _shrink(self) -> None:
        """Give the memory of a spike of clients back, now that it is all free."""
        # Python keeps freed tuples and floats on free lists, and each one left in a block
        # of memory (a 1 MiB arena) keeps that whole block: a full collection empties the
        # lists, so the blocks the expired clients filled are released. This runs before
        # anything new is allocated (the expiry comes first in a request), so the next
        # objects go to blocks that stay anyway. Then the C allocator returns its free
        # pages, and a dict, which never gives back the table it grew to, is copied into
        # one of its live size. bench/memory.py measures the effect.
        gc.collect()
        trim_malloc()
        self._counters = dict(self._counters)
        self._high = len(self._counters)
        self.reservations.compact()

    async def admit(self, plan: Plan, now: float) -> Outcome:
        self._expire(now)
        self._now = now
        if plan.reserve:
            self._refuse_open(plan, now)
        shaped = any(c.shape is not None for c in plan.counters)
        if shaped:
            return self._admit_shaped(plan, now)
        counters = [self._counter(c.key, c.window, now) for c in plan.counters]
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
        counters = [
            self._counter(c.key, c.window, now) if c.shape is None else self._shaped(c, now)
            for c in plan.counters
        ]
        counts = tuple([c.count for c in counters])
        outcome = self._admit_shared(plan, now, counters, counts)
        full_at = [0.0] * len(counters)
        for i, (counter, spec) in enumerate(zip(counters, plan.counters, strict=True)):
            if isinstance(counter, _Meter):
                full_at[i] = counter.until = counter.full_at(spec)
        outcome.full_at = tuple(full_at)
        return outcome

    def _admit_shared(
        self,
        plan: Plan,
        now: float,
        counters: Sequence[_Counter | _Meter],
        counts: tuple[int, ...],
    ) -> Outcome:
        if not plan.shares:
            admitted = admits(plan, counts, (), ())
            _charge(counters, plan, admitted, now)
            return Outcome(admitted, counts, (), ())
        states = self._claims(plan, now)
        shared = tuple([int(row.admitted) for _, _, row, _ in states])
        verdicts: list[Verdict] = []
        # one cap: it is outermost (above() says so too, at the cost of two lists)
        parents: Sequence[int] = above(plan) if len(plan.shares) > 1 else _OUTERMOST
        for i, (division, claim, row, clock) in enumerate(states):
            s, parent = plan.shares[i], parents[i]
            claim.nested = i in parents  # a cap over clients of its own: it paces them
            if 0 <= parent < i:  # a nested cap divides what its parent gives it
                claim.capacity = min(claim.capacity, verdicts[parent].share)
            verdicts.append(verdict(row, division, claim, clock, counts[s.total]))
        bounds = tuple([v.bound for v in verdicts])
        admitted = admits(plan, counts, shared, bounds)
        # Admitted, every level admitted: every cap sees the request as demand.
        seen = [True] * len(states) if admitted else demand_seen(plan, counts, shared, bounds)
        for (division, _, row, clock), share, demand, v in zip(
            states, plan.shares, seen, verdicts, strict=True
        ):
            if demand:
                record(row, share.hits, now)
                if v.light and not division.cold:  # cold, everybody is new: nothing light
                    self._light(share, row, clock)
        # Refused, only the levels of charge_when_over_limit rules are charged (usage that
        # already happened); admitted, every level is.
        _charge(counters, plan, admitted, now)
        for (division, _, row, clock), share, v in zip(states, plan.shares, verdicts, strict=True):
            if admitted or share.force:
                charge(row, share.hits)
            enter(division, row, v.kind, clock)
        if admitted and plan.reserve:
            self._keep(plan, now)
        return Outcome(admitted, counts, shared, bounds)

    def _refuse_open(self, plan: Plan, now: float) -> None:
        """Raise ReservationOpen when a reservation's id still holds an open one: two
        requests by one id would settle each other's (admit.lua refuses them too)."""
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
                    counter = self._counters.get(spec.key)
                    if counter is not None and counter.start <= now < counter.end:
                        counter.reserved += reserve.hits

    async def settle(self, plan: Plan, settle: Settle, now: float) -> Settled:
        """Settle the reservation of ``settle.request_id`` at the levels of ``plan``'s one
        descriptor: give back the unused part in the windows it was reserved in, or charge
        the excess as debt now (settle.lua is the same rule for Redis)."""
        self._expire(now)
        own = own_counter(plan, 0)
        if own is None:
            return Settled(False)
        key = record_key(plan.counters[own].key, settle.request_id)
        record = self.reservations.settle(key, now)
        if record is None:
            return Settled(False)
        refund, debt = settlement(record.hits, settle.amount, settle.negative)
        mine = self._counters.get(plan.counters[own].key)
        if mine is not None and mine.start <= record.at < mine.end:
            mine.reserved -= min(record.hits, mine.reserved)
        counters, shares = levels(plan, 0)
        for i in counters:
            spec = plan.counters[i]
            if refund:
                counter = self._counters.get(spec.key)
                if counter is not None and counter.start == window_start(spec.window, record.at):
                    counter.count -= min(refund, counter.count)
            if debt:
                self._counter(spec.key, spec.window, now).count += debt
        for i in shares:
            share = plan.shares[i]
            cap = self._caps.get(share.cap)
            row = None if cap is None else cap.rows.get(share.client)
            if row is not None:
                _settle_row(row, share, record.at, now, -refund)
                _settle_row(row, share, now, now, debt)
        return Settled(True, refund, debt)

    async def usage(self, plan: Plan, now: float) -> Usage:
        own = own_counter(plan, 0)
        counter = None if own is None else self._counters.get(plan.counters[own].key)
        if counter is None or not counter.start <= now < counter.end:
            return Usage(0, 0)
        return Usage(counter.count, counter.reserved)

    def _claims(self, plan: Plan, now: float) -> list[tuple[Division, ShareClaim, Row, Clock]]:
        """Each share's cap division with the client's row taken out of it
        (core/sharing.py). A request that finds a cap newly contended remakes its division
        with itself counted; the shares of that cap claimed before it leave the new one."""
        states: list[tuple[Division, ShareClaim, Row, Clock]] = []
        for share in plan.shares:
            cap, period = self._cap(share), share.period  # a property: read once
            clock = Clock(share.window, period, now)
            division = cap.divided(clock, now)
            row = cap.row(share, clock)
            claim = _claim(share)
            leave(division, row, share.client, share.window, period)
            if contended(division, row, claim, clock):
                extra = max(share.hits, 1)
                closing, forced = cap.closing(clock), division.forced + 1
                if division.epoch // FORCES != clock.epoch:
                    forced = 1  # the division in force was made in an earlier sub-period
                remade = divide(
                    cap.rows.items(), cap.capacity, clock, share.client, extra, closing, forced
                )
                cap.division, row.epoch = remade, remade.epoch
                for k, (before, c, r, t) in enumerate(states):
                    if before is division:
                        s = plan.shares[k]
                        leave(remade, r, s.client, s.window, s.period)
                        remade.asks += max(s.hits, 1)
                        states[k] = (remade, c, r, t)
                division = remade
            division.asks += max(share.hits, 1)
            states.append((division, claim, row, clock))
        for (division, claim, _, clock), share in zip(states, plan.shares, strict=True):
            light = self._caps[share.cap].light
            if light.window != clock.start:
                expected = light.calendar.pop(clock.start, 0.0)
                for at in [at for at in light.calendar if at < clock.start]:
                    del light.calendar[at]  # windows nobody asked in
                roll_light(light, clock, expected)
            claim.reserve = sharing.reserve(light, division, clock)
        return states

    def _light(self, share: Share, row: Row, clock: Clock) -> None:
        """Count a light request at its cap, and expect the client back (core/sharing.py)."""
        light = self._caps[share.cap].light
        light.asked += share.hits
        at = schedule(row, clock)
        if at >= 0:
            light.calendar[at] = light.calendar.get(at, 0.0) + share.hits

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
        return {
            key: CapReport(key, cap.level, cap.declared, cap.report_figures())
            for key, cap in self._caps.items()
        }

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        if self._sweeping is not None:
            self._sweeping.cancel()
        self._dropped.clear()
        self._counters.clear()
        self._caps.clear()
        self._counter_deadlines.clear()
        self._meter_deadlines.clear()
        self._cap_deadlines.clear()
        self.slots.clear()
        self.reservations.clear()
