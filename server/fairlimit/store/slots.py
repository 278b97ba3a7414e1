"""In-process concurrency pools: request ids with expiries, all or nothing per acquire.

``acquire`` and ``release`` never await, so on one event loop each is atomic by
construction. A heap of the pools' next expiries lets every call reclaim leaked slots of
pools nobody touches any more, so memory stays bounded by the slots in flight. Only an
acquire at a pool reports what expired there (as with Redis, where a pool's keys that no
acquire touches again expire by their TTL).
"""

import heapq
from collections.abc import Sequence

from fairlimit.core.concurrency import (
    ANY,
    DEMAND_PERIOD,
    CapDemand,
    Claim,
    Pool,
    SlotOutcome,
    fair_bound,
    may_take,
    taken,
)


class _Pool:
    """One pool: its slots by request id, and at a cap who holds them and who was refused."""

    __slots__ = ("clients", "expiries", "owner", "refused", "refused_until", "slots")

    def __init__(self) -> None:
        self.slots: dict[str, float] = {}  # request id -> expiry
        self.expiries: list[tuple[float, str]] = []
        self.owner: dict[str, str] = {}  # request id -> client, at a cap
        self.clients: dict[str, CapDemand] = {}  # at a cap: slots held per client
        self.refused: dict[str, CapDemand] = {}  # at a cap: refusals this demand period
        self.refused_until = 0.0

    def expire(self, now: float) -> int:
        """Give back the slots whose expiry has passed; returns how many."""
        gone = 0
        while self.expiries and self.expiries[0][0] <= now:
            expiry, request_id = heapq.heappop(self.expiries)
            if self.slots.get(request_id) == expiry:
                self._drop(request_id)
                gone += 1
        return gone

    def _drop(self, request_id: str) -> None:
        del self.slots[request_id]
        client = self.owner.pop(request_id, None)
        if client is not None:
            c = self.clients[client]
            if c.held == 1:
                del self.clients[client]
            else:
                self.clients[client] = CapDemand(c.held - 1, 0, c.limit, c.weight)

    def release(self, request_id: str, now: float, client: str | None = None) -> bool:
        """Give back ``request_id``'s slot if it holds one that has not expired (an expired
        one is left for the next acquire, which counts it as expired) and, at a cap, that
        ``client`` took: a release with another client's id frees nothing."""
        if request_id == ANY:
            return self._release_any(now, client)
        if self.slots.get(request_id, now) <= now:
            return False
        if client is not None and self.owner.get(request_id) != client:
            return False
        self._drop(request_id)
        return True

    def _release_any(self, now: float, client: str | None) -> bool:
        """Give back the live slot (of ``client``, at a cap) that expires first, ties by
        id (release_slot.lua picks the same one)."""
        live = [(expiry, rid) for rid, expiry in self.slots.items()
                if expiry > now and (client is None or self.owner.get(rid) == client)]  # fmt: skip
        if not live:
            return False
        self._drop(min(live)[1])
        return True

    def demand(self, now: float) -> dict[str, CapDemand]:
        """Each client's held and recently refused slots (the fair split's input)."""
        if now >= self.refused_until:
            self.refused = {}
        out = dict(self.clients)
        for client, r in self.refused.items():
            held = out[client].held if client in out else 0
            out[client] = CapDemand(held, r.refused, r.limit, r.weight)
        return out

    def refuse(self, pool: Pool, now: float) -> None:
        """Count a refused acquire in the client's demand for the next DEMAND_PERIOD."""
        if now >= self.refused_until:
            self.refused, self.refused_until = {}, now + DEMAND_PERIOD
        assert pool.client is not None
        known = self.refused.get(pool.client)
        n = known.refused + 1 if known else 1
        self.refused[pool.client] = CapDemand(0, n, pool.client_limit, pool.weight)

    def take(self, request_id: str, pool: Pool, now: float) -> float:
        """Give ``request_id`` a slot; returns its expiry."""
        expiry = now + pool.ttl
        self.slots[request_id] = expiry
        heapq.heappush(self.expiries, (expiry, request_id))
        if pool.client is not None:
            self.owner[request_id] = pool.client
            c = self.clients.get(pool.client)
            held = c.held if c else 0
            self.clients[pool.client] = CapDemand(held + 1, 0, pool.client_limit, pool.weight)
        return expiry

    def idle(self, now: float) -> bool:
        return not self.slots and (not self.refused or now >= self.refused_until)


def _admits(pairs: Sequence[tuple[str, Pool]], pools: Sequence[_Pool], now: float) -> bool:
    """Whether every pool has a slot for its id (a duplicate id never takes a second one)."""
    extra: dict[str, int] = {}  # slots this request takes before, in the same pool
    for (request_id, spec), pool in zip(pairs, pools, strict=True):
        more = extra.get(spec.key, 0)
        extra[spec.key] = more + 1
        if request_id in pool.slots:
            return False
        if spec.client is None:
            if not may_take(spec, len(pool.slots) + more, 0, 0.0):
                return False
            continue
        held = pool.clients.get(spec.client)
        bound = fair_bound(spec, pool.demand(now))
        if not may_take(spec, len(pool.slots) + more, (held.held if held else 0) + more, bound):
            return False
    return True


class MemorySlots:
    """Every concurrency pool of this process."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}
        self._deadlines: list[tuple[float, str]] = []  # (a slot's expiry, pool key)

    def __len__(self) -> int:
        return len(self._pools)

    def _pool(self, key: str) -> _Pool:
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool()
        return pool

    def _sweep(self, now: float) -> None:
        """Reclaim expired slots of pools no request touches (their ids leaked)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            pool = self._pools.get(key)
            if pool is not None:
                pool.expire(now)
                self._forget(key, pool, now)

    def _forget(self, key: str, pool: _Pool, now: float) -> None:
        if pool.idle(now):
            # pop: a refused acquire with two ids in one pool forgets that pool twice
            self._pools.pop(key, None)

    def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        """Take a slot in every pool of ``claims``, or none; refusals count as demand."""
        pairs = taken(claims)
        pools = [self._pool(p.key) for _, p in pairs]
        expired = tuple(pool.expire(now) for pool in pools)
        in_pool = tuple(len(pool.slots) for pool in pools)
        ok = _admits(pairs, pools, now)
        for (request_id, spec), pool in zip(pairs, pools, strict=True):
            if ok:
                heapq.heappush(self._deadlines, (pool.take(request_id, spec, now), spec.key))
            elif spec.client is not None:
                pool.refuse(spec, now)
                heapq.heappush(self._deadlines, (pool.refused_until, spec.key))
            else:
                self._forget(spec.key, pool, now)
        self._sweep(now)  # after: this call's own pools count what expired in them
        return SlotOutcome(ok, in_pool, expired)

    def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        """Give back each (request id, pool) slot that is held; others change nothing."""
        out: list[bool] = []
        for request_id, spec in taken(claims):
            pool = self._pools.get(spec.key)
            if pool is None:
                out.append(False)
                continue
            out.append(pool.release(request_id, now, spec.client))
            self._forget(spec.key, pool, now)
        self._sweep(now)
        return tuple(out)

    def clear(self) -> None:
        self._pools.clear()
        self._deadlines.clear()
