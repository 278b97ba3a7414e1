"""A cap's division made outside the script: its rows read by HSCAN in bounded steps, the
division computed here (core/sharing.divide), inline or in the background.

The admit script never returns or walks a cap's rows (a script blocks every other command on
that Redis while it runs, issue 41): when a division is due it hands back the cap's index,
the division's epoch and HLEN of its rows. The caller that won the cap's lock reads the rows
with HSCAN, SCAN_COUNT fields a step (each step is one short command; other commands run
between steps), and hands the division in with the next call (``given_division``).

A cap of at most ``inline_rows`` clients is divided inline, before its request is decided,
as before (so the deterministic parity tests keep their figures). A larger one, while a
division is in force and Redis keeps the clock, is divided in the background (one task per
cap per store): the request is decided at once by the division in force, as the other
replicas' requests are while one computes, and the task hands the new division in with an
admit-script call of no counters and no shares. A division made for an earlier sub-period is
still taken when it is newer than the one in force. Rows are read as HSCAN returns them:
a row written between two steps may mix its fields from before and after that request (a
division is an estimate remade every sub-period; the next one reads it whole).

The rows a division finds stale (those the memory store drops at a new period) are then
dropped by prune.lua, PRUNE_STEP clients a call, in the background.
"""

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from fairlimit.core import sharing
from fairlimit.core.fairshare import figures_of
from fairlimit.core.plan import Plan, Share
from fairlimit.core.sharing import ROW_FIELDS, Clock, Row
from fairlimit.errors import StoreUnavailable
from fairlimit.store.redis.client import unavailable
from fairlimit.store.redis.keys import SlotGroup
from fairlimit.store.redis.script import FIGURES, GivenDivision, division_text, num, rows_of

log = logging.getLogger(__name__)

SCAN_COUNT = 128  # hash fields asked for per HSCAN step (about 6 clients' rows): well under
# a millisecond of Redis time per step, on a loaded machine too
PRUNE_STEP = 16  # clients whose stale rows one prune.lua call drops (16 x 22 fields)
# After a division made in the background, the cap's task rests REST times as long as it
# took before it makes the next: a division reads every row, so at most 1 / (1 + REST) of
# a core goes to a large cap's divisions, however often they fall due (each period, and at
# a quarter period after rows / AMORTISE requests); meanwhile requests update the division
# in force (core/sharing.leave and enter) and only λ waits.
REST = 3.0


@dataclass(frozen=True, slots=True)
class HandBack:
    """One cap the admit script asked a division for (``{2, now, {...}...}``)."""

    index: int  # into SlotGroup.caps
    epoch: int  # the division's id: FORCES x its sub-period + the forced remakes before it
    fields: int  # HLEN of the cap's rows hash
    asker: str  # the client whose request forced it ("" when due)
    extra: int  # that request's hits
    closing: str  # λ of the window before as the division in force knows it, or ""
    in_force: bool  # a division is in force (a request can be decided without this one)

    @property
    def clients(self) -> int:
        """The rows the hash holds (each has every field of ROW_FIELDS)."""
        return self.fields // len(ROW_FIELDS)


def hand_backs(reply: Sequence[Any]) -> tuple[float, list[HandBack]]:
    """The clock and the caps of an admit script hand-back (``reply[0] == NEED_LEVEL``)."""
    backs = [
        HandBack(int(i) - 1, int(e), int(n), str(asker), int(extra), str(closing), bool(int(f)))
        for i, e, n, asker, extra, closing, f in reply[2]
    ]
    return float(reply[1]), backs


async def read_fields(client: "aioredis.Redis | RedisCluster", key: str, timeout: float
                      ) -> list[str]:  # fmt: skip
    """The hash ``key`` as flat (field, value) pairs, read SCAN_COUNT fields a step, each
    step bounded by ``timeout``."""
    flat: list[str] = []
    cursor = 0
    while True:
        with unavailable():
            async with asyncio.timeout(timeout):
                cursor, chunk = await client.hscan(key, cursor, count=SCAN_COUNT)
        assert isinstance(chunk, dict)  # fields with their values (no no_values)
        for field, value in chunk.items():
            flat += (str(field), str(value))  # str already: decode_responses
        if cursor == 0:
            return flat


async def read_rows(client: "aioredis.Redis | RedisCluster", key: str, timeout: float
                    ) -> dict[str, Row]:  # fmt: skip
    """The rows of the hash ``key`` (``read_fields``)."""
    return rows_of(await read_fields(client, key, timeout))


def divide(share: Share, rows: dict[str, Row], now: float, back: HandBack) -> GivenDivision:
    """The division for ``share``'s cap from its rows (``core.sharing.divide``, as memory)."""
    clock = Clock(share.window, share.period, now)
    if back.asker and back.asker not in rows:  # a newcomer: memory holds its fresh row by now
        rows[back.asker] = Row(share.client_limit, share.weight)
    known = float(back.closing) if back.closing else None
    forced = back.epoch % sharing.FORCES
    division = sharing.divide(
        rows.items(), share.capacity, clock, back.asker, back.extra, known, forced
    )
    last = sharing.last_period(rows.values(), share.capacity, clock)
    figures: tuple[str, ...] = ("",) * len(FIGURES)
    if last is not None:
        fig = figures_of(last)
        figures = tuple(num(x) for x in (fig.utilization, fig.active_clients, fig.level,
                        fig.jain_index, fig.top_client_share, fig.starved_clients))  # fmt: skip
    return GivenDivision(str(division.epoch), division_text(division), figures)


def stale(share: Share, rows: dict[str, Row], now: float) -> tuple[int, int, list[str]]:
    """(stale period, last window, clients): the rows that folding at ``now`` would make
    fresh ones, those of a period below the first and a window below the second (the
    memory store drops the same rows at a new period)."""
    clock = Clock(share.window, share.period, now)
    period, last = clock.period - sharing.STALE, clock.start - clock.window
    return period, last, [c for c, r in rows.items() if r.period < period and r.window < last]


# Hands a division in: (plan, the group of the one cap, the division) -> done.
HandIn = Callable[[Plan, SlotGroup, dict[str, GivenDivision]], Awaitable[None]]
# Runs prune.lua: (KEYS, ARGV) -> its reply.
Prune = Callable[[list[str], list[str | int]], Awaitable[Any]]


@dataclass(slots=True)
class _Wanted:
    plan: Plan
    group: SlotGroup  # the one cap, no counters, no shares
    now: float
    back: HandBack


def _made(wanted: _Wanted, flat: list[str]) -> tuple[GivenDivision, tuple[int, int, list[str]]]:
    share = wanted.plan.shares[wanted.group.cap_share[0]]
    rows = rows_of(flat)
    dropped = stale(share, rows, wanted.now)  # before divide adds a newcomer's fresh row
    return divide(share, rows, wanted.now, wanted.back), dropped


class Background:
    """The divisions of large caps, made off the request path: one task per cap at a time,
    resting REST times a division's duration after it; a hand-back for a newer division
    while the task is out waits for it (the newest only)."""

    def __init__(self, client: "aioredis.Redis | RedisCluster", hand_in: HandIn, prune: Prune,
                 timeout: float) -> None:  # fmt: skip
        self._client = client
        self._hand_in = hand_in
        self._prune = prune
        self._timeout = timeout
        self._out: dict[str, int] = {}  # cap key -> the epoch of the division being made
        self._next: dict[str, _Wanted] = {}  # cap key -> the newer hand-back waiting
        self._tasks: set[asyncio.Task[None]] = set()
        self.made = 0  # divisions handed in (tests)

    def want(self, plan: Plan, g: SlotGroup, now: float, back: HandBack) -> None:
        cap = g.caps[back.index]
        one = SlotGroup(caps=[cap], cap_share=[g.cap_share[back.index]],
                        cap_keys=[g.cap_keys[back.index]])  # fmt: skip
        wanted = _Wanted(plan, one, now, back)
        if cap in self._out:
            waiting = self._next.get(cap)
            newest = max(self._out[cap], waiting.back.epoch if waiting else -1)
            if back.epoch > newest:
                self._next[cap] = wanted
            return
        self._out[cap] = back.epoch
        # a context of its own: the request's deadline (store/deadline.py) is not its
        task = asyncio.get_running_loop().create_task(
            self._run(cap, wanted), context=contextvars.Context()
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, cap: str, wanted: _Wanted) -> None:
        try:
            while True:
                began = time.monotonic()
                try:
                    await self._make(wanted)
                except StoreUnavailable as exc:
                    log.warning("redis: a division made in the background was lost: %s", exc)
                except Exception:  # a task's error is nobody's to catch: the cap goes on
                    log.exception("redis: a division made in the background failed")
                await asyncio.sleep((time.monotonic() - began) * REST)
                waiting = self._next.pop(cap, None)
                if waiting is None:
                    return
                wanted, self._out[cap] = waiting, waiting.back.epoch
        finally:
            self._out.pop(cap, None)

    async def _make(self, wanted: _Wanted) -> None:
        flat = await read_fields(self._client, wanted.group.cap_keys[0]["rows"], self._timeout)
        # parsing and water-filling a large cap's rows is CPU work: in a thread, so the
        # event loop keeps answering requests meanwhile
        made, dropped = await asyncio.to_thread(_made, wanted, flat)
        with unavailable():
            async with asyncio.timeout(self._timeout):
                await self._hand_in(wanted.plan, wanted.group, {wanted.group.caps[0]: made})
        self.made += 1
        await self._drop(wanted.group.cap_keys[0]["rows"], *dropped)

    def drop(self, key: str, period: int, last: int, clients: list[str]) -> None:
        """Drop the stale rows of ``clients`` from the rows hash ``key``, in the background."""
        if not clients:
            return
        task = asyncio.get_running_loop().create_task(
            self._drop(key, period, last, clients), context=contextvars.Context()
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop(self, key: str, period: int, last: int, clients: list[str]) -> None:
        """prune.lua, PRUNE_STEP clients a call (best effort: a row left is dropped at the
        next division)."""
        for at in range(0, len(clients), PRUNE_STEP):
            try:
                with unavailable():
                    async with asyncio.timeout(self._timeout):
                        await self._prune([key], [period, last, *clients[at : at + PRUNE_STEP]])
            except StoreUnavailable as exc:
                log.debug("redis: stale rows not dropped: %s", exc)
                return

    async def close(self) -> None:
        pending = list(self._tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def inline(back: HandBack, inline_rows: int, background: bool) -> bool:
    """Whether the division of ``back`` is made before its request is decided."""
    return not background or not back.in_force or back.clients <= inline_rows
