"""This process's lease blocks and the refused hits on their way, for the Redis store.

With leases (on by default; ``?leases=off``) the exact call of a plan in one slot group may
also reserve a lease block for this process (core/lease.py states the rule); the plan's
next requests are then admitted here from it, with no Redis call. One call that may take a
block is out per plan shape at a time; the shape's requests that no block serves meanwhile
wait for it, and when its block cannot serve them all, one of them makes the next call for
the others, asking for their hits: a burst, or the requests at a window's turn (where every
block has ended), costs a call or two, not one each (issue 41). Unused blocks go back
when they expire (at the plan's next request, or at the sweep every LEASE_TTL) and on
close. A refusal the over-limit cache answers here owes its forced counters' hits
(charge_when_over_limit): they are counted at the sweep, before the plan's next script
call, and on close (core/owed.py). Both go back with release.lua (the store's undo).
"""

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.crc import key_slot

from fairlimit.core import lease, owed
from fairlimit.core.admission import Outcome
from fairlimit.core.plan import Counter, Plan
from fairlimit.store.redis.client import Options, unavailable
from fairlimit.store.redis.keys import SlotGroup, slot_groups
from fairlimit.store.redis.overlimit_cache import OverLimitCache
from fairlimit.store.redis.refills import Refills, Shape
from fairlimit.store.redis.replies import Combined, combine
from fairlimit.store.redis.script import Seen

log = logging.getLogger(__name__)

# The store's calls: the admit script of one slot group (asking for a block), a plan's
# admission (for the hits a block cannot cover), release.lua of (plan, group, clock, block)
Run = Callable[[Plan, SlotGroup, str, tuple[str, int]], Awaitable[Seen]]
Admit = Callable[[Plan, str, Shape | None, float], Awaitable[Combined]]
Undo = Callable[[Sequence[tuple[Plan, SlotGroup, str, int | None]], str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Granted:
    """What a lease block needs to be given back: the plan, its keys, the grant's clock."""

    plan: Plan
    group: SlotGroup
    at: str


class Leasing:
    """The blocks this process holds, the refused hits it owes, and their way back."""

    def __init__(self, options: Options, cluster: bool, known: OverLimitCache,
                 run: Run, admit: Admit, undo: Undo) -> None:  # fmt: skip
        self._options = options
        self._cluster = cluster
        self._known = known
        self._run, self._admit, self._undo = run, admit, undo
        self._caller_clock = options.clock == "caller"
        # On a Cluster, leases serve the plans whose keys sit in one slot (a descriptor's
        # do); a request across slots keeps the exact two-phase path.
        self.leases = lease.Leases(
            uuid.uuid4().hex[:12],
            margin=0.0 if self._caller_clock else lease.MARGIN,
            max_block=options.lease_max,
        )
        self.owed = owed.Owed()  # refused hits on their way
        self.offset = 0.0  # the store's clock minus the consumer's, at the last script call
        self.last = 0.0  # the consumer's clock at the last request (the caller's, to close)
        self._refills = Refills(self.leases, self._caller_clock)  # block calls out
        self._sweep_at = -math.inf  # when expired blocks are next given back
        self._sweeping: asyncio.Future[None] | None = None  # a give-back out

    def base(self, now: float) -> float:
        """The clock blocks expire by: the caller's when it is injected, else monotonic."""
        return now if self._caller_clock else time.monotonic()

    async def first(
        self, plan: Plan, now: float, base: float
    ) -> tuple[Outcome | None, Shape | None, float]:
        """``plan`` admitted from a block when it can be; else the shape of its block (None
        when it takes none) and the clock then, the sweep done."""
        shape = None
        try:
            if not plan.reserve and lease.eligible(plan):
                shape = lease.shape(plan)  # a block first: the over-limit cache may predate it
                local = await self._from_block(plan, shape, now, base)
                if local is not None:
                    self._known.admitted(plan)
                    return local, shape, base
                base = self.base(now)
            await self._sweep(base)
        except BaseException:  # cancelled (its deadline), or the sweep failed
            if shape is not None:
                self.abandon(shape)  # the block call it may have taken on
            raise
        return None, shape, base

    def refused(self, plan: Plan, shape: Shape | None, base: float) -> None:
        """A refusal the over-limit cache answered: its forced counters' hits, later."""
        if any(c.force for c in plan.counters):
            self.owed.add(plan, base + self.offset)
            self._known.charge(plan)
            self.leases.note(plan, shape or lease.shape(plan), base)

    async def pay_before(self, plan: Plan, base: float) -> None:
        """The refused hits owed at ``plan``'s counters, counted before its script call."""
        if self.owed.debts:
            at = base + self.offset
            await self._aside(self._pay(self.owed.take(at, plan), at))

    def called(self, plan: Plan, shape: Shape | None, base: float, clock: float | None) -> None:
        """After ``plan``'s script call (``clock``: the store's then, when it told)."""
        self.leases.note(plan, shape or lease.shape(plan), base)
        if clock is not None:
            self.offset = clock - base

    async def exact(self, plan: Plan, at: str, shape: Shape | None, base: float) -> Combined:
        """The script call of ``plan``: for the hits its block of ``shape`` cannot cover,
        when it holds some still (core/lease.Leases.rest)."""
        # unused hits of blocks of this plan's levels must not count against it: a block
        # that went stale, and those of other shapes
        key = shape or lease.shape(plan)
        stale = self.leases.stale(key)
        back = self.leases.others(plan, key) + ([stale] if stale is not None else [])
        if back:
            await self._aside(self._give_back(back))
        rest = self.leases.rest(plan, shape, base) if shape is not None else None
        if rest is None:
            with unavailable():
                return await self._admit(plan, at, shape, base)
        assert shape is not None
        block, hits = rest
        charged = False
        try:
            with unavailable():
                combined = await self._admit(lease.smaller(plan, hits), at, shape, base)
            # refused, a forced counter (charge_when_over_limit) counts the block's hits
            # as the refusal's: the exact path would have charged them there
            charged = combined.outcome.admitted or any(c.force for c in plan.counters)
        finally:
            if not charged and not self.leases.restore(shape, block, hits):
                await self._aside(self._give_back([block]))
        combined.outcome = lease.mine(combined.outcome, hits)
        return combined

    async def leased(self, plan: Plan, g: SlotGroup, now: str, shape: Shape, base: float
                     ) -> Combined:  # fmt: skip
        """The exact call of a plan that may be leased, asking for a block of its shape
        unless another call for the shape is out asking (core/lease.py; for the requests
        waiting for it too, store/redis/refills.py)."""
        refill, taking, asked = self._refills.asking(plan, shape, base)
        old = None
        try:
            seen = await self._run(plan, g, now, (self.leases.consumer, asked))
            combined = combine(plan, [g], [seen], seen.admitted)
            if seen.block > 0:
                ref = _Granted(plan, g, repr(seen.now))
                reply = None if self._caller_clock else time.monotonic()
                old = self.leases.keep(plan, shape, combined.outcome, seen.block, ref, base,
                                       reply)  # fmt: skip
            if taking:
                refill.answered = True
                refill.block = self.leases.blocks.get(shape) if seen.block > 0 else None
        finally:
            if taking:
                self._refills.settle(shape, refill)
        if old is not None:
            await self._aside(self._give_back([old]))
        return combined

    def abandon(self, shape: Shape) -> None:
        """The block call of ``shape`` this request took on and did not make: its waiters
        go on without it."""
        self._refills.abandon(shape)

    async def _sweep(self, base: float) -> None:
        """Give back the expired blocks' unused hits and count the refused hits owed, every
        LEASE_TTL; a request that comes while that is out waits for it (else it could be
        refused for hits on their way back, and its refusal cached)."""
        if self._sweeping is not None:
            await asyncio.shield(self._sweeping)
            return
        if base < self._sweep_at:
            return
        self._sweep_at = base + lease.LEASE_TTL
        expired = self.leases.expired(base)
        debts = self.owed.take(base + self.offset)
        if not expired and not debts:
            return
        done = self._sweeping = asyncio.get_running_loop().create_future()
        try:
            await self._aside(self._give_back(expired), self._pay(debts, base + self.offset))
        finally:
            self._sweeping = None
            done.set_result(None)

    async def _from_block(self, plan: Plan, shape: Shape, now: float, base: float
                          ) -> Outcome | None:  # fmt: skip
        """``plan`` admitted from this process's block of its shape, or from the block of
        the shape's call out when it waits for it (one such call at a time: concurrent
        requests each taking a block would reserve the levels many times over); else
        None, and it may take the next call on (store/redis/refills.py)."""
        local = self.leases.take(plan, shape, base)
        if local is not None:
            return local
        return await self._refills.wait(plan, shape, lambda: self.base(now),
                                        lambda: self._leasable(plan))  # fmt: skip

    def _leasable(self, plan: Plan) -> bool:
        """Whether ``plan``'s script call may take a block: its keys in one slot."""
        if not self._cluster:
            return True
        return len(slot_groups(plan, self._options.key_prefix, True)) == 1

    async def _give_back(self, blocks: Sequence[lease.Block]) -> None:
        """Return the unused hits of ``blocks`` to every level they were reserved at, demand
        included (release.lua; best effort: a block not given back is under-admission until
        its window ends)."""
        undo: list[tuple[Plan, SlotGroup, str, int | None]] = []
        for block in blocks:
            ref = block.ref
            assert isinstance(ref, _Granted)
            undo.append((ref.plan, ref.group, ref.at, block.room))
        await self._undo(undo, "an unused lease block was not given back")
        for plan, _, _, _ in undo:
            self._known.forget(plan)  # the counts it showed are lower now

    async def _aside(self, *calls: Awaitable[None]) -> None:
        """Blocks given back and refused hits counted, on a request's way, within the
        store's own ``timeout`` rather than the request's deadline: a stalled Redis must
        not hold the request (and those waiting on a sweep) past theirs, so that the
        failure mode still answers them (best effort, as each call is)."""
        try:
            async with asyncio.timeout(self._options.timeout):
                await asyncio.gather(*calls)
        except TimeoutError:
            log.warning("redis: lease blocks not given back or refused hits not counted in time")

    async def _pay(self, debts: Sequence[owed.Debt], at: float) -> None:
        """Count the refused hits of ``debts`` (of windows current at ``at``, store clock)
        at their counters, one release.lua call per slot (its hits negative: added; best
        effort, as a give-back)."""
        if not debts:
            return
        counters: list[Counter] = []
        by_slot: dict[int, SlotGroup] = {}
        prefix = self._options.key_prefix
        for debt in debts:
            c = debt.counter
            (g,) = [g for g in slot_groups(debt.plan, prefix, self._cluster)
                    if debt.index in g.counters]  # fmt: skip
            name = g.counter_keys[g.counters.index(debt.index)]
            group = by_slot.setdefault(key_slot(name.encode()) if self._cluster else 0,
                                       SlotGroup())  # fmt: skip
            group.counters.append(len(counters))
            group.counter_keys.append(name)
            counters.append(Counter(c.key, c.limit, c.window, -debt.hits, False, False, c.shape))
        plan = Plan((), tuple(counters), ())
        undo = [(plan, g, repr(at), None) for g in by_slot.values()]
        await self._undo(undo, "refused hits were not counted")

    async def close(self) -> None:
        """The refused hits owed counted, and every unused block given back."""
        try:
            async with asyncio.timeout(max(self._options.timeout, 1.0)):
                at = (self.last if self._caller_clock else time.monotonic()) + self.offset
                await self._pay(self.owed.take(at), at)
                await self._give_back(self.leases.unused())
        except TimeoutError:
            log.warning("redis: unused lease blocks not given back in time")
