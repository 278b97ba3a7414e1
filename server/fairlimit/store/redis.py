"""Redis backend: one atomic Lua call per request, λ per cap by lock, a local over-limit cache.

The URL and client live in ``redis_client.py``, the local over-limit cache in
``overlimit_cache.py``; this module keeps the key layout, the script marshalling and the store.

Layout. On a Redis Cluster every key of a cap instance and of the counters below it starts
with the hash tag of the outermost cap over them (``{edge/route=public}``, braces and ``%``
percent-escaped), so a cap and its clients share one slot and one script call admits them
atomically; a counter under no cap is tagged by its own path. On one Redis (or Sentinel)
every key is tagged by its own path: there is one place anyway.

Requests spanning several slots (descriptors under different caps, on Redis Cluster only)
are admitted in two phases so that a rejected request still consumes nothing: every slot
group runs the script in parallel and charges itself only if it admits (a reservation);
when any group rejects or fails, the groups that charged are released (the same script,
mode ``release``, decrements exactly what they added). The residual race: between
reservation and release (one round trip) other requests see the reserved hits and may be
rejected although the request that held them is finally refused - never over-admitted.
If the release itself fails, the reserved hits stay charged until their window ends.
"""

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from fairlimit.core.admission import Outcome
from fairlimit.core.fairshare import (
    CapReport,
    FairnessFigures,
    PeriodDemand,
    figures_of,
    level_of,
)
from fairlimit.core.keys import key_path
from fairlimit.core.plan import Plan, Share
from fairlimit.core.units import window_start
from fairlimit.errors import StoreUnavailable
from fairlimit.store.overlimit_cache import OverLimitCache
from fairlimit.store.redis_batch import ScriptBatcher
from fairlimit.store.redis_client import Options, client_for, parse_url

log = logging.getLogger(__name__)

_SCRIPT = resources.files("fairlimit.store").joinpath("lua/admit.lua").read_text()
_NEED_LEVEL = 2
_ATTEMPTS = 3  # a λ hand-back, a period boundary crossed meanwhile, then no more locking
_REGISTRY_TTL = 86400
_FIGURES = ("f_u", "f_a", "f_l", "f_j", "f_t", "f_s")
_CAP_KINDS = ("m", "p", "q", "a", "l")  # meta, cur, prev, adm, lock: KEYS order of admit.lua
# What a Redis backend can raise when it cannot answer; RedisClusterException (no node
# reachable, a slot without a master) is not a RedisError.
_FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)


def open_redis(url: str) -> "RedisStore":
    """A RedisStore for a ``redis://``, ``rediss://``, ``redis+sentinel://`` or cluster URL."""
    parsed = parse_url(url)
    return RedisStore(client_for(parsed), parsed.options, cluster=parsed.scheme == "redis+cluster")


# --- keys and slot groups ------------------------------------------------------------------


def _tag(counter_key: str) -> str:
    """The hash tag text for a counter key: its path, with braces and % escaped."""
    path = key_path(counter_key)
    return path.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _anchors(plan: Plan, cluster: bool) -> dict[str, str]:
    """Each counter key's tag: on a Cluster the outermost cap of its descriptor, else its
    own path.

    On one Redis every key is in the same place and a key's own path is its tag, so a key's
    name never depends on the request. On a Cluster a client's counter must sit in its
    cap's slot, and the outermost cap is known only from the plan: a request whose
    ``replaces`` drops that cap's limit counts the client under another key (documented).
    """
    anchors: dict[str, str] = {}
    for dplan in plan.descriptors if cluster else ():
        caps = [plan.shares[lv.share].cap for lv in dplan.levels if lv.share is not None]
        outer = caps[0] if caps else None  # levels list the caps outermost first
        for level in dplan.levels:
            key = plan.counters[level.counter].key
            anchors.setdefault(key, outer or key)
    for counter in plan.counters:
        anchors.setdefault(counter.key, counter.key)
    return {key: _tag(anchor) for key, anchor in anchors.items()}


@dataclass(slots=True)
class _Group:
    """The part of a plan that lives in one slot: one script call."""

    counters: list[int] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)
    caps: list[str] = field(default_factory=list)  # distinct cap keys, first-seen order
    cap_share: list[int] = field(default_factory=list)  # a share index for each cap
    keys: list[str] = field(default_factory=list)


def _groups(plan: Plan, prefix: str, cluster: bool) -> list[_Group]:
    tags = _anchors(plan, cluster)
    by_slot: dict[int, _Group] = {}

    def name(key: str, kind: str, of: str) -> str:
        return f"{prefix}{{{tags[key]}}}{kind}:{of}"

    def group(key: str) -> _Group:
        slot = key_slot(name(key, "", "").encode()) if cluster else 0
        return by_slot.setdefault(slot, _Group())

    for i, counter in enumerate(plan.counters):
        group(counter.key).counters.append(i)
    for i, share in enumerate(plan.shares):
        g = group(share.cap)
        g.shares.append(i)
        if share.cap not in g.caps:
            g.caps.append(share.cap)
            g.cap_share.append(i)
    for g in by_slot.values():
        g.keys = [name(plan.counters[i].key, "c", plan.counters[i].key) for i in g.counters]
        for cap in g.caps:
            g.keys.extend(name(cap, kind, cap) for kind in _CAP_KINDS)
    return list(by_slot.values())


# --- script arguments and replies ----------------------------------------------------------


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else repr(float(x))


@dataclass(frozen=True, slots=True)
class _Level:
    """λ computed here for one cap and period, with the figures of the period before."""

    period: str
    level: str
    figures: tuple[str, ...]


def _args(
    plan: Plan, g: _Group, mode: str, now: str, lock: tuple[bool, int], given: Mapping[str, _Level]
) -> list[str | int]:
    args: list[str | int] = [mode, now, int(lock[0]), lock[1], len(g.counters)]
    for i in g.counters:
        c = plan.counters[i]
        args += [c.limit, c.window, c.hits, int(c.shadow)]
    args.append(len(g.caps))
    for cap, i in zip(g.caps, g.cap_share, strict=True):
        s = plan.shares[i]
        lv = given.get(cap) or _Level("", "", ("",) * 6)
        args += [_num(s.period), s.window, s.capacity, s.declared, cap, lv.period, lv.level]
        args += lv.figures
    args.append(len(g.shares))
    for i in g.shares:
        s = plan.shares[i]
        args += [g.caps.index(s.cap) + 1, s.client, _num(s.client_limit), _num(s.weight)]
        args += [s.hits, int(s.shadow)]
    return args


def _compute_level(share: Share, period: str, flat: Sequence[str]) -> _Level:
    """λ for ``period`` from the last period's demand hash (``core.fairshare``, as memory)."""
    prev = dict(zip(flat[::2], flat[1::2], strict=True))
    clients = [f[2:] for f in prev if f.startswith("d:")]
    last = PeriodDemand(
        share.capacity,
        share.window / share.period,
        [float(prev["d:" + c]) for c in clients],
        [float(prev.get("a:" + c, 0)) for c in clients],
        [float(prev["l:" + c]) for c in clients],
        [float(prev["w:" + c]) for c in clients],
    )
    level, fig = level_of(last), figures_of(last)
    figures = (fig.utilization, fig.active_clients, fig.level, fig.jain_index,
               fig.top_client_share, fig.starved_clients)  # fmt: skip
    return _Level(period, _num(level), tuple(_num(x) for x in figures))


@dataclass(slots=True)
class _Seen:
    """One group's reply: the counters as they stood, and whether the group charged."""

    admitted: bool
    now: float
    counts: list[int]
    shared: list[int]
    bounds: list[float]
    fresh: list[bool]
    rolled: list[int]  # indexes into _Group.caps


def _seen(reply: Sequence[Any]) -> _Seen:
    return _Seen(
        int(reply[0]) == 1,
        float(reply[1]),
        [int(x) for x in reply[2]],
        [int(x) for x in reply[3]],
        [float(x) for x in reply[4]],
        [int(x) == 1 for x in reply[5]],
        [int(x) - 1 for x in reply[6]],
    )


# --- the local over-limit cache ------------------------------------------------------------


@dataclass(slots=True)
class _Combined:
    """A plan's replies put together: the outcome and what the cache and registry need."""

    outcome: Outcome
    counter_left: list[float]  # seconds until each counter's window ends (store clock)
    share_left: list[float]  # until the claim's window or λ period ends
    fresh: list[bool]
    rolled: list[str]  # meta keys of caps whose level was written


def _combine(
    plan: Plan, groups: Sequence[_Group], seen: Sequence[_Seen], admitted: bool
) -> _Combined:
    n, k = len(plan.counters), len(plan.shares)
    counts, counter_left = [0] * n, [0.0] * n
    shared, bounds, share_left, fresh = [0] * k, [0.0] * k, [0.0] * k, [False] * k
    rolled: list[str] = []
    for g, s in zip(groups, seen, strict=True):
        for pos, i in enumerate(g.counters):
            w = plan.counters[i].window
            counts[i], counter_left[i] = s.counts[pos], window_start(w, s.now) + w - s.now
        for pos, i in enumerate(g.shares):
            sh = plan.shares[i]
            period_end = (math.floor(s.now / sh.period) + 1) * sh.period
            window_end = window_start(sh.window, s.now) + sh.window
            shared[i], bounds[i], fresh[i] = s.shared[pos], s.bounds[pos], s.fresh[pos]
            share_left[i] = min(period_end, window_end) - s.now
        base = len(g.counters)
        rolled.extend(g.keys[base + j * len(_CAP_KINDS)] for j in s.rolled)
    clock = seen[0].now if seen else None  # Redis TIME: resets agree across replicas
    outcome = Outcome(admitted, tuple(counts), tuple(shared), tuple(bounds), clock)
    return _Combined(outcome, counter_left, share_left, fresh, rolled)


# --- the store -----------------------------------------------------------------------------


class RedisStore:
    """Counters and caps in Redis, shared by every replica pointed at it."""

    def __init__(
        self, client: "aioredis.Redis | RedisCluster", options: Options, *, cluster: bool = False
    ) -> None:
        self._client = client
        self._options = options
        self._cluster = cluster
        self._script = client.register_script(_SCRIPT)
        # One pipeline for the calls of many requests (redis_batch.py); a Cluster's calls
        # go one by one, each to its own slot's node.
        self._batch = (
            ScriptBatcher(client, self._script, options.timeout)
            if isinstance(client, aioredis.Redis)
            else None
        )
        self._known = OverLimitCache(options.local_cache)
        self._registry = f"{options.key_prefix}caps"
        self._tasks: set[asyncio.Task[None]] = set()
        self.round_trips = 0  # admission script calls made (tests, the README's numbers)
        self.local_answers = 0  # requests answered by the over-limit cache

    @property
    def _caller_clock(self) -> bool:
        return self._options.clock == "caller"

    async def admit(self, plan: Plan, now: float) -> Outcome:
        base = now if self._caller_clock else time.monotonic()
        local = self._known.answer(plan, base)
        if local is not None:
            self.local_answers += 1
            return local
        try:
            combined = await self._admit(plan, repr(now) if self._caller_clock else "")
        except _FAILURES as exc:
            raise _unavailable(exc) from exc
        self._known.learn(plan, combined.outcome, combined, base)
        if combined.rolled:
            self._register(combined.rolled)
        return combined.outcome

    async def _admit(self, plan: Plan, now: str) -> _Combined:
        groups = _groups(plan, self._options.key_prefix, self._cluster)
        if len(groups) == 1:
            only = await self._run(plan, groups[0], now)
            return _combine(plan, groups, [only], only.admitted)
        results = await asyncio.gather(
            *(self._run(plan, g, now) for g in groups), return_exceptions=True
        )
        seen = [r for r in results if isinstance(r, _Seen)]
        failed = [r for r in results if isinstance(r, BaseException)]
        admitted = not failed and all(s.admitted for s in seen)
        if not admitted:
            charged = [(g, r) for g, r in zip(groups, results, strict=True)
                       if isinstance(r, _Seen) and r.admitted]  # fmt: skip
            await self._release(plan, charged)
        if failed:
            raise failed[0]
        return _combine(plan, groups, seen, admitted)

    async def _run(self, plan: Plan, g: _Group, now: str) -> _Seen:
        given: dict[str, _Level] = {}
        for attempt in range(_ATTEMPTS):
            lock = (attempt < _ATTEMPTS - 1, self._options.lock_ms)
            reply = await self._call(g.keys, _args(plan, g, "admit", now, lock, given))
            if int(reply[0]) != _NEED_LEVEL:
                return _seen(reply)
            for index, period, flat in reply[2]:
                pos = int(index) - 1
                share = plan.shares[g.cap_share[pos]]
                given[g.caps[pos]] = _compute_level(share, str(period), flat)
        raise StoreUnavailable("redis: the admission script kept asking for λ")

    async def _release(self, plan: Plan, charged: Sequence[tuple[_Group, _Seen]]) -> None:
        """Undo the reservations of the slot groups that admitted (best effort)."""
        calls = [
            self._call(g.keys, _args(plan, g, "release", repr(s.now), (False, 0), {}))
            for g, s in charged
        ]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("redis: a reservation could not be released: %s", result)

    async def _call(self, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """One EVALSHA (EVAL after NOSCRIPT), given up after the timeout.

        The deadline is per call, not per request: the λ hand-back (once per period per cap
        for the whole deployment) may take two calls and the water-filling in between.
        """
        self.round_trips += 1
        async with asyncio.timeout(self._options.timeout):
            if self._batch is not None:
                return await self._batch.call(keys, args)
            return await self._script(keys=keys, args=args)

    def _register(self, metas: Sequence[str]) -> None:
        """Add caps to the registry that caps() reads (in the background, once per period)."""

        async def register() -> None:
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.sadd(self._registry, *metas)
                    pipe.expire(self._registry, _REGISTRY_TTL)
                    await pipe.execute()
            except _FAILURES as exc:
                log.debug("redis: cap registry not updated: %s", exc)

        task = asyncio.get_running_loop().create_task(register())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def caps(self) -> Mapping[str, CapReport]:
        try:
            async with asyncio.timeout(max(self._options.timeout, 1.0)):
                metas = sorted(await self._client.smembers(self._registry))
                async with self._client.pipeline(transaction=False) as pipe:
                    for meta in metas:
                        pipe.hgetall(meta)
                    states = await pipe.execute() if metas else []
                gone = [m for m, state in zip(metas, states, strict=True) if not state]
                if gone:
                    await self._client.srem(self._registry, *gone)
        except _FAILURES as exc:
            raise _unavailable(exc) from exc
        reports = (_report(state) for state in states if state)
        return {report.cap: report for report in reports}

    async def ping(self) -> None:
        try:
            async with asyncio.timeout(max(self._options.timeout, 0.25)):
                await self._client.ping()
        except _FAILURES as exc:
            raise _unavailable(exc) from exc

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._batch is not None:
            self._batch.close()
        try:
            await self._client.aclose()
        except _FAILURES as exc:
            log.debug("redis: close: %s", exc)


def _unavailable(exc: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"redis: {str(exc) or type(exc).__name__}")


def _report(state: Mapping[str, str]) -> CapReport:
    level = None if state.get("v", "none") == "none" else float(state["v"])
    figures = None
    if "f_u" in state:
        u, a, lv, j, t, s = (float(state[f]) for f in _FIGURES)
        figures = FairnessFigures(u, int(a), lv, j, t, int(s))
    return CapReport(state.get("cap", ""), level, int(state.get("declared", 0)), figures)
