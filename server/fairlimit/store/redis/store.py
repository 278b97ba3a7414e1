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

With leases (on by default; ``?leases=off``) a plan's requests may be admitted here from a
lease block, and the refused hits the over-limit cache answers go to Redis later (both in
leasing.py). The divisions a call hands back are made by divisions.py; the caps divided are
listed by registry.py.
"""

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot

from fairlimit.core import lease
from fairlimit.core.admission import Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.fairshare import CapReport
from fairlimit.core.plan import Plan
from fairlimit.core.reserve import Settle, Settled, Usage, own_counter
from fairlimit.core.units import Algorithm, bounds
from fairlimit.errors import ReservationOpen, StoreUnavailable
from fairlimit.store import deadline
from fairlimit.store.base import FromBlock
from fairlimit.store.patience import Heard, within
from fairlimit.store.redis import reservations, script
from fairlimit.store.redis.batch import ScriptBatcher
from fairlimit.store.redis.client import Options, close_client, unavailable
from fairlimit.store.redis.divisions import Divisions
from fairlimit.store.redis.keys import SlotGroup, slot_groups
from fairlimit.store.redis.leasing import Leasing
from fairlimit.store.redis.overlimit_cache import OverLimitCache
from fairlimit.store.redis.refills import Shape
from fairlimit.store.redis.registry import CapRegistry
from fairlimit.store.redis.replies import Combined, combine
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

# The admit script calls of a slot group beside one per cap: the first may hand back for
# the divisions due (every cap at once), each cap may then hand back for a remake the
# request forces there (under nested caps a request can find each newly contended, and
# memory remakes each), and the last may not lock: it decides on what is in force.
_ATTEMPTS = 2


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
        self._heard = Heard()  # its last answer: a timeout blames it only for silence
        self._batch = (
            ScriptBatcher(client, max(options.timeout, deadline.CEILING), self._heard)
            if isinstance(client, aioredis.Redis)
            else None
        )
        leasing = options.leases == "on"
        self._known = OverLimitCache(
            options.local_cache, 2 * lease.LEASE_TTL if leasing else math.inf
        )
        self.round_trips = 0  # script calls made (tests, the README's numbers)
        self._slots = RedisSlots(client, options.key_prefix, cluster, self._call)
        self._registry = CapRegistry(client, options.key_prefix, options.timeout)
        self._divisions = Divisions(client, options, self._scripts, self._call)
        self._leasing = (
            Leasing(options, cluster, self._known, self._run, self._admit, self._undo)
            if leasing
            else None
        )

    @property
    def _caller_clock(self) -> bool:
        return self._options.clock == "caller"

    async def admit(self, plan: Plan, now: float) -> Outcome:
        base = clock_base(self._caller_clock, now)
        leasing, shape = self._leasing, None
        if leasing is not None:
            leasing.last = base
            local, shape, base = await leasing.first(plan, now, base)
            if local is not None:
                return local
            if shape is not None:
                try:
                    return await self._exact(plan, now, base, leasing, shape)
                finally:
                    leasing.abandon(shape)  # a block call it took on and did not make
        return await self._exact(plan, now, base, leasing, shape)

    async def _exact(
        self, plan: Plan, now: float, base: float, leasing: Leasing | None, shape: Shape | None
    ) -> Outcome:
        """``admit`` of a request no block answered."""
        owing = leasing if not plan.reserve else None
        local = self._known.answer(plan, base, travel=owing is not None)
        if local is not None:
            if owing is not None:
                owing.refused(plan, shape, base)
            return local
        if owing is not None:
            await owing.pay_before(plan, base)  # counted before it
        at = repr(now) if self._caller_clock else ""
        if leasing is None:
            with unavailable():
                combined = await self._admit(plan, at)
        else:
            combined = await leasing.exact(plan, at, shape, base)
            leasing.called(plan, shape, base, combined.outcome.now)
        self._known.learn(plan, combined.outcome, combined, base)
        if combined.rolled:
            self._registry.register(combined.rolled)
        return combined.outcome

    def blocks(self) -> FromBlock | None:
        """``from_block`` while leases are on, else None."""
        return self.from_block if self._leasing is not None else None

    def from_block(self, plan: Plan, shape: tuple[str, ...], now: float) -> Outcome | None:
        """``admit`` of ``plan`` (of lease shape ``shape``, ``lease.eligible``, no
        reservation) when this process's block of it covers the request: the same answer
        and the same steps, without a coroutine (no Redis call). None, nothing done, when
        it does not (``admit`` then, which may wait for a block being taken)."""
        leasing = self._leasing
        if leasing is None:
            return None
        base = clock_base(self._caller_clock, now)
        local = leasing.leases.take(plan, shape, base)
        if local is not None:
            leasing.last = base
            self._known.admitted(plan)
        return local

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        at = repr(now) if self._caller_clock else ""
        with unavailable():
            return await self._slots.acquire(claims, at, clock_base(self._caller_clock, now))

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        with unavailable():
            return await self._slots.release(claims, repr(now) if self._caller_clock else "")

    async def _admit(
        self, plan: Plan, now: str, shape: tuple[str, ...] | None = None, base: float = 0.0
    ) -> Combined:
        groups = slot_groups(plan, self._options.key_prefix, self._cluster)
        if len(groups) == 1 and shape is not None:
            assert self._leasing is not None
            return await self._leasing.leased(plan, groups[0], now, shape, base)
        if len(groups) == 1:
            only = await self._run(plan, groups[0], now)
            return combine(plan, groups, [only], only.admitted)
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
        return combine(plan, groups, seen, admitted)

    async def _run(
        self, plan: Plan, g: SlotGroup, now: str, lease_ask: tuple[str, int] = ("", 0)
    ) -> Seen:
        given: dict[str, GivenDivision] = {}
        prefix = self._options.key_prefix
        records, tail = reservations.admit_tail(plan, g, prefix, self._cluster)
        keys = script.keys(ADMIT, g) + records
        for attempt in range(attempts := _ATTEMPTS + len(g.caps)):
            lock = (attempt < attempts - 1, self._options.lock_ms)
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
        deadline leaves (DeadlineExceeded when too little), else ``?timeout=`` while Redis
        answers nothing, up to deadline.CEILING while it answers other calls (patience.py).

        The timeout is per call, not per request: a division hand-back (a few times a period
        per cap for the whole deployment) may take two calls and the water-filling between.
        """
        self.round_trips += 1
        batch, timeout = self._batch, self._options.timeout
        if batch is not None:
            return await within(lambda: batch.call(lua, keys, args), self._heard, timeout)
        return await within(lambda: lua(keys=keys, args=args), self._heard, timeout)

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
        if self._leasing is not None:
            await self._leasing.close()
        await self._divisions.close()
        await self._registry.close()
        if self._batch is not None:
            self._batch.close()
        try:
            with unavailable():
                await close_client(self._client)
        except StoreUnavailable as exc:
            log.debug("close: %s", exc)
