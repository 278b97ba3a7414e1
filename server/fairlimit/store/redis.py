"""Redis backend: one atomic Lua call per request, λ per cap by lock, a local over-limit cache.

The module is longer than STYLE's 400 lines on purpose: it is one idea (the Redis side of
the Store contract) whose parts - URL, key layout, script marshalling, cache, store - only
make sense together, and every function stays short.

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
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from fairlimit.core.admission import Outcome, Plan, Share, counter_over, share_over
from fairlimit.core.fairshare import FairnessFigures, fairness_figures, water_level
from fairlimit.core.units import window_start
from fairlimit.errors import SettingsError, StoreUnavailable
from fairlimit.store.base import CapReport

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "redis+sentinel", "redis+cluster")
_SCRIPT = resources.files("fairlimit.store").joinpath("lua/admit.lua").read_text()
_NEED_LEVEL = 2
_ATTEMPTS = 3  # a λ hand-back, a period boundary crossed meanwhile, then no more locking
_REGISTRY_TTL = 86400
_FIGURES = ("f_u", "f_a", "f_l", "f_j", "f_t", "f_s")
_CAP_KINDS = ("m", "p", "q", "a", "l")  # meta, cur, prev, adm, lock: KEYS order of admit.lua
# What a Redis backend can raise when it cannot answer; RedisClusterException (no node
# reachable, a slot without a master) is not a RedisError.
_FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)


# --- the URL -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    """The store's knobs, from the URL's query string.

    ``timeout`` bounds every socket operation and every Redis call: Envoy's rate-limit
    filter gives up after 20 ms by default, so by default a request whose Redis call fails
    is answered (by the failure mode) inside that budget, and Envoy sees our answer.
    """

    timeout: float = 0.015
    connect_timeout: float | None = None  # None: the same as timeout
    max_connections: int = 50
    key_prefix: str = "fairlimit:"
    clock: str = "redis"  # "redis": Redis TIME (replicas agree); "caller": the `now` passed
    local_cache: int = 100_000  # entries; 0 disables
    lock_ms: int = 250  # how long a replica may take to compute λ before another takes over


@dataclass(frozen=True, slots=True)
class RedisUrl:
    """A parsed ``--backend`` URL of one of the Redis schemes."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    path: str  # database number, or the Sentinel service name
    query: Mapping[str, str]
    options: Options


_OPTION_TYPES: dict[str, type] = {
    "timeout": float,
    "connect_timeout": float,
    "max_connections": int,
    "key_prefix": str,
    "clock": str,
    "local_cache": int,
    "lock_ms": int,
}
_CLIENT_QUERY = frozenset(
    {"db", "ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
     "ssl_check_hostname", "service", "sentinel_password"}
)  # fmt: skip


def _host(text: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not sep:
        host, port = text, str(default_port)
    if not host or not port.isdigit():
        raise SettingsError(f"--backend: bad Redis host {text!r}; expected HOST[:PORT]")
    return host.strip("[]"), int(port)


def _options(query: Mapping[str, str]) -> Options:
    values: dict[str, Any] = {}
    for name, kind in _OPTION_TYPES.items():
        if name in query:
            try:
                values[name] = kind(query[name])
            except ValueError:
                problem = f"{name}={query[name]!r} is not a {kind.__name__}"
                raise SettingsError(f"--backend: {problem}") from None
    options = Options(**values)
    if options.clock not in ("redis", "caller"):
        raise SettingsError("--backend: clock must be redis or caller")
    if min(options.timeout, options.max_connections, options.lock_ms) <= 0:
        raise SettingsError("--backend: timeout, max_connections and lock_ms must be positive")
    if options.local_cache < 0:
        raise SettingsError("--backend: local_cache must be 0 (off) or more")
    if "{" in options.key_prefix or "}" in options.key_prefix:
        raise SettingsError("--backend: key_prefix must not contain { or }")
    return options


def parse_url(url: str) -> RedisUrl:
    """Split a Redis ``--backend`` URL; SettingsError names what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise SettingsError(f"--backend: {url!r} is not a Redis URL")
    rest, _, query_text = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    user, _, secret = userinfo.partition(":")
    default_port = 26379 if scheme == "redis+sentinel" else 6379
    hosts = tuple(_host(h, default_port) for h in (hostlist or "127.0.0.1").split(","))
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    unknown = sorted(set(query) - set(_OPTION_TYPES) - _CLIENT_QUERY)
    if unknown:
        raise SettingsError(f"--backend: unknown Redis URL option(s): {', '.join(unknown)}")
    return RedisUrl(
        scheme,
        hosts,
        unquote(user) or None if at else None,
        unquote(secret) or None if at else None,
        unquote(path),
        query,
        _options(query),
    )


def _tls(u: RedisUrl) -> dict[str, Any]:
    q = u.query
    kwargs: dict[str, Any] = {
        f"ssl_{k}": q[f"ssl_{k}"] for k in ("ca_certs", "certfile", "keyfile") if f"ssl_{k}" in q
    }
    kwargs["ssl_cert_reqs"] = q.get("ssl_cert_reqs", "required")
    kwargs["ssl_check_hostname"] = q.get("ssl_check_hostname", "true").lower() == "true"
    return kwargs


def _common(u: RedisUrl) -> dict[str, Any]:
    o = u.options
    return {
        "username": u.username,
        "password": u.password,
        "socket_timeout": o.timeout,
        "socket_connect_timeout": o.connect_timeout or o.timeout,
        "decode_responses": True,
    }


def _db(u: RedisUrl) -> int:
    text = u.query.get("db", u.path if u.scheme != "redis+sentinel" else "") or "0"
    if not text.isdigit():
        raise SettingsError(f"--backend: database must be a number, got {text!r}")
    return int(text)


def _client(u: RedisUrl) -> "aioredis.Redis | RedisCluster":
    tls = u.scheme == "rediss" or u.query.get("ssl", "false").lower() == "true"
    tls_kwargs = {"ssl": True, **_tls(u)} if tls else {}
    if u.scheme == "redis+cluster":
        nodes = [ClusterNode(h, p) for h, p in u.hosts]
        limit = u.options.max_connections
        return RedisCluster(startup_nodes=nodes, max_connections=limit, **_common(u), **tls_kwargs)
    # One immediate retry: a pooled connection that died with the server is replaced at
    # once; a server that is really down still fails within the timeout.
    common = {**_common(u), "retry": Retry(NoBackoff(), 1)}
    if u.scheme == "redis+sentinel":
        return _sentinel_client(u, common, tls_kwargs)
    if len(u.hosts) > 1:
        raise SettingsError(f"--backend: {u.scheme}:// takes one host; use redis+cluster://")
    host, port = u.hosts[0]
    pool = BlockingConnectionPool(
        host=host,
        port=port,
        db=_db(u),
        max_connections=u.options.max_connections,
        timeout=u.options.timeout,  # waiting for a free connection counts against the budget
        connection_class=SSLConnection if tls else Connection,
        **common,
        **(_tls(u) if tls else {}),
    )
    return aioredis.Redis.from_pool(pool)


def _sentinel_client(
    u: RedisUrl, common: dict[str, Any], tls_kwargs: dict[str, Any]
) -> "aioredis.Redis":
    service = u.query.get("service") or u.path
    if not service:
        raise SettingsError("--backend: redis+sentinel:// needs a service name as path")
    watchers = {"socket_timeout": u.options.timeout, "password": u.query.get("sentinel_password")}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        list(u.hosts), sentinel_kwargs=watchers, **common
    )
    client: aioredis.Redis = sentinel.master_for(
        service, db=_db(u), max_connections=u.options.max_connections, **tls_kwargs
    )
    return client


def open_redis(url: str) -> "RedisStore":
    """A RedisStore for a ``redis://``, ``rediss://``, ``redis+sentinel://`` or cluster URL."""
    parsed = parse_url(url)
    return RedisStore(_client(parsed), parsed.options, cluster=parsed.scheme == "redis+cluster")


# --- keys and slot groups ------------------------------------------------------------------


def _tag(counter_key: str) -> str:
    """The hash tag text for a counter key: its path, with braces and % escaped."""
    path = counter_key.rpartition("#")[0] or counter_key
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
    """λ for ``period`` from the last period's demand hash (as _Cap._recompute in memory)."""
    prev = dict(zip(flat[::2], flat[1::2], strict=True))
    clients = [f[2:] for f in prev if f.startswith("d:")]
    scale = share.window / share.period
    demands = [float(prev["d:" + c]) for c in clients]
    limits = [float(prev["l:" + c]) for c in clients]
    weights = [float(prev["w:" + c]) for c in clients]
    admitted = [float(prev.get("a:" + c, 0)) for c in clients]
    level = water_level([d * scale for d in demands], limits, weights, share.capacity)
    fig = fairness_figures(
        demands, admitted, [lim / scale for lim in limits], weights, share.capacity / scale
    )
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


class _Known:
    """What this replica last saw of each counter and claim, until its window ends (LRU).

    A client's own counter or fair-share claim that a rejection found over stays over until
    its window ends (a claim: until the λ period ends too): counts only grow within a window
    and a bound only shrinks within a period. Such a request is answered here, without
    Redis. Only a rejection teaches it, so each replica still sends one rejected attempt
    per window to Redis and the client's demand there exceeds its share, as water-filling
    needs; a cap's total is never answered here, as that would hide every client's demand.
    The other entries only fill the statuses of a request answered here.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: OrderedDict[tuple[str, ...], tuple[float, int, float, bool]]
        self._entries = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, ...], t: float) -> tuple[int, float, bool] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= t:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[1], entry[2], entry[3]

    def put(self, key: tuple[str, ...], until: float, count: int, bound: float, over: bool) -> None:
        if self._size == 0:
            return
        self._entries[key] = (until, count, bound, over)
        self._entries.move_to_end(key)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def answer(self, plan: Plan, t: float) -> Outcome | None:
        """A rejection from what is known, when a client's counter or claim is known over."""
        over = False
        counts: list[int] = []
        for c in plan.counters:
            known = self.get(("c", c.key), t)
            counts.append(known[0] if known else 0)
            over = over or (known is not None and known[2] and counter_over(c, known[0]))
        shared: list[int] = []
        bounds: list[float] = []
        for s in plan.shares:
            claim = self.get(("s", s.cap, s.client), t)
            had, bound, flagged = claim if claim else (0, s.client_limit, False)
            over = over or (flagged and share_over(s, had, bound))
            shared.append(had)
            bounds.append(bound)
        return Outcome(False, tuple(counts), tuple(shared), tuple(bounds)) if over else None

    def learn(self, plan: Plan, outcome: Outcome, seen: "_Combined", base: float) -> None:
        """Remember the counters after ``outcome``; ``base`` maps store time to cache time."""
        charged = outcome.admitted
        caps = {s.cap for s in plan.shares}
        for i, c in enumerate(plan.counters):
            count = outcome.counts[i] + (c.hits if charged else 0)
            over = not charged and c.key not in caps and counter_over(c, count)
            self.put(("c", c.key), base + seen.counter_left[i], count, 0.0, over)
        for i, s in enumerate(plan.shares):
            if seen.fresh[i]:  # a stand-in level may rise within the period: never cache it
                had, bound = outcome.shared[i] + (s.hits if charged else 0), outcome.bounds[i]
                over = not charged and share_over(s, had, bound)
                self.put(("s", s.cap, s.client), base + seen.share_left[i], had, bound, over)


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
        self._known = _Known(options.local_cache)
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
