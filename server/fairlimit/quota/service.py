"""RLQS streams: usage reports -> demand, fair token-bucket assignments, and usage owed.

Each Envoy holds one stream (``stream.py``: its interval and buckets). A report
(``reports.py``) owes the usage Envoy already allowed to the store's counters (``usage.py``
pays it), measures each bucket's demand over the span since its last measurement, and
re-divides the caps it touched among all streams' buckets (``divider.py``, in arrays:
``division.py``; the math is ``core/quota.py``). The reporting stream gets an assignment for
every bucket it reported (which renews their TTL); any other stream gets the assignments
that changed. A bucket reported with no requests for ``abandon_after`` seconds is abandoned;
a closed stream's buckets leave the division at once. The other processes sharing the store
take part in every division with their buckets' demand, and RLS traffic with its demand at
the caps (``remote.py``). What governs a bucket under the rules in force: ``targets.py``.

Inputs are bounded (``bounds.py``): a stream holds at most ``max_buckets_per_stream``
buckets and the process ``max_buckets`` subscriptions (a stream's bucket); a new bucket past
either is refused. Reports are taken one at a time, CHUNK lines at a time, and divisions
and the peers' exchange in steps, pausing between them (``bounds.Pace``), so that RLS calls
are answered while thousands of buckets arrive; and a closed stream leaves nothing behind.
"""

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from fairlimit.core.quota import Allocation, Holder
from fairlimit.core.rules import Loaded
from fairlimit.core.tally import Tally
from fairlimit.quota.bounds import MAX_BUCKETS, MAX_BUCKETS_PER_STREAM, Room
from fairlimit.quota.divider import Divider
from fairlimit.quota.remote import Remote
from fairlimit.quota.reports import CHUNK, Intake
from fairlimit.quota.stream import Holdings, QuotaStream, Send, Usage
from fairlimit.quota.targets import Targets
from fairlimit.quota.usage import UsageLedger
from fairlimit.store.base import Store
from fairlimit.store.replicas import Replicas
from fairlimit.telemetry.quota import QuotaTelemetry, Streams

__all__ = ["ABANDON_AFTER", "CHUNK", "SYNC_DIVISION", "Holder", "QuotaService"]

log = logging.getLogger(__name__)

ABANDON_AFTER = 60.0  # seconds a bucket may report no requests before it is abandoned
# A close divides at once while this process holds at most this many subscriptions (remote
# ones included); beyond, in steps in a task of its own.
SYNC_DIVISION = 2000


class QuotaService:
    """Every RLQS stream of this process and the assignments they hold."""

    def __init__(
        self,
        loaded: Callable[[], Loaded],
        store: Store,
        now: Callable[[], float],
        *,
        shadow: bool = False,
        telemetry: QuotaTelemetry | None = None,
        abandon_after: float = ABANDON_AFTER,
        divide_gap: float = 0.0,
        consumer: str | None = None,
        tally: Tally | None = None,
        replicas: Replicas | None = None,
        max_buckets_per_stream: int = MAX_BUCKETS_PER_STREAM,
        max_buckets: int = MAX_BUCKETS,
    ) -> None:
        self.store = store
        self.now = now
        self.shadow = shadow
        self.telemetry = telemetry or QuotaTelemetry.off()
        self.streams: dict[int, QuotaStream] = {}
        self.room = Room(max_buckets_per_stream, max_buckets)
        self._turn = asyncio.Lock()  # one report (or put-off division) at a time (see CHUNK)
        self._tasks: set[asyncio.Task[None]] = set()  # divisions put off by a close
        self.ledger = UsageLedger(store)
        self._next = 0
        self.targets = Targets(loaded, shadow)
        # The other processes on this store (peers.py) and the RLS demand at caps (the
        # limiter's tally): what the division counts besides this process's streams.
        self.remote = Remote(store, consumer or uuid.uuid4().hex[:12], tally, replicas)
        # Divisions at most every divide_gap seconds: between them, a new bucket gets a
        # provisional assignment and the next drip divides (a burst of new clients would
        # otherwise cost one whole division each).
        self.divider = Divider(self.streams, self.targets, self.remote, now, divide_gap)
        self.intake = Intake(self.targets, self.divider, self.room, self.ledger,
                             self.telemetry, abandon_after)  # fmt: skip
        self.telemetry.publish(self._subscriptions, now)

    @property
    def held(self) -> int:
        """Subscriptions: the buckets of every stream."""
        return self.room.held

    @property
    def divisions(self) -> int:
        return self.divider.divisions

    @property
    def allocation(self) -> Allocation:
        return self.divider.allocation()

    def open(self, send: Send) -> QuotaStream:
        self._next += 1
        stream = QuotaStream(self._next, send)
        self.streams[stream.ident] = stream
        if self.remote.tally is not None:
            self.remote.tally.on = True  # RLS demand at caps counts in the division from now
        return stream

    def close(self, stream: QuotaStream) -> None:
        """The stream's buckets leave the division, and every index of them goes: its
        assignments at once, its debts once paid (the next drip), the peers' report at the
        next exchange."""
        if self.streams.pop(stream.ident, None) is None:
            return
        stream.closed = True
        self.divider.closes += 1
        self.ledger.pay_off(stream.ident)
        self.room.dropped(len(stream.buckets))
        stream.buckets = {}
        stream.holdings = Holdings()
        self.telemetry.stale()
        self.divider.everything()
        if not self.divider.due(self.now()):
            return  # the next drip divides
        if self.room.held + len(self.remote.counts) <= SYNC_DIVISION:
            self.divider.divide(None)
            return
        try:
            task = asyncio.get_running_loop().create_task(self._divide_put_off())
        except RuntimeError:  # no event loop (a plain call): at once, then
            self.divider.divide(None)
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _divide_put_off(self) -> None:
        """The division a close left to do, in steps, unless one came first."""
        try:
            async with self._turn:
                if self.divider.dirty and self.divider.due(self.now()):
                    await self.divider.divide_yielding(None)
        except Exception:  # a division must never take the server down
            log.exception("RLQS: the division after a stream closed failed")

    async def report(self, stream: QuotaStream, domain: str, usages: Sequence[Usage]) -> None:
        """Take one usage report, after those before it (``reports.Intake``)."""
        async with self._turn:
            if not stream.closed:
                await self.intake.take(stream, domain, usages, self.now())

    async def drip(self) -> None:
        """Trade demand with the other processes when due; divide if a division was put off;
        pay the reported usage that is due into the store's counters (see usage.py)."""
        await self.exchange()
        divider = self.divider
        if divider.dirty and divider.due(self.now()):
            async with self._turn:
                if divider.dirty and divider.due(self.now()):
                    await divider.divide_yielding(None)
        if self.targets.matcher is not None:
            if self.targets.refresh(self.streams.values()):
                self.remote.targets.clear()
                divider.changed = None
            await self.ledger.drip(self.now(), self.targets.matcher)
        if self.room.release and not divider.dirty:
            self.room.release_memory()

    async def exchange(self) -> None:
        """Trade demand with the other processes when due (``remote.py``); a change in what
        they report divides at the next drip."""
        streams = list(self.streams.values())
        if await self.remote.exchange(self.now(), streams, self.divider.pace.pause):
            self.divider.everything()

    def _subscriptions(self) -> Streams:
        """Every stream's domain and its buckets' strategies and headroom (for the gauges,
        telemetry/quota.py)."""
        return [
            (s.domain, list(zip(s.holdings.strategy[: s.holdings.size].tolist(),
                                np.nan_to_num(s.holdings.extra[: s.holdings.size]).tolist(),
                                strict=True)))
            for s in self.streams.values()
        ]  # fmt: skip
