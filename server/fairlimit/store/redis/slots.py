"""Concurrency pools in Redis: the KEYS/ARGV contract of acquire.lua and release_slot.lua,
and the calls, one per slot group.

A pool's keys share the hash tag of its anchor (the outermost cap over it) on a Cluster,
so a cap's pool and its clients' pools are taken in one atomic script call. A request whose
pools span several slots is acquired group by group; when a later group refuses, the groups
already taken are released (the same two-phase rule as store.py's admission, with the same
residual race: a concurrent request may see a slot that is about to come back).

The fair bound at a cap (core.concurrency.fair_bound) is worked out here from the cap's
state that the previous acquire at that cap returned, when it is under DEMAND_PERIOD old;
without one only the cap's and the client's own maximum apply. The limits themselves are
checked atomically in Lua, so staleness can cost fairness for a moment, never a limit.
"""

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot

from fairlimit.core.concurrency import (
    DEMAND_PERIOD,
    CapDemand,
    Claim,
    Pool,
    SlotOutcome,
    fair_bound,
    taken,
)
from fairlimit.store.redis.keys import tag

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
    pool=("request_id", "limit", "ttl", "client", "client_limit", "bound", "weight"),
)
RELEASE_SLOT = SlotLayout(
    "release_slot",
    pool_keys=("ids", "owner", "held"),
    head=("now",),
    pool=("request_id", "client"),
)
SLOT_LAYOUTS = (ACQUIRE, RELEASE_SLOT)


def source(layout: SlotLayout) -> str:
    return resources.files(__package__).joinpath(f"lua/{layout.script}.lua").read_text()


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


def acquire_args(
    pairs: Sequence[tuple[str, Pool]], now: str, bounds: Sequence[float]
) -> list[str | int]:
    """ARGV of acquire.lua (ACQUIRE)."""
    args: list[str | int] = [now, len(pairs)]
    for (request_id, p), bound in zip(pairs, bounds, strict=True):
        client = "" if p.client is None else p.client
        args += [request_id, p.limit, _num(p.ttl), client, _num(p.client_limit), _num(bound)]
        args.append(_num(p.weight))
    return args


def release_args(pairs: Sequence[tuple[str, Pool]], now: str) -> list[str | int]:
    """ARGV of release_slot.lua (RELEASE_SLOT)."""
    args: list[str | int] = [now, len(pairs)]
    for request_id, p in pairs:
        args += [request_id, "" if p.client is None else p.client]
    return args


def _demand(held: Sequence[str], want: Sequence[str]) -> dict[str, CapDemand]:
    """A cap's clients from acquire.lua's flat held and want hashes."""
    h = dict(zip(held[::2], held[1::2], strict=True))
    w = dict(zip(want[::2], want[1::2], strict=True))
    out: dict[str, CapDemand] = {}
    for source_hash, field in ((h, "n:"), (w, "r:")):
        for name in source_hash:
            if name.startswith(field):
                client = name[2:]
                terms = h if f"l:{client}" in h else w
                out[client] = CapDemand(
                    int(h.get("n:" + client, 0)),
                    int(w.get("r:" + client, 0)),
                    float(terms["l:" + client]),
                    float(terms["w:" + client]),
                )
    return out


class RedisSlots:
    """Acquire and release through the two scripts; caps' recent state for the fair bound."""

    def __init__(
        self, client: "aioredis.Redis | RedisCluster", prefix: str, cluster: bool, call: Call
    ) -> None:
        self._acquire = client.register_script(source(ACQUIRE))
        self._release = client.register_script(source(RELEASE_SLOT))
        self._prefix, self._cluster, self._call = prefix, cluster, call
        self._caps: dict[str, tuple[float, dict[str, CapDemand]]] = {}  # pool key -> state

    def _groups(self, pairs: list[tuple[str, Pool]]) -> list[list[tuple[str, Pool]]]:
        if not self._cluster:
            return [pairs]
        by_slot: dict[int, list[tuple[str, Pool]]] = {}
        for pair in pairs:
            ids = pool_keys(self._prefix, pair[1], True)["ids"]
            by_slot.setdefault(key_slot(ids.encode()), []).append(pair)
        return list(by_slot.values())

    def _bound(self, pool: Pool, base: float) -> float:
        if pool.client is None:
            return 0.0
        seen = self._caps.get(pool.key)
        if seen is None or base - seen[0] >= DEMAND_PERIOD:
            return float("inf")
        return fair_bound(pool, seen[1])

    async def acquire(self, claims: Sequence[Claim], now: str, base: float) -> SlotOutcome:
        """All of ``claims``' slots or none; ``now`` "" = Redis TIME, ``base`` the local
        clock the cached cap states are aged by."""
        pairs = taken(claims)
        seen: dict[tuple[str, str], tuple[int, int]] = {}
        done: list[list[tuple[str, Pool]]] = []
        admitted = True
        for group in self._groups(pairs):
            reply = await self._call(
                self._acquire,
                keys(ACQUIRE, group, self._prefix, self._cluster),
                acquire_args(group, now, [self._bound(p, base) for _, p in group]),
            )
            for (request_id, pool), n, gone in zip(group, reply[2], reply[3], strict=True):
                seen[request_id, pool.key] = (int(n), int(gone))
            for index, held, want in reply[4]:
                self._caps[group[int(index) - 1][1].key] = (base, _demand(held, want))
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
