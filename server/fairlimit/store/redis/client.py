"""A Redis ``--backend`` URL -> options and a redis-py asyncio client (standalone, TLS,
Sentinel or Cluster), with pools and timeouts bounded for Envoy's 20 ms budget; and the one
place where what such a client raises becomes StoreUnavailable."""

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as Disconnected
from redis.exceptions import RedisClusterException, RedisError

from fairlimit.errors import StoreUnavailable, UnsupportedBackend
from fairlimit.store import deadline
from fairlimit.store.base import REDIS_SCHEMES
from fairlimit.store.redis.packing import (
    PackedConnection,
    PackedSentinelConnection,
    PackedSentinelSSLConnection,
    PackedSSLConnection,
)

# What a Redis client raises when it cannot answer; RedisClusterException (no node
# reachable, a slot without a master) is not a RedisError.
_FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)


@contextmanager
def unavailable() -> Iterator[None]:
    """Raise StoreUnavailable (from the original) for a client failure inside the block."""
    try:
        yield
    except _FAILURES as exc:
        raise StoreUnavailable(f"redis: {str(exc) or type(exc).__name__}") from exc


@asynccontextmanager
async def bounded(timeout: float) -> AsyncIterator[None]:
    """The block given up after ``timeout`` seconds, its failures (the timeout's too) as
    StoreUnavailable: the calls a division, its rows and the demand exchange make."""
    with unavailable():
        async with asyncio.timeout(timeout):
            yield


@dataclass(frozen=True, slots=True)
class Options:
    """The store's knobs, from the URL's query string.

    ``timeout`` bounds every socket operation and every Redis call: Envoy's rate-limit
    filter gives up after 20 ms by default, so by default a request whose Redis call fails
    is answered (by the failure mode) inside that budget, and Envoy sees our answer. A call
    that carries a deadline (grpc-timeout) is bounded by what it leaves instead
    (store/deadline.py).
    """

    timeout: float = 0.015
    connect_timeout: float | None = None  # None: the same as timeout
    max_connections: int = 50
    key_prefix: str = "fairlimit:"
    clock: str = "redis"  # "redis": Redis TIME (replicas agree); "caller": the `now` passed
    local_cache: int = 100_000  # entries; 0 disables
    lock_ms: int = 250  # how long a replica may take to compute λ before another takes over
    leases: str = "on"  # "off": every request is one script call (core/lease.py)
    lease_max: int = 1_000_000  # hits a lease block may hold at most (bounds the slack)
    # a cap of more clients has its division made in the background (store/redis/division.py)
    inline_rows: int = 64  # its rows read inline in one or two round trips


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
    "leases": str,
    "lease_max": int,
    "inline_rows": int,
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
        raise UnsupportedBackend(f"bad Redis host {text!r}; expected HOST[:PORT]")
    return host.strip("[]"), int(port)


def _options(query: Mapping[str, str]) -> Options:
    values: dict[str, Any] = {}
    for name, kind in _OPTION_TYPES.items():
        if name in query:
            try:
                values[name] = kind(query[name])
            except ValueError:
                problem = f"{name}={query[name]!r} is not a {kind.__name__}"
                raise UnsupportedBackend(problem) from None
    options = Options(**values)
    if options.leases not in ("on", "off"):
        raise UnsupportedBackend("leases must be on or off")
    if options.clock not in ("redis", "caller"):
        raise UnsupportedBackend("clock must be redis or caller")
    if min(options.timeout, options.max_connections, options.lock_ms) <= 0:
        raise UnsupportedBackend("timeout, max_connections and lock_ms must be positive")
    if options.lease_max < 1:
        raise UnsupportedBackend("lease_max must be 1 or more")
    if options.local_cache < 0:
        raise UnsupportedBackend("local_cache must be 0 (off) or more")
    if options.inline_rows < 0:
        raise UnsupportedBackend("inline_rows must be 0 or more")
    if "{" in options.key_prefix or "}" in options.key_prefix:
        raise UnsupportedBackend("key_prefix must not contain { or }")
    return options


def parse_url(url: str) -> RedisUrl:
    """Split a Redis backend URL; UnsupportedBackend names what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in REDIS_SCHEMES:
        raise UnsupportedBackend(f"{url!r} is not a Redis URL")
    rest, _, query_text = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    user, _, secret = userinfo.partition(":")
    default_port = 26379 if scheme == "redis+sentinel" else 6379
    hosts = tuple(_host(h, default_port) for h in (hostlist or "127.0.0.1").split(","))
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    unknown = sorted(set(query) - set(_OPTION_TYPES) - _CLIENT_QUERY)
    if unknown:
        raise UnsupportedBackend(f"unknown Redis URL option(s): {', '.join(unknown)}")
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
        # A backstop only: each call is bounded by the caller's deadline (store/deadline.py),
        # up to its CEILING, or by ``timeout`` without one (store.py).
        "socket_timeout": max(o.timeout, deadline.CEILING),
        "socket_connect_timeout": o.connect_timeout or o.timeout,
        "decode_responses": True,
    }


def _db(u: RedisUrl) -> int:
    text = u.query.get("db", u.path if u.scheme != "redis+sentinel" else "") or "0"
    if not text.isdigit():
        raise UnsupportedBackend(f"database must be a number, got {text!r}")
    return int(text)


def client_for(u: RedisUrl) -> "aioredis.Redis | RedisCluster":
    tls = u.scheme == "rediss" or u.query.get("ssl", "false").lower() == "true"
    tls_kwargs = {"ssl": True, **_tls(u)} if tls else {}
    if u.scheme == "redis+cluster":
        nodes = [ClusterNode(h, p) for h, p in u.hosts]
        limit = u.options.max_connections
        cluster = RedisCluster(
            startup_nodes=nodes, max_connections=limit, **_common(u), **tls_kwargs
        )
        # RedisCluster takes no connection class: each node it finds is made from these
        # keyword arguments (store/redis/packing.py; a test checks its nodes' connections).
        kwargs = cluster.get_connection_kwargs()
        kwargs["connection_class"] = PackedSSLConnection if tls else PackedConnection
        return cluster
    # One immediate retry: a pooled connection that died with the server is replaced at
    # once; a server that is really down still fails within the timeout. Not on a timeout:
    # the call was sent and Redis may run it yet (a script answered late, on a loaded
    # machine), so a retry would run an admission script twice and charge it twice.
    common = {**_common(u), "retry": Retry(NoBackoff(), 1, supported_errors=(Disconnected,))}
    if u.scheme == "redis+sentinel":
        return _sentinel_client(u, common, tls_kwargs)
    if len(u.hosts) > 1:
        raise UnsupportedBackend(f"{u.scheme}:// takes one host; use redis+cluster://")
    host, port = u.hosts[0]
    pool = BlockingConnectionPool(
        host=host,
        port=port,
        db=_db(u),
        max_connections=u.options.max_connections,
        timeout=u.options.timeout,  # waiting for a free connection counts against the budget
        connection_class=PackedSSLConnection if tls else PackedConnection,
        **common,
        **(_tls(u) if tls else {}),
    )
    return aioredis.Redis.from_pool(pool)


async def close_client(client: "aioredis.Redis | RedisCluster") -> None:
    """Close ``client`` and, for a Sentinel's master, the Sentinel's own clients of the
    sentinels it asked (closing the master's pool leaves those open: a store closed at
    shutdown left a connection to each sentinel to the garbage collector)."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    manager = getattr(pool, "sentinel_manager", None)
    if isinstance(manager, Sentinel):
        await manager.aclose()


def _sentinel_client(
    u: RedisUrl, common: dict[str, Any], tls_kwargs: dict[str, Any]
) -> "aioredis.Redis":
    service = u.query.get("service") or u.path
    if not service:
        raise UnsupportedBackend("redis+sentinel:// needs a service name as path")
    watchers = {"socket_timeout": u.options.timeout, "password": u.query.get("sentinel_password")}
    sentinel = Sentinel(list(u.hosts), sentinel_kwargs=watchers, **common)
    client: aioredis.Redis = sentinel.master_for(
        service,
        db=_db(u),
        max_connections=u.options.max_connections,
        connection_class=PackedSentinelSSLConnection if tls_kwargs else PackedSentinelConnection,
        **tls_kwargs,
    )
    return client
