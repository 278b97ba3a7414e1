"""RedisStore: one atomic admit script call per slot group, λ per cap by lock, a local
over-limit cache in front.

Requests spanning several slots (descriptors under different caps, on Redis Cluster only)
are admitted in two phases so that a rejected request still consumes nothing: every slot
group runs the admit script in parallel and charges itself only if it admits (a
reservation); when any group rejects or fails, the groups that charged run release.lua,
which decrements exactly what they added. The residual race: between reservation and
release (one round trip) other requests see the reserved hits and may be rejected although
the request that held them is finally refused - never over-admitted. If the release
itself fails, the reserved hits stay charged until their window ends.

With leases (on by default; ``?leases=off``) the exact call of a plan in one slot group may
also reserve a lease block for this process (core/lease.py states the rule); the plan's
next requests are then admitted here from it, with no Redis call. Unused blocks go back
when they expire (at the plan's next request, or at the sweep every LEASE_TTL) and on
close. A refusal the over-limit cache answers here owes its forced counters' hits
(charge_when_over_limit): they are counted at the sweep, before the plan's next script
call, and on close (core/owed.py).
"""

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot

from fairlimit.core import lease, owed
from fairlimit.core.admission import Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.fairshare import CapReport
from fairlimit.core.plan import Counter, Plan
from fairlimit.core.reserve import Settle, Settled, Usage, own_counter
from fairlimit.core.units import Algorithm, bounds
from fairlimit.errors import ReservationOpen, StoreUnavailable
from fairlimit.store import deadline
from fairlimit.store.redis import reservations, script
from fairlimit.store.redis.batch import ScriptBatcher
from fairlimit.store.redis.client import Options, unavailable
from fairlimit.store.redis.divisions import Divisions
from fairlimit.store.redis.keys import SlotGroup, slot_groups
from fairlimit.store.redis.overlimit_cache import OverLimitCache
from fairlimit.store.redis.registry import CapRegistry
from fairlimit.store.redis.script import (
    ADMIT,
    NEED_LEVEL,
    RELEASE,
    RESERVATION_OPEN,
    GivenDivision,
    Seen,
)
from fairlimit.store.redis.slots import RedisSlots, clock_base

log = logging.getLogger(__name__)

_ATTEMPTS = 3  # a division due, one a request forces, then no more locking


@dataclass(slots=True)
class _Combined:
    """A plan's replies put together: the outcome and what the cache and registry need."""

    outcome: Outcome
    counter_left: list[float]  # seconds until each counter's window ends (store clock)
    rolled: list[str]  # meta keys of caps whose division was written


@dataclass(frozen=True, slots=True)
class _Granted:
    """What a lease block needs to be given back: the plan, its keys, the grant's clock."""

    plan: Plan
    group: SlotGroup
    at: str


def _combine(
    plan: Plan, groups: Sequence[SlotGroup], seen: Sequence[Seen], admitted: bool
) -> _Combined:
    n, k = len(plan.counters), len(plan.shares)
    counts, counter_left, full_at = [0] * n, [0.0] * n, [0.0] * n
    shared, claimed = [0] * k, [0.0] * k
    rolled: list[str] = []
    for g, s in zip(groups, seen, strict=True):
        for pos, i in enumerate(g.counters):
            c = plan.counters[i]
            counts[i] = s.counts[pos]
            # a charge is taken back (release.lua) when another group refused the request
            full_at[i] = (s.full_at if admitted or c.force else s.full_before)[pos]
            # a sliding or GCRA count falls with time alone: the over-limit cache keeps none
            if c.shape is None or c.shape.algorithm is Algorithm.FIXED:
                counter_left[i] = bounds(c.window, c.shape, s.now)[1] - s.now
        for pos, i in enumerate(g.shares):
            shared[i], claimed[i] = s.shared[pos], s.bounds[pos]
        rolled.extend(g.cap_keys[j]["meta"] for j in s.rolled)
    clock = seen[0].now if seen else None  # Redis TIME: resets agree across replicas
    outcome = Outcome(admitted, tuple(counts), tuple(shared), tuple(claimed), clock)
    if any(c.shape is not None for c in plan.counters):
        outcome.full_at = tuple(full_at)
    return _Combined(outcome, counter_left, rolled)


class RedisStore:
    """Counters and caps in Redis, shared by every replica pointed at it."""

    def __init__(
        self, client: "aioredis.Redis | RedisCluster", options: Options, *, cluster: bool = False
    ) -> None:
        self._client = client
        self._options = options
        self._cluster = cluster
        self._scripts = script.register(client)
        # One pipeline for the calls of many requests (batch.py); a Cluster's calls go one
        # by one, each to its own slot's node.
        self._batch = (
            ScriptBatcher(client, max(options.timeout, deadline.CEILING))
            if isinstance(client, aioredis.Redis)
            else None
        )
        leasing = options.leases == "on"
        self._known = OverLimitCache(
            options.local_cache, 2 * lease.LEASE_TTL if leasing else math.inf
        )
        # On a Cluster, leases serve the plans whose keys sit in one slot (a descriptor's
        # do); a request across slots keeps the exact two-phase path.
        self._leases = (
            None
            if not leasing
            else lease.Leases(
                uuid.uuid4().hex[:12],
                margin=0.0 if options.clock == "caller" else lease.MARGIN,
                max_block=options.lease_max,
            )
        )
        self._owed = owed.Owed() if leasing else None  # refused hits on their way
        self._offset = 0.0  # the store's clock minus the consumer's, at the last script call
        self._last = 0.0  # the consumer's clock at the last request (the caller's, to close)
        self._refills: dict[tuple[str, ...], asyncio.Future[None]] = {}  # block calls out
        self._sweep_at = -math.inf  # when expired blocks are next given back
        self._sweeping: asyncio.Future[None] | None = None  # a give-back out
        self.round_trips = 0  # script calls made (tests, the README's numbers)
        self._slots = RedisSlots(client, options.key_prefix, cluster, self._call)
        self._registry = CapRegistry(client, options.key_prefix, options.timeout)
        self._divisions = Divisions(client, options, self._scripts, self._call)

    @property
    def _caller_clock(self) -> bool:
        return self._options.clock == "caller"

    async def admit(self, plan: Plan, now: float) -> Outcome:
        base = self._last = self._base(now)
        shape = None
        if self._leases is not None:
            if not plan.reserve and lease.eligible(plan):
                shape = lease.shape(plan)  # a block first: the over-limit cache may predate it
                local = await self._from_block(plan, shape, now, base)
                if local is not None:
                    return local
                base = self._base(now)
            await self._sweep(base)
        owing = self._owed if not plan.reserve else None
        local = self._known.answer(plan, base, travel=owing is not None)
        if local is not None:
            if owing is not None and any(c.force for c in plan.counters):
                owing.add(plan, base + self._offset)  # its forced counters' hits, later
                self._known.charge(plan)
                assert self._leases is not None
                self._leases.note(plan, shape or lease.shape(plan), base)
            return local
        if owing is not None and owing.debts:
            at = base + self._offset
            await self._aside(self._pay(owing.take(at, plan), at))  # counted before it
        combined = await self._exact(plan, now, shape, base)
        if self._leases is not None:
            self._leases.note(plan, shape or lease.shape(plan), base)
        if combined.outcome.now is not None:
            self._offset = combined.outcome.now - base
        self._known.learn(plan, combined.outcome, combined, base)
        if combined.rolled:
            self._registry.register(combined.rolled)
        return combined.outcome

    async def _exact(self, plan: Plan, now: float, shape: tuple[str, ...] | None, base: float
                     ) -> _Combined:  # fmt: skip
        """The script call of ``plan``: for the hits its block of ``shape`` cannot cover,
        when it holds some still (core/lease.Leases.rest)."""
        at = repr(now) if self._caller_clock else ""
        rest = None
        if self._leases is not None:
            # unused hits of blocks of this plan's levels must not count against it: a
            # block that went stale, and those of other shapes
            key = shape or lease.shape(plan)
            stale = self._leases.stale(key)
            back = self._leases.others(plan, key) + ([stale] if stale is not None else [])
            if back:
                await self._aside(self._give_back(back))
        if shape is not None:
            assert self._leases is not None
            rest = self._leases.rest(plan, shape, base)
        if rest is None:
            with unavailable():
                return await self._admit(plan, at, shape, base)
        assert self._leases is not None and shape is not None
        block, hits = rest
        charged = False
        try:
            with unavailable():
                combined = await self._admit(lease.smaller(plan, hits), at, shape, base)
            # refused, a forced counter (charge_when_over_limit) counts the block's hits
            # as the refusal's: the exact path would have charged them there
            charged = combined.outcome.admitted or any(c.force for c in plan.counters)
        finally:
            if not charged and not self._leases.restore(shape, block, hits):
                await self._aside(self._give_back([block]))
        combined.outcome = lease.mine(combined.outcome, hits)
        return combined

    async def _sweep(self, base: float) -> None:
        """Give back the expired blocks' unused hits and count the refused hits owed, every
        LEASE_TTL; a request that comes while that is out waits for it (else it could be
        refused for hits on their way back, and its refusal cached)."""
        if self._sweeping is not None:
            await asyncio.shield(self._sweeping)
            return
        if base < self._sweep_at:
            return
        assert self._leases is not None and self._owed is not None
        self._sweep_at = base + lease.LEASE_TTL
        expired = self._leases.expired(base)
        debts = self._owed.take(base + self._offset)
        if not expired and not debts:
            return
        done = self._sweeping = asyncio.get_running_loop().create_future()
        try:
            await self._aside(self._give_back(expired), self._pay(debts, base + self._offset))
        finally:
            self._sweeping = None
            done.set_result(None)

    def _base(self, now: float) -> float:
        """The clock blocks expire by: the caller's when it is injected, else monotonic."""
        return now if self._caller_clock else time.monotonic()

    async def _from_block(self, plan: Plan, shape: tuple[str, ...], now: float, base: float
                          ) -> Outcome | None:  # fmt: skip
        """``plan`` admitted from this process's block of its shape; when a call that takes
        a block for the shape is out, after it returns (one such call at a time: concurrent
        requests each taking a block would reserve the levels many times over)."""
        assert self._leases is not None
        local = self._leases.take(plan, shape, base)
        if local is not None:
            return local
        pending = self._refills.get(shape)
        if pending is None:
            return None
        await asyncio.shield(pending)
        return self._leases.take(plan, shape, self._base(now))

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        at = repr(now) if self._caller_clock else ""
        with unavailable():
            return await self._slots.acquire(claims, at, clock_base(self._caller_clock, now))

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        with unavailable():
            return await self._slots.release(claims, repr(now) if self._caller_clock else "")

    async def _admit(
        self, plan: Plan, now: str, shape: tuple[str, ...] | None = None, base: float = 0.0
    ) -> _Combined:
        groups = slot_groups(plan, self._options.key_prefix, self._cluster)
        if len(groups) == 1 and shape is not None:
            return await self._leased(plan, groups[0], now, shape, base)
        if len(groups) == 1:
            only = await self._run(plan, groups[0], now)
            return _combine(plan, groups, [only], only.admitted)
        results = await asyncio.gather(
            *(self._run(plan, g, now) for g in groups), return_exceptions=True
        )
        seen = [r for r in results if isinstance(r, Seen)]
        failed = [r for r in results if isinstance(r, BaseException)]
        admitted = not failed and all(s.admitted for s in seen)
        if not admitted:
            charged = [(g, r) for g, r in zip(groups, results, strict=True)
                       if isinstance(r, Seen) and r.admitted]  # fmt: skip
            await self._release(plan, charged)
            if plan.reserve and charged:
                await self._drop_records(plan, [g for g, _ in charged])
        if failed:
            raise failed[0]
        return _combine(plan, groups, seen, admitted)

    async def _leased(
        self, plan: Plan, g: SlotGroup, now: str, shape: tuple[str, ...], base: float
    ) -> _Combined:
        """The exact call of a plan that may be leased, asking for a block of its shape
        unless another call for the shape is out asking (core/lease.py)."""
        assert self._leases is not None
        taking = shape not in self._refills
        if taking:
            self._refills[shape] = asyncio.get_running_loop().create_future()
        try:
            want = self._leases.want(plan, shape, base) if taking else 0
            seen = await self._run(plan, g, now, (self._leases.consumer, want))
            combined = _combine(plan, [g], [seen], seen.admitted)
            if seen.block > 0:
                ref = _Granted(plan, g, repr(seen.now))
                old = self._leases.keep(plan, shape, combined.outcome, seen.block, ref, base)
                if old is not None:
                    await self._aside(self._give_back([old]))
        finally:
            if taking:
                self._refills.pop(shape).set_result(None)
        return combined

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

    async def _run(
        self, plan: Plan, g: SlotGroup, now: str, lease_ask: tuple[str, int] = ("", 0)
    ) -> Seen:
        given: dict[str, GivenDivision] = {}
        prefix = self._options.key_prefix
        records, tail = reservations.admit_tail(plan, g, prefix, self._cluster)
        keys = script.keys(ADMIT, g) + records
        for attempt in range(_ATTEMPTS):
            lock = (attempt < _ATTEMPTS - 1, self._options.lock_ms)
            args = script.admit_args(plan, g, now, lock, given, lease_ask) + tail
            reply = await self._call(self._scripts.admit, keys, args)
            if int(reply[0]) == RESERVATION_OPEN:
                raise ReservationOpen("a reservation's request id is still open")
            if int(reply[0]) != NEED_LEVEL:
                return script.seen(reply)
            given.update(await self._divisions.given(plan, g, reply))
        raise StoreUnavailable("redis: the admission script kept asking for a division")

    async def settle(self, plan: Plan, settle: Settle, now: float) -> Settled:
        own = own_counter(plan, 0)
        if own is None:
            return Settled(False)
        at = repr(now) if self._caller_clock else ""
        prefix = self._options.key_prefix
        keys, args = reservations.settle_call(plan, settle, own, prefix, self._cluster, at)
        with unavailable():
            reply = await self._call(self._scripts.settle, keys, args)
        self._known.forget(plan)  # the counts it showed may be lower now
        return Settled(int(reply[0]) == 1, int(reply[1]), int(reply[2]))

    async def usage(self, plan: Plan, now: float) -> Usage:
        own = own_counter(plan, 0)
        if own is None:
            return Usage(0, 0)
        spec = plan.counters[own]
        if spec.shape is not None and spec.shape.algorithm is not Algorithm.FIXED:
            return Usage(0, 0)  # a sliding or GCRA meter keeps no window count
        key = reservations.usage_key(plan, own, self._options.key_prefix, self._cluster)
        with unavailable():
            start, count, reserved = await self._client.hmget(key, ["s", "n", "r"])
        if start is None or int(start) != bounds(spec.window, spec.shape, now)[0]:
            return Usage(0, 0)
        return Usage(int(count or 0), int(reserved or 0))

    async def _drop_records(self, plan: Plan, groups: Sequence[SlotGroup]) -> None:
        """Forget the reservations a refused request across slots kept in ``groups``, the
        ones that admitted (best effort: a record left behind could give back hits already
        released, until it expires); a group that refused kept none, and the record there
        may be another request's (an id still open)."""
        prefix = self._options.key_prefix
        for key in reservations.records(plan, prefix, self._cluster, groups):
            try:
                with unavailable():
                    await self._client.delete(key)
            except StoreUnavailable as exc:
                log.warning("redis: a refused reservation's record was not dropped: %s", exc)

    async def _release(self, plan: Plan, charged: Sequence[tuple[SlotGroup, Seen]]) -> None:
        """Undo the reservations of the slot groups that admitted (best effort)."""
        undo = [(plan, g, repr(s.now), None) for g, s in charged]
        await self._undo(undo, "a reservation could not be released")

    async def _undo(self, undo: Sequence[tuple[Plan, SlotGroup, str, int | None]], failed: str
                    ) -> None:  # fmt: skip
        """release.lua for each (plan, slot group, the clock it was charged at, the unused
        hits of a lease block or None for a whole reservation): one call per slot, each
        undo a segment of it, the calls at once; a call that fails is logged as ``failed``
        (best effort)."""
        by_slot: dict[int, tuple[list[str], list[str | int]]] = {}
        for plan, g, at, block in undo:
            keys = script.keys(RELEASE, g)
            slot = key_slot(keys[0].encode()) if self._cluster and keys else 0
            into = by_slot.setdefault(slot, ([], []))
            into[0].extend(keys)
            into[1].extend(script.release_args(plan, g, at, block))
        release = self._scripts.release
        calls = [self._call(release, keys, args) for keys, args in by_slot.values()]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("redis: %s: %s", failed, result)

    async def _call(self, lua: AsyncScript, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """One EVALSHA (EVAL after NOSCRIPT), given up after the timeout: what the caller's
        deadline leaves (DeadlineExceeded when too little), else ``?timeout=``.

        The timeout is per call, not per request: a division hand-back (a few times a period
        per cap for the whole deployment) may take two calls and the water-filling between.
        """
        limit = deadline.timeout(self._options.timeout)
        self.round_trips += 1
        async with asyncio.timeout(limit):
            if self._batch is not None:
                return await self._batch.call(lua, keys, args)
            return await lua(keys=keys, args=args)

    async def exchange_demand(
        self, consumer: str, report: str, now: float, ttl: float
    ) -> Mapping[str, str]:
        at = repr(now) if self._caller_clock else ""
        return await self._registry.exchange_demand(consumer, report, at, ttl)

    async def caps(self) -> Mapping[str, CapReport]:
        return await self._registry.caps()

    async def ping(self) -> None:
        with unavailable():
            async with asyncio.timeout(max(self._options.timeout, 0.25)):
                await self._client.ping()

    async def close(self) -> None:
        if self._leases is not None and self._owed is not None:
            try:
                async with asyncio.timeout(max(self._options.timeout, 1.0)):
                    at = (self._last if self._caller_clock else time.monotonic()) + self._offset
                    await self._pay(self._owed.take(at), at)
                    await self._give_back(self._leases.unused())
            except TimeoutError:
                log.warning("redis: unused lease blocks not given back in time")
        await self._divisions.close()
        await self._registry.close()
        if self._batch is not None:
            self._batch.close()
        try:
            with unavailable():
                await self._client.aclose()
        except StoreUnavailable as exc:
            log.debug("close: %s", exc)
