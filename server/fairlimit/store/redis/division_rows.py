"""The rows a cap's division reads: those written lately, found by the cap's seen index.

The admit script keeps, beside a cap's rows hash, a sorted set ``seen``: each client with a
row, scored by the latest ``now`` its row was written at (``ZADD GT``; release.lua and
settle.lua move only counts of the row's own window and period). A row last written before
``since`` plays no part in a division at ``now`` (core/sharing.divide): its window is older
than the window before (no want, nothing in λ of that window) and its period older than the
period before (no fairness figures). So a division reads the clients of ``seen`` from
``since`` on, PAGE a step (a ZRANGE, then the clients' rows, READ_STEP a call of
read_rows.lua: an HMGET of each row in one script call, whose one reply costs this process
far less than an HMGET's each), and what it reads grows with the clients active in the last
two windows, not with every row the cap holds. A client's row is a hash of its own
(``<rows key>:<client>``, row_key; a listpack with its own TTL), so an HMGET of it costs the
same however many clients the cap has. Two more rows may count: the asker's (read by itself
when older), and, when no row read has any history (the division would be cold), the most
recent older row that has some (at most STALE periods back, read newest first).

Each step is a short command; other commands run between steps. The walk goes up the
scores from ``since`` with an exclusive bound at the last score read, so a client whose row
is written meanwhile (its score only grows) is read once more later, never skipped; a
page of one score only (a tie: two calls in one microsecond, or the caller's clock) is
read by rank.

Rows an earlier version wrote are fields ``<field>:<client>`` of the cap's rows hash itself:
while it holds some (the hand-back's HLEN), a client without a row of its own is read there
(read_clients, ``legacy``), and the admit script moves the row out when it writes it. A cap
whose rows were written before ``seen`` was kept (ZCARD below the rows hash's) is read whole
with HSCAN, as before, and those rows are indexed then.
"""

from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from fairlimit.core import sharing
from fairlimit.core.plan import Share
from fairlimit.core.sharing import STALE, Clock, Row
from fairlimit.store.redis.client import bounded
from fairlimit.store.redis.script import RowReader, rows_of, text

SCAN_COUNT = 128  # hash fields asked for per HSCAN step (a cap read whole)
PAGE = 64  # clients read a step: one ZRANGE of seen, then their rows (read_clients)
# Rows read_rows.lua reads a call: about 7 µs of Redis each (an HMGET of one row, 3-5 µs
# alone), so a call stays well under SLOWLOG's 1 ms (issue 41).
READ_STEP = 32
READ_ROWS = text("read_rows")

Client = aioredis.Redis | RedisCluster
# what a division reads of a row (fewer fields than it has: less for Redis and here)
_ROWS = RowReader(sharing.DIVIDED_BY)


def since(clock: Clock) -> float:
    """The time before which a row's last write leaves it out of a division at ``clock``:
    the window before's start and the period before's, and a period more (so a float's
    rounding in a row's window or period never leaves out one that counts)."""
    before = min(clock.start - clock.window, (clock.period - 1) * clock.period_len)
    return before - clock.period_len


def history_from(clock: Clock) -> float:
    """The time before which no row has any history left at ``clock`` (STALE periods), and
    a period more."""
    return (clock.period - STALE - 1) * clock.period_len


async def _zrange(client: Client, key: str, near: str | int, far: str | int, rev: bool,
                  timeout: float, byscore: bool = True) -> list[tuple[str, float]]:  # fmt: skip
    """ZRANGE of ``seen`` with scores: PAGE clients by score from ``near`` (or by rank)."""
    paging: dict[str, Any] = {"byscore": True, "offset": 0, "num": PAGE} if byscore else {}
    async with bounded(timeout):
        got: list[Any] = await client.zrange(key, near, far, desc=rev, withscores=True, **paging)
    return [(str(member), float(score)) for member, score in got]


async def _tied(client: Client, key: str, score: float, rev: bool, timeout: float
                ) -> AsyncGenerator[list[str], None]:  # fmt: skip
    """The clients of ``seen`` at ``score``, PAGE a step by rank."""
    at = repr(score)
    async with bounded(timeout):
        before = await (client.zcount(key, f"({at}", "+inf") if rev
                        else client.zcount(key, "-inf", f"({at}"))  # fmt: skip
        tied = await client.zcount(key, at, at)
    for first in range(before, before + tied, PAGE):
        last = min(first + PAGE, before + tied) - 1
        page = await _zrange(client, key, first, last, rev, timeout, byscore=False)
        yield [member for member, s in page if s == score]


async def walk(client: Client, key: str, near: str, far: str, rev: bool, timeout: float
               ) -> AsyncGenerator[list[str], None]:  # fmt: skip
    """The clients of ``seen`` between two score bounds (Redis syntax, ``near`` first),
    up the scores or down (``rev``), a step at a time."""
    while True:
        page = await _zrange(client, key, near, far, rev, timeout)
        if len(page) < PAGE:
            if page:
                yield [member for member, _ in page]
            return
        edge = page[-1][1]
        if page[0][1] != edge:
            yield [member for member, score in page if score != edge]
            near = repr(edge)  # the clients at edge, whole, in the next page
        else:
            async for tied in _tied(client, key, edge, rev, timeout):
                yield tied
            near = f"({edge!r}"


def row_key(rows: str, client: str) -> str:
    """The key of ``client``'s row: the cap's rows key, ':' and the client (lua/admit/rows.lua;
    in the cap's slot by its hash tag)."""
    return f"{rows}:{client}"


async def read_clients(client: Client, key: str, clients: Sequence[str], timeout: float,
                       legacy: bool = False) -> dict[str, Row]:  # fmt: skip
    """The rows of ``clients`` at the cap whose rows key is ``key``, what a division reads of
    them (``sharing.DIVIDED_BY``; read_rows.lua, READ_STEP rows a call); ``legacy``: those
    without a row of their own are read from the rows hash an earlier version kept
    (``<field>:<client>``), a pipeline of an HMGET each."""
    read = client.register_script(READ_ROWS)  # its sha only: loaded at the first NOSCRIPT
    values: list[Sequence[str | None]] = []
    for first in range(0, len(clients), READ_STEP):
        step = [row_key(key, name) for name in clients[first : first + READ_STEP]]
        async with bounded(timeout):
            values += await read(keys=step, args=_ROWS.fields)
    rows, missing = {}, []
    for name, got in zip(clients, values, strict=True):
        row = _ROWS.row(got)
        if row is not None:
            rows[name] = row
        else:
            missing.append(name)
    if legacy and missing:
        async with bounded(timeout), client.pipeline(transaction=False) as pipe:
            for name in missing:
                pipe.hmget(key, [f"{field}:{name}" for field in _ROWS.fields])
            values = await pipe.execute()
        for name, got in zip(missing, values, strict=True):
            row = _ROWS.row(got)
            if row is not None:
                rows[name] = row
    return rows


async def read_fields(client: Client, key: str, timeout: float) -> list[str]:
    """The hash ``key`` as flat (field, value) pairs, read SCAN_COUNT fields a step, each
    step bounded by ``timeout``."""
    flat: list[str] = []
    cursor = 0
    while True:
        async with bounded(timeout):
            cursor, chunk = await client.hscan(key, cursor, count=SCAN_COUNT)
        assert isinstance(chunk, dict)  # fields with their values (no no_values)
        for field, value in chunk.items():
            flat += (str(field), str(value))  # str already: decode_responses
        if cursor == 0:
            return flat


async def read_all(client: Client, keys: Mapping[str, str], share: Share, timeout: float
                   ) -> dict[str, Row]:  # fmt: skip
    """Every row of the cap (HSCAN), each then indexed in ``seen`` (at the latest time its
    window, period and last request show)."""
    rows = rows_of(await read_fields(client, keys["rows"], timeout))
    names = list(rows)
    for first in range(0, len(names), PAGE):
        scores = {name: _written(rows[name], share.period) for name in names[first : first + PAGE]}
        async with bounded(timeout):
            await client.zadd(keys["seen"], scores, gt=True)
    return rows


async def read_every(client: Client, keys: Mapping[str, str], share: Share, timeout: float
                     ) -> dict[str, Row]:  # fmt: skip
    """Every row of the cap: the rows hash of an earlier version whole (``read_all``), then
    the row of each client ``seen`` indexes (once, when some of that hash's rows were
    written before seen was kept)."""
    rows = await read_all(client, keys, share, timeout)
    async with aclosing(walk(client, keys["seen"], "-inf", "+inf", False, timeout)) as pages:
        async for clients in pages:
            rows.update(await read_clients(client, keys["rows"], clients, timeout))
    return rows


def _written(row: Row, period_len: float) -> float:
    return max(float(row.window), row.period * period_len, row.seen)


async def read_active(client: Client, keys: Mapping[str, str], clock: Clock, asker: str,
                      timeout: float, legacy: bool = False
                      ) -> tuple[dict[str, Row], int]:  # fmt: skip
    """The rows written since ``since(clock)``, and the asker's; and how many clients of
    ``seen`` were walked (all of them: no row is older). ``legacy``: the rows hash of an
    earlier version holds rows too (read_clients)."""
    rows: dict[str, Row] = {}
    walked: set[str] = set()
    async with aclosing(walk(client, keys["seen"], repr(since(clock)), "+inf", False,
                             timeout)) as pages:  # fmt: skip
        async for clients in pages:
            walked.update(clients)
            rows.update(await read_clients(client, keys["rows"], clients, timeout, legacy))
    if asker and asker not in rows:
        rows.update(await read_clients(client, keys["rows"], [asker], timeout, legacy))
    return rows, len(walked)


async def warm_row(client: Client, keys: Mapping[str, str], share: Share, clock: Clock,
                   timeout: float, legacy: bool = False) -> dict[str, Row]:  # fmt: skip
    """The most recent row written before ``since(clock)`` that has history at ``clock``
    (none, or one): a cold division's rows lack one."""
    near, far = f"({since(clock)!r}", repr(history_from(clock))
    async with aclosing(walk(client, keys["seen"], near, far, True, timeout)) as pages:
        async for clients in pages:
            got = await read_clients(client, keys["rows"], clients, timeout, legacy)
            for name, row in got.items():
                if not sharing.divide([(name, row)], share.capacity, clock).cold:
                    return {name: row}
    return {}
