"""RLQS streams: usage reports -> demand, fair token-bucket assignments, and usage owed.

Each Envoy holds one stream (``stream.py``: its interval and buckets). A report owes the
usage Envoy already allowed to the store's counters (``usage.py`` pays it), measures each
bucket's demand over the span since its last measurement, and re-divides every cap among
all streams' buckets (``core/quota.py``). The reporting stream gets an assignment for every
bucket it reported (which renews their TTL); any other stream gets the assignments that
changed. A bucket reported with no requests for ``abandon_after`` seconds is abandoned; a
closed stream's buckets leave the division at once. The other processes sharing the store
take part in every division with their buckets' demand, and RLS traffic with its demand at
the caps (``remote.py``).

Inputs are bounded (``bounds.py``): a stream holds at most ``max_buckets_per_stream``
buckets and the process ``max_buckets`` subscriptions (a stream's bucket); a new bucket past
either is refused (no assignment, not tracked: see ``QuotaService.report``). Reports are
taken one at a time, CHUNK lines at a time, and divisions and the peers' exchange in steps,
pausing between them (``bounds.Pace``), so that RLS calls are answered while thousands of
buckets arrive; and a closed stream leaves nothing behind.

Some 450 lines: a division runs over the state every other step here keeps (streams,
regions, the allocation, closes), a turn at a time; split further, that state would be
handed around whole.
"""

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence

from fairlimit.core.bucket import BucketKey, bucket_key, entries_for
from fairlimit.core.matching import Entry, Matcher
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.quota import (
    STEP,
    Allocation,
    Blanket,
    Holder,
    Regions,
    Target,
    allocation,
    provisional,
    settle,
    target_of,
)
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Loaded
from fairlimit.core.tally import Tally
from fairlimit.quota.bounds import MAX_BUCKETS, MAX_BUCKETS_PER_STREAM, Pace, Room
from fairlimit.quota.remote import Remote
from fairlimit.quota.stream import (
    Abandon,
    Action,
    Assign,
    QuotaStream,
    Send,
    Subscription,
    Usage,
    bounded,
)
from fairlimit.quota.usage import UsageLedger
from fairlimit.store.base import Store
from fairlimit.store.replicas import Replicas
from fairlimit.telemetry.quota import QuotaTelemetry, Streams

log = logging.getLogger(__name__)

ABANDON_AFTER = 60.0  # seconds a bucket may report no requests before it is abandoned
# A report is taken this many lines at a time, yielding to the event loop in between (a new
# bucket costs about 30 µs: its descriptor, plan and target; a known one a few), and one
# report at a time: twenty streams' reports side by side each ran a chunk in every turn of
# the loop, and an RLS call waited for all of them (240 ms).
CHUNK = 128
# A close divides at once while this process holds at most this many subscriptions (remote
# ones included: about 10 ms); beyond, in steps (_divide_yielding) in a task of its own: the
# close of one of 20 streams holding 10,000 held the event loop 60-90 ms.
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
        self._loaded_source = loaded
        self.store = store
        self.now = now
        self.shadow = shadow
        self.telemetry = telemetry or QuotaTelemetry.off()
        self.abandon_after = abandon_after
        # Divisions at most every divide_gap seconds: between them, a new bucket gets a
        # provisional assignment and the next drip divides (a burst of new clients would
        # otherwise cost one whole division each).
        self.divide_gap = divide_gap
        self.divisions = 0
        self._divided_at: float | None = None
        self._dirty = False
        self.streams: dict[int, QuotaStream] = {}
        self.room = Room(max_buckets_per_stream, max_buckets)
        self._turn = asyncio.Lock()  # one report (or put-off division) at a time (see CHUNK)
        self._closes = 0  # streams closed so far (a division in steps checks it)
        self._pace = Pace()
        self._tasks: set[asyncio.Task[None]] = set()  # divisions put off by a close
        self.ledger = UsageLedger(store)
        self.allocation = Allocation({}, {}, {}, {})
        self._next = 0
        self._loaded: Loaded | None = None
        self._matcher: Matcher | None = None
        # The other processes on this store (peers.py) and the RLS demand at caps (the
        # limiter's tally): what the division counts besides this process's streams.
        self.remote = Remote(store, consumer or uuid.uuid4().hex[:12], tally, replicas)
        # Incremental divisions: the regions (buckets linked by caps) a report changed since
        # the last division; None: every region (the first one, a reload, a closed stream,
        # the peers' reports or the RLS demand changed).
        self._regions = Regions()
        self._changed: set[object] | None = None
        self.telemetry.publish(self._subscriptions, now)

    @property
    def held(self) -> int:
        """Subscriptions: the buckets of every stream."""
        return self.room.held

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
        self._closes += 1
        self.ledger.pay_off(stream.ident)
        strategies, extra = self.allocation.strategies, self.allocation.extra
        for key in stream.buckets:
            strategies.pop((stream.ident, key), None)
            extra.pop((stream.ident, key), None)
        self.room.dropped(len(stream.buckets))
        stream.buckets = {}
        self.telemetry.stale()
        self._changed, self._dirty = None, True
        if not self._due(self.now()):
            return  # the next drip divides
        if self.room.held + len(self.remote.counts) <= SYNC_DIVISION:
            self._divide(None, ())
            return
        try:
            task = asyncio.get_running_loop().create_task(self._divide_put_off())
        except RuntimeError:  # no event loop (a plain call): at once, then
            self._divide(None, ())
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _divide_put_off(self) -> None:
        """The division a close left to do, in steps, unless one came first."""
        try:
            async with self._turn:
                if self._dirty and self._due(self.now()):
                    await self._divide_yielding(None, ())
        except Exception:  # a division must never take the server down
            log.exception("RLQS: the division after a stream closed failed")

    async def report(self, stream: QuotaStream, domain: str, usages: Sequence[Usage]) -> None:
        """Take one usage report, after those before it, CHUNK lines at a time (yielding to
        the event loop between them; a stream closed meanwhile takes the rest no further).

        A new bucket past a cap (``Room.full``) is refused: not tracked, its usage neither paid
        nor counted, no assignment sent. Envoy then applies the bucket's
        no_assignment_behavior and lists it in each periodic report, where it costs a
        lookup, and is taken like any new bucket once the stream has room (an
        AbandonAction would make Envoy forget it and report it afresh at its next request,
        one report per request). The stream is not ended: that would drop what it holds,
        and Envoy would reopen it and report the same buckets again."""
        async with self._turn:
            await self._report(stream, domain, usages)

    async def _report(self, stream: QuotaStream, domain: str, usages: Sequence[Usage]) -> None:
        if stream.closed:
            return
        now = self.now()
        since = stream.last_report
        stream.observe(now)
        stream.domain = domain or stream.domain
        self._refresh_targets()
        reported: list[BucketKey] = []
        allowed = denied = 0  # as counted
        refused: dict[str, int] = {}
        for n, line in enumerate(usages):
            if n and not n % CHUNK:
                await self._pace.pause()
                if stream.closed:
                    return
            key = bucket_key(line.bucket)
            held = stream.buckets.get(key)
            if held is None and (cap := self.room.full(stream)) is not None:
                refused[cap] = refused.get(cap, 0) + 1
                continue
            usage = bounded(line, None if held is None else held,
                            None if since is None else now - since)  # fmt: skip
            if usage is not line and not stream.warned:
                stream.warned = True
                log.warning("RLQS: stream %d reported more requests than it can have let"
                            " through (counted as at most %d allowed, %d denied)",
                            stream.ident, usage.allowed, usage.denied)  # fmt: skip
            if held is None:
                held = stream.buckets[key] = Subscription(usage.bucket, now)
                self._resolve(stream.domain, held)
                self.room.took()
            else:
                held.measure(usage.allowed + usage.denied, now, stream.interval)
                held.start_span()
            allowed, denied = allowed + usage.allowed, denied + usage.denied
            held.allowed += usage.allowed
            held.denied += usage.denied
            if held.entries is not None and usage.allowed > 0:
                owner = (stream.ident, key)
                self.ledger.owe(owner, stream.domain, held.entries, usage.allowed, stream.interval)
            reported.append(key)
        self.room.refuse(stream, refused, self.telemetry)
        self.telemetry.reported(stream.domain, allowed, denied)
        # Only a periodic report lists every bucket; scanning on each subscription (a report
        # of one new bucket) would cost O(buckets) per new client.
        full = len(usages) >= len(stream.buckets)
        abandoned = self._abandon_idle(stream, now) if full else []
        if self._due(now):
            await self._divide_yielding(stream, reported, abandoned)
        else:
            self._provisional(stream, reported, abandoned)

    async def drip(self) -> None:
        """Trade demand with the other processes when due; divide if a division was put off;
        pay the reported usage that is due into the store's counters (see usage.py)."""
        await self.exchange()
        if self._dirty and self._due(self.now()):
            async with self._turn:
                if self._dirty and self._due(self.now()):
                    await self._divide_yielding(None, ())
        if self._matcher is not None:
            self._refresh_targets()
            await self.ledger.drip(self.now(), self._matcher)
        if self.room.release and not self._dirty:
            self.room.release_memory()

    async def exchange(self) -> None:
        """Trade demand with the other processes when due (``remote.py``); a change in what
        they report divides at the next drip."""
        if await self.remote.exchange(self.now(), list(self.streams.values()), self._pace.pause):
            self._dirty, self._changed = True, None

    def _abandon_idle(self, stream: QuotaStream, now: float) -> list[Action]:
        idle = [k for k, b in stream.buckets.items() if now - b.active_at >= self.abandon_after]
        out: list[Action] = []
        for key in idle:
            held = stream.buckets.pop(key)
            self._mark(key, held.target)  # its region re-divides without it
            self.allocation.strategies.pop((stream.ident, key), None)
            self.allocation.extra.pop((stream.ident, key), None)
            out.append(Abandon(held.bucket))
        self.room.dropped(len(idle))
        return out

    def _mark(self, key: BucketKey, target: Target) -> None:
        """The region of ``key`` is to be re-divided."""
        if self._changed is not None:
            self._changed.add(self._regions.of(key, target))

    def _refresh_targets(self) -> None:
        """After a config reload, every bucket is mapped again under the new rules."""
        loaded = self._loaded_source()
        if loaded is self._loaded:
            return
        self._loaded, self._matcher = loaded, Matcher(loaded.config)
        self.remote.targets.clear()
        self._regions, self._changed = Regions(), None
        for stream in self.streams.values():
            for held in stream.buckets.values():
                self._resolve(stream.domain, held)

    def _resolve(self, domain: str, held: Subscription) -> None:
        held.entries, held.target = self._governing(domain, held.bucket)

    def _governing(
        self, domain: str, bucket: Mapping[str, str]
    ) -> tuple[tuple[Entry, ...] | None, Target]:
        """A bucket's descriptor entries and target under the rules in force (its caps
        linked in the regions)."""
        assert self._loaded is not None and self._matcher is not None
        entries = entries_for(self._loaded.config.domains.get(domain), bucket)
        if entries is None or self.shadow:
            return entries, Target(Blanket.ALLOW_ALL)
        request = Request(domain, (Descriptor(entries, None, 1),))
        target = target_of(make_plan(request, self._matcher))
        self._regions.add(target)
        return entries, target

    def _target(self, domain: str, bucket: Mapping[str, str]) -> Target:
        return self._governing(domain, bucket)[1]

    def _due(self, now: float) -> bool:
        return self._divided_at is None or now - self._divided_at >= self.divide_gap

    def _provisional(
        self, stream: QuotaStream, reported: Sequence[BucketKey], abandoned: Sequence[Action]
    ) -> None:
        """Between divisions: renew the reported buckets' assignments, give new ones a
        provisional one from the levels in force, divide at the next drip."""
        self._dirty = True
        actions: list[Action] = list(abandoned)
        for key in dict.fromkeys(reported):
            held = stream.buckets.get(key)
            if held is None:
                continue
            self._mark(key, held.target)
            strategy = held.strategy
            if strategy is None:
                holders = sum(1 for s in self.streams.values() if key in s.buckets)
                holders += self.remote.counts.get(key, 0)
                strategy = provisional(held.target, self.allocation.levels, holders)
                held.assign(strategy)
            actions.append(Assign(held.bucket, strategy, stream.ttl))
        if actions:
            stream.send(actions)

    def _divide(
        self,
        reporter: QuotaStream | None,
        reported: Sequence[BucketKey],
        abandoned: Sequence[Action] = (),
    ) -> None:
        """A division (``_division``) at once."""
        for _ in self._division(reporter, reported, abandoned):
            pass

    async def _divide_yielding(
        self,
        reporter: QuotaStream | None,
        reported: Sequence[BucketKey],
        abandoned: Sequence[Action] = (),
    ) -> None:
        """A division (``_division``) yielding to the event loop between its steps: a
        division of 10,000 subscriptions held the loop 45-85 ms in one go. Called with the
        report turn held, so that no report or reload changes the buckets meanwhile."""
        for _ in self._division(reporter, reported, abandoned):
            await self._pace.pause()

    def _division(
        self,
        reporter: QuotaStream | None,
        reported: Sequence[BucketKey],
        abandoned: Sequence[Action],
    ) -> Iterator[None]:
        """Re-divide the regions (caps and the buckets under them) that changed since the
        last division; send the reporter its buckets and the others what changed. Steps
        between a stream's buckets gathered, the division itself and a stream's
        assignments sent; a stream closing between them (its own division divides or is
        due) ends the rest, as what is left was worked out with its buckets."""
        if self.remote.present:
            self._refresh_targets()
        if reporter is not None:
            for key in reported:
                held = reporter.buckets.get(key)
                if held is not None:
                    self._mark(key, held.target)
        changed, self._changed = self._changed, set()
        closes = self._closes
        regions = self._regions
        dirty = None if changed is None else {regions.root(h) for h in changed}
        divided: set[BucketKey] | None = None if dirty is None else set()
        holders: list[Holder] = []
        for s in list(self.streams.values()):
            # (no report changes a stream's buckets meanwhile; a close replaces them)
            for n, (key, b) in enumerate(s.buckets.items(), 1):
                if not n % STEP:
                    yield
                if dirty is not None and divided is not None:
                    if regions.of(key, b.target) not in dirty:
                        continue
                    divided.add(key)
                holders.append(Holder(s.ident, key, b.target, b.demand, s.interval))
            yield
        if self.remote.present:
            holders += self.remote.holders(dirty, self._regions, self._target)
        if self._closes != closes:
            return
        part = yield from allocation(holders)
        yield
        if self._closes != closes:
            return
        if divided is None:
            self.allocation = part
        else:
            self._merge(part, holders)
        self.divisions += 1
        self._divided_at, self._dirty = self.now(), False
        strategies = self.allocation.strategies
        for stream in list(self.streams.values()):
            if self._closes != closes:
                return
            renew = set(reported) if stream is reporter else set()
            actions: list[Action] = list(abandoned) if stream is reporter else []
            ident, ttl = stream.ident, stream.ttl
            for key, held in stream.buckets.items():
                if divided is not None and key not in divided:
                    continue  # its region did not change: its assignment stands
                current = held.strategy
                new = settle(current, strategies[(ident, key)])
                if (new is not current and new != current) or key in renew:
                    held.assign(new)
                    actions.append(Assign(held.bucket, new, ttl))
                    if len(actions) >= STEP:  # a response at a time, each one turn
                        stream.send(actions)
                        actions = []
                        yield
                        if self._closes != closes:
                            return
            if actions:
                stream.send(actions)
            yield

    def _merge(self, part: Allocation, holders: Sequence[Holder]) -> None:
        """Put the division of some regions into the allocation in force."""
        whole = self.allocation
        for h in holders:
            whole.extra.pop((h.stream, h.bucket), None)
        whole.strategies.update(part.strategies)
        whole.levels.update(part.levels)
        whole.headroom.update(part.headroom)
        whole.extra.update(part.extra)

    def _subscriptions(self) -> Streams:
        """Every stream's domain and its buckets' strategies and headroom (for the gauges,
        telemetry/quota.py)."""
        extra = self.allocation.extra
        return [
            (s.domain, [(b.strategy, extra.get((s.ident, k), 0.0)) for k, b in s.buckets.items()])
            for s in self.streams.values()
        ]
