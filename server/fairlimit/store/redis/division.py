"""A cap's division made outside the script: the rows it depends on read in bounded steps
(division_rows.py), the division computed here (core/sharing.divide), inline or in the
background.

The admit script never returns or walks a cap's rows (a script blocks every other command on
that Redis while it runs, issue 41): when a division is due it hands back the cap's index,
the division's epoch, HLEN of its rows and ZCARD of its seen index. The caller that won the
cap's lock reads the rows written lately (division_rows.read_active: what it reads grows
with the clients active in the last two windows, not with every row the cap holds), and
hands the division in with the next call (``given_division``).

A cap of at most ``inline_rows`` clients is divided inline, before its request is decided,
as before (so the deterministic parity tests keep their figures). A larger one, while a
division is in force and Redis keeps the clock, is divided in the background (one task per
cap per store): the request is decided at once by the division in force, as the other
replicas' requests are while one computes, and the task hands the new division in with an
admit-script call of no counters and no shares. A division made for an earlier sub-period is
still taken when it is newer than the one in force.

When the hand-back says the cap's least recently written row is older than a stale one can
be, the rows stale at the division (those the memory store drops at a new period) are then
dropped by prune.lua, PRUNE_STEP clients a call, the least recently written first, in the
background.
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
from fairlimit.core.sharing import ROW_FIELDS, STALE, Clock, Division, Row
from fairlimit.errors import StoreUnavailable
from fairlimit.store.redis import division_rows
from fairlimit.store.redis.client import bounded
from fairlimit.store.redis.keys import SlotGroup
from fairlimit.store.redis.script import FIGURES, GivenDivision, division_text, num

log = logging.getLogger(__name__)

PRUNE_STEP = 16  # clients whose stale rows one prune.lua call drops (16 x the 23 ROW_FIELDS)
# After a division made in the background, the cap's task rests REST times as long as it
# took before it makes the next: a division reads every active row, so at most
# 1 / (1 + REST) of a core goes to a large cap's divisions, however often they fall due
# (each period, and at a quarter period after rows / AMORTISE requests); meanwhile requests
# update the division in force (core/sharing.leave and enter) and only λ waits.
REST = 3.0


@dataclass(frozen=True, slots=True)
class HandBack:
    """One cap the admit script asked a division for (``{2, now, {...}...}``)."""

    index: int  # into SlotGroup.caps
    epoch: int  # the division's id: FORCES x its sub-period + the forced remakes before it
    fields: int  # HLEN of the cap's rows hash (rows an earlier version kept there)
    asker: str  # the client whose request forced it ("" when due)
    extra: int  # that request's hits
    closing: str  # λ of the window before as the division in force knows it, or ""
    in_force: bool  # a division is in force (a request can be decided without this one)
    indexed: int  # ZCARD of the cap's seen index
    stale: bool  # the cap may hold stale rows (prune.lua has some to drop)

    @property
    def legacy(self) -> int:
        """The rows an earlier version kept in the cap's rows hash (each has every field of
        ROW_FIELDS); a client's row is its own hash now (lua/admit/rows.lua)."""
        return self.fields // len(ROW_FIELDS)

    @property
    def clients(self) -> int:
        """The cap's clients with a row: those seen indexes, or the rows an earlier version
        kept, when more."""
        return max(self.indexed, self.legacy)

    @property
    def whole(self) -> bool:
        """Whether the rows hash of an earlier version must be read whole: some of its rows
        were written before seen was kept."""
        return self.indexed < self.legacy


def hand_backs(reply: Sequence[Any]) -> tuple[float, list[HandBack]]:
    """The clock and the caps of an admit script hand-back (``reply[0] == NEED_LEVEL``)."""
    backs = [
        HandBack(
            int(i) - 1,
            int(e),
            int(n),
            str(asker),
            int(extra),
            str(closing),
            bool(int(f)),
            int(z),
            bool(int(old)),
        )
        for i, e, n, asker, extra, closing, f, z, old in reply[2]
    ]
    return float(reply[1]), backs


def _division(share: Share, rows: dict[str, Row], now: float, back: HandBack
              ) -> tuple[GivenDivision, Division]:  # fmt: skip
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
    return GivenDivision(str(division.epoch), division_text(division), figures), division


def divide(share: Share, rows: dict[str, Row], now: float, back: HandBack) -> GivenDivision:
    """The division for ``share``'s cap from its rows (``core.sharing.divide``, as memory)."""
    return _division(share, rows, now, back)[0]


async def made(client: "aioredis.Redis | RedisCluster", keys: dict[str, str], share: Share,
               now: float, back: HandBack, timeout: float, offload: bool = False
               ) -> GivenDivision:  # fmt: skip
    """The division ``back`` asks for: the rows it depends on read (division_rows), then
    divided; ``offload``: in a thread (a large cap's water-filling is CPU work, and the
    event loop keeps answering requests meanwhile)."""

    async def run(rows: dict[str, Row]) -> tuple[GivenDivision, Division]:
        if offload:
            return await asyncio.to_thread(_division, share, rows, now, back)
        return _division(share, rows, now, back)

    if back.whole:  # every row of the rows hash an earlier version kept, and the others
        return (await run(await division_rows.read_every(client, keys, share, timeout)))[0]
    clock = Clock(share.window, share.period, now)
    rows, walked = await division_rows.read_active(client, keys, clock, back.asker, timeout,
                                                   legacy=back.fields > 0)  # fmt: skip
    given, division = await run(rows)
    # no row read has history: an older one may (unless every client indexed when the
    # hand-back was made has been walked)
    if division.cold and walked < back.indexed:
        warm = await division_rows.warm_row(client, keys, share, clock, timeout,
                                            legacy=back.fields > 0)  # fmt: skip
        if warm:
            given, _ = await run({**rows, **warm})
    return given


def stale(share: Share, now: float) -> list[str | int]:
    """prune.lua's ARGV before its count, for a division at ``now``: the rows that folding
    would make fresh ones, those of a period below stale_period and a window below
    last_window (the memory store drops the same rows at a new period), are among those
    last written before ``below``."""
    clock = Clock(share.window, share.period, now)
    period, last = clock.period - STALE, clock.start - clock.window
    return [period, last, repr(min(period * clock.period_len, float(last)))]


# Hands a division in: (plan, the group of the one cap, the division) -> done.
HandIn = Callable[[Plan, SlotGroup, dict[str, GivenDivision]], Awaitable[None]]
# Runs prune.lua: (KEYS, ARGV) -> the number of clients it dropped.
Prune = Callable[[list[str], list[str | int]], Awaitable[int]]


@dataclass(slots=True)
class _Wanted:
    plan: Plan
    group: SlotGroup  # the one cap, no counters, no shares
    now: float
    back: HandBack


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
        self._pruning: set[str] = set()  # the rows keys prune.lua is running on
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
        share = wanted.plan.shares[wanted.group.cap_share[0]]
        keys = wanted.group.cap_keys[0]
        given = await made(self._client, keys, share, wanted.now, wanted.back, self._timeout,
                           offload=True)  # fmt: skip
        async with bounded(self._timeout):
            await self._hand_in(wanted.plan, wanted.group, {wanted.group.caps[0]: given})
        self.made += 1
        if wanted.back.stale:
            await self._drop(keys, stale(share, wanted.now))

    def drop(self, keys: dict[str, str], share: Share, now: float, back: HandBack) -> None:
        """Drop the cap's rows stale at ``now`` (``stale``), in the background, when the
        hand-back ``back`` says it holds some; once at a time per cap."""
        if not back.stale or keys["rows"] in self._pruning:
            return
        task = asyncio.get_running_loop().create_task(
            self._drop(keys, stale(share, now)), context=contextvars.Context()
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop(self, keys: dict[str, str], args: list[str | int]) -> None:
        """prune.lua, PRUNE_STEP clients a call, until a call drops fewer (best effort: a row
        left is dropped after the next division)."""
        if keys["rows"] in self._pruning:
            return
        self._pruning.add(keys["rows"])
        try:
            while True:
                async with bounded(self._timeout):
                    dropped = await self._prune([keys["rows"], keys["seen"]],
                                                [*args, PRUNE_STEP])  # fmt: skip
                if dropped < PRUNE_STEP:
                    return
        except StoreUnavailable as exc:
            log.debug("redis: stale rows not dropped: %s", exc)
        finally:
            self._pruning.discard(keys["rows"])

    async def close(self) -> None:
        pending = list(self._tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def inline(back: HandBack, inline_rows: int, background: bool) -> bool:
    """Whether the division of ``back`` is made before its request is decided."""
    return not background or not back.in_force or back.clients <= inline_rows
