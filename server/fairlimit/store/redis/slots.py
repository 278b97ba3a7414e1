"""Concurrency pools in Redis: the KEYS/ARGV contract of acquire.lua and release_slot.lua,
and the calls, one per slot group.

A pool's keys share the hash tag of its anchor (the outermost cap over it) on a Cluster,
so a cap's pool and its clients' pools are taken in one atomic script call. A request whose
pools span several slots is acquired group by group; when a later group refuses, the groups
already taken are released (the same two-phase rule as store.py's admission, with the same
residual race: a concurrent request may see a slot that is about to come back).

The fair bound at a cap (core.concurrency.fair_bound) is worked out here from the cap's
state as this process has read it from earlier acquires at that cap, a bounded part a call
(cap_view.py says how stale it can be), while the last part is under DEMAND_PERIOD old;
without one only the cap's and the client's own maximum apply. The limits themselves are
checked atomically in Lua, so staleness can cost fairness for a moment, never a limit.
"""

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot

from fairlimit.core.concurrency import (
    DEMAND_PERIOD,
    Claim,
    Pool,
    SlotOutcome,
    fair_bound,
    taken,
)
from fairlimit.store.redis.cap_view import CapView
from fairlimit.store.redis.keys import tag
from fairlimit.store.redis.script import source

Call = Callable[[AsyncScript, Sequence[str], Sequence[str | int]], Awaitable[Any]]
# A pool's keys by kind (acquire.lua's header names them).
POOL_KINDS = {"ids": "s", "owner": "o", "held": "h", "want": "w"}


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """The KEYS and ARGV of a slot script, by field name."""

    script: str
    pool_keys: tuple[str, ...]
    head: tuple[str, ...]
    pool: tuple[str, ...]


ACQUIRE = SlotLayout(
    "acquire",
    pool_keys=("ids", "owner", "held", "want"),
    head=("now",),
    pool=("request_id", "limit", "ttl", "client", "client_limit", "bound", "weight",
          "held_cursor", "want_cursor", "want_stamp"),
)
RELEASE_SLOT = SlotLayout(
    "release_slot",
    pool_keys=("ids", "owner", "held"),
    head=("now",),
    pool=("request_id", "client"),
)
SLOT_LAYOUTS = (ACQUIRE, RELEASE_SLOT)


def _num(x: float) -> str:
    return "inf" if x == float("inf") else repr(float(x))


def pool_keys(prefix: str, pool: Pool, cluster: bool) -> dict[str, str]:
    """The keys of ``pool`` by kind, tagged by its anchor on a Cluster, else by itself."""
    label = tag(pool.anchor if cluster else pool.key)
    return {kind: f"{prefix}{{{label}}}{short}:{pool.key}" for kind, short in POOL_KINDS.items()}


def keys(
    layout: SlotLayout, pairs: Sequence[tuple[str, Pool]], prefix: str, cluster: bool
) -> list[str]:
    out: list[str] = []
    for _, pool in pairs:
        named = pool_keys(prefix, pool, cluster)
        out += [named[kind] for kind in layout.pool_keys]
    return out


FROM_THE_START = ("0", "0", "")  # acquire.lua's reads of a cap this process has no view of


def acquire_args(
    pairs: Sequence[tuple[str, Pool]],
    now: str,
    bounds: Sequence[float],
    reads: Sequence[tuple[str, str, str]] | None = None,
) -> list[str | int]:
    """ARGV of acquire.lua (ACQUIRE); ``reads``: each pool's held_cursor, want_cursor and
    want_stamp (CapView.reads; FROM_THE_START when None)."""
    args: list[str | int] = [now, len(pairs)]
    every = [FROM_THE_START] * len(pairs) if reads is None else reads
    for (request_id, p), bound, read in zip(pairs, bounds, every, strict=True):
        client = "" if p.client is None else p.client
        args += [request_id, p.limit, _num(p.ttl), client, _num(p.client_limit), _num(bound)]
        args += [_num(p.weight), *read]
    return args


def release_args(pairs: Sequence[tuple[str, Pool]], now: str) -> list[str | int]:
    """ARGV of release_slot.lua (RELEASE_SLOT)."""
    args: list[str | int] = [now, len(pairs)]
    for request_id, p in pairs:
        args += [request_id, "" if p.client is None else p.client]
    return args


class RedisSlots:
    """Acquire and release through the two scripts; caps' recent state for the fair bound."""

    def __init__(
        self, client: "aioredis.Redis | RedisCluster", prefix: str, cluster: bool, call: Call
    ) -> None:
        self._acquire = client.register_script(source(ACQUIRE.script))
        self._release = client.register_script(source(RELEASE_SLOT.script))
        self._prefix, self._cluster, self._call = prefix, cluster, call
        self._caps: dict[str, CapView] = {}  # pool key -> the cap as read so far

    def _groups(self, pairs: list[tuple[str, Pool]]) -> list[list[tuple[str, Pool]]]:
        if not self._cluster:
            return [pairs]
        by_slot: dict[int, list[tuple[str, Pool]]] = {}
        for pair in pairs:
            ids = pool_keys(self._prefix, pair[1], True)["ids"]
            by_slot.setdefault(key_slot(ids.encode()), []).append(pair)
        return list(by_slot.values())

    def _view(self, pool: Pool, base: float) -> CapView | None:
        """The cap's view, while its last part is under DEMAND_PERIOD old."""
        view = self._caps.get(pool.key)
        if view is None or base - view.at >= DEMAND_PERIOD:
            return None
        return view

    def _bound(self, pool: Pool, base: float) -> float:
        if pool.client is None:
            return 0.0
        view = self._view(pool, base)
        return float("inf") if view is None else fair_bound(pool, view.clients)

    def _reads(self, pool: Pool, base: float) -> tuple[str, str, str]:
        view = self._view(pool, base) if pool.client is not None else None
        return FROM_THE_START if view is None else view.reads()

    def _take(self, pool: Pool, base: float, sent: tuple[str, str, str],
              state: Sequence[object]) -> None:  # fmt: skip
        """Take a cap's part of a reply into its view (a new one after DEMAND_PERIOD)."""
        assert pool.client is not None and pool.rule.fair_share is not None
        view = self._view(pool, base)
        if view is None:
            view = self._caps[pool.key] = CapView(base, pool.rule.fair_share.weight)
        view.take(base, sent, state, (pool.client, pool.client_limit, pool.weight))

    async def acquire(self, claims: Sequence[Claim], now: str, base: float) -> SlotOutcome:
        """All of ``claims``' slots or none; ``now`` "" = Redis TIME, ``base`` the local
        clock the cached cap states are aged by."""
        pairs = taken(claims)
        seen: dict[tuple[str, str], tuple[int, int]] = {}
        done: list[list[tuple[str, Pool]]] = []
        admitted = True
        for group in self._groups(pairs):
            reads = [self._reads(p, base) for _, p in group]
            reply = await self._call(
                self._acquire,
                keys(ACQUIRE, group, self._prefix, self._cluster),
                acquire_args(group, now, [self._bound(p, base) for _, p in group], reads),
            )
            for (request_id, pool), n, gone in zip(group, reply[2], reply[3], strict=True):
                seen[request_id, pool.key] = (int(n), int(gone))
            for index, *state in reply[4]:
                i = int(index) - 1
                self._take(group[i][1], base, reads[i], state)
            if int(reply[0]) != 1:
                admitted = False
                for earlier in done:
                    await self._release_group(earlier, now)
                break
            done.append(group)
        found = [seen.get((request_id, pool.key), (0, 0)) for request_id, pool in pairs]
        return SlotOutcome(admitted, tuple(n for n, _ in found), tuple(g for _, g in found))

    async def _release_group(self, group: list[tuple[str, Pool]], now: str) -> list[bool]:
        reply = await self._call(
            self._release,
            keys(RELEASE_SLOT, group, self._prefix, self._cluster),
            release_args(group, now),
        )
        return [int(x) == 1 for x in reply]

    async def release(self, claims: Sequence[Claim], now: str) -> tuple[bool, ...]:
        """Give back the slots of ``claims``; True where one was held."""
        pairs = taken(claims)
        given: dict[tuple[str, str], bool] = {}
        for group in self._groups(pairs):
            for (request_id, pool), ok in zip(
                group, await self._release_group(group, now), strict=True
            ):
                given[request_id, pool.key] = ok
        return tuple(given[request_id, pool.key] for request_id, pool in pairs)


def clock_base(caller_clock: bool, now: float) -> float:
    """The local time cached cap states are aged by: the caller's clock, else monotonic."""
    return now if caller_clock else time.monotonic()
