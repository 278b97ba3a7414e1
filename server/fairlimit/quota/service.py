"""RLQS streams: usage reports -> demand, fair token-bucket assignments, and usage owed.

Each Envoy holds one stream. A report owes the usage Envoy already allowed to the store's
counters (``usage.py`` pays it), measures each bucket's demand over the span since its last
measurement, and re-divides every cap among all streams' buckets (``core/quota.py``).
The reporting stream gets an assignment for every bucket it reported (which renews their
TTL); any other stream gets the assignments that changed. A bucket reported with no requests
for ``abandon_after`` seconds is abandoned; a closed stream's buckets leave the division at
once. The other processes sharing the store take part in every division with their
buckets' demand (``peers.py``).

Inputs are bounded: a stream holds at most ``max_buckets_per_stream`` buckets and the process
``max_buckets`` subscriptions (a stream's bucket); a new bucket past either is refused (no
assignment, not tracked: see ``QuotaService.report``). Reports are taken one at a time,
CHUNK lines at a time, and divisions and the peers' exchange in steps, pausing between
them (``_pause``), so that RLS calls are answered while thousands of buckets arrive; and a
closed stream leaves nothing behind.
"""

import asyncio
import gc
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fairlimit.core.bucket import BucketKey, bucket_key, entries_for
from fairlimit.core.matching import Entry, Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.quota import (
    STEP,
    Allocation,
    Blanket,
    CapClaim,
    Holder,
    Regions,
    Strategy,
    Target,
    TokenBucket,
    allocation,
    provisional,
    settle,
)
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Loaded
from fairlimit.core.tally import Tally
from fairlimit.errors import StoreUnavailable
from fairlimit.quota import peers
from fairlimit.quota.usage import UsageLedger
from fairlimit.store.base import Store
from fairlimit.store.degraded import Replicas
from fairlimit.store.memory import trim_malloc
from fairlimit.telemetry.quota import QuotaFigures, QuotaTelemetry

log = logging.getLogger(__name__)

ABANDON_AFTER = 60.0  # seconds a bucket may report no requests before it is abandoned
# Envoy 1.40's RLQS client reports every 5 s whatever the buckets' reporting_interval says
# (a hard-coded interval in its filter_persistence.cc); a stream is taken to report at least
# that slowly until SPACINGS reports have measured its real interval.
DEFAULT_INTERVAL = 5.0
SPACINGS = 8
MIN_SPAN = 0.5  # a demand is measured over at least half a reporting interval
TTL_INTERVALS = 3  # an assignment outlives two missed reports
# A usage line counts at most this many requests of each kind (Envoy sends uint64s): no
# Envoy lets four billion requests through one bucket in one report, and counts past int64
# would overflow the counters (a Redis payment failing takes the domain's others with it).
MAX_REPORTED = 2**32 - 1
# Under a token bucket, a report counts as allowed at most what the bucket can have let
# through since the last report, with this much slack (assignments change as they land).
ALLOWED_SLACK = 2.0
# At most this many buckets a stream, and subscriptions (a stream's bucket) a process
# (--rlqs-max-buckets-per-stream, --rlqs-max-buckets). A division of one cap over
# MAX_BUCKETS holders takes about 40 ms on the event loop (bench/quota_division.py), one
# Envoy cannot take more than a tenth of a process's room, and 20,000 buckets on one stream
# took 60 MB and stalled the server for seconds.
MAX_BUCKETS_PER_STREAM = 1000
MAX_BUCKETS = 10_000
# A report is taken this many lines at a time, yielding to the event loop in between (a new
# bucket costs about 30 µs: its descriptor, plan and target; a known one a few), and one
# report at a time: twenty streams' reports side by side each ran a chunk in every turn of
# the loop, and an RLS call waited for all of them (240 ms).
CHUNK = 128
# Once the subscriptions fall to a quarter of their high mark, and that mark was at least
# this many, the next drip hands the freed memory back to the system (a full collection,
# then malloc_trim), as the memory store does after a spike of clients.
RELEASE_FROM = 1000
# Between those steps, RLQS work pauses for PAUSE seconds once it has run for SLICE (in wall
# time, since its last pause): an RLS call takes several turns of the event loop, and with
# a step in every turn it waited for several steps. bench/rlqs_buckets.py, 20 streams
# filling 10,000 buckets, RLS p99 during the arrival: 163-254 ms with 1 ms every 4 ms,
# 80-103 ms with 2 ms every 2 ms, the arrival as long (the machine's CPU bounds it).
SLICE = 0.002
PAUSE = 0.002
EXCHANGE_PART = 1000  # buckets of the peers' report encoded at a time (see exchange)
# A close divides at once while this process holds at most this many subscriptions (remote
# ones included: about 10 ms); beyond, in steps (_divide_yielding) in a task of its own: the
# close of one of 20 streams holding 10,000 held the event loop 60-90 ms.
SYNC_DIVISION = 2000
# The caps a new bucket can be refused at, and the flags that set them.
CAP_FLAGS = {"stream": "--rlqs-max-buckets-per-stream", "process": "--rlqs-max-buckets"}


@dataclass(frozen=True, slots=True)
class Usage:
    """One bucket's line of a usage report."""

    bucket: Mapping[str, str]
    allowed: int
    denied: int


@dataclass(frozen=True, slots=True)
class Assign:
    """Apply ``strategy`` to the bucket for ``ttl`` whole seconds."""

    bucket: Mapping[str, str]
    strategy: Strategy
    ttl: int


@dataclass(frozen=True, slots=True)
class Abandon:
    """The server stops tracking the bucket; Envoy forgets it."""

    bucket: Mapping[str, str]


Action = Assign | Abandon
Send = Callable[[Sequence[Action]], None]


class _Bucket:
    """One stream's subscription to one bucket."""

    __slots__ = ("active_at", "allowed", "bucket", "counted", "demand", "denied", "entries",
                 "peak", "since", "strategy", "target")  # fmt: skip

    def __init__(self, bucket: Mapping[str, str], now: float) -> None:
        self.bucket = dict(bucket)
        self.entries: tuple[Entry, ...] | None = None
        self.target = Target(Blanket.ALLOW_ALL)
        self.demand: float | None = None
        self.counted = 0  # requests since ``since``, not yet turned into a demand
        self.since = now
        self.active_at = now
        self.strategy: Strategy | None = None  # the one in force at the Envoy
        # the most the strategies in force since the last report let through: (rate,
        # depth) of the largest token bucket, an infinite rate once a blanket rule was among
        # them; None before the first
        self.peak: tuple[float, int] | None = None
        self.allowed = self.denied = 0  # totals, for /rlconfig

    def assign(self, strategy: Strategy) -> None:
        """``strategy`` is sent to the Envoy (and in force there from now on)."""
        self.strategy = strategy
        rate, depth = _most(strategy)
        if self.peak is not None:
            rate, depth = max(rate, self.peak[0]), max(depth, self.peak[1])
        self.peak = (rate, depth)

    def start_span(self) -> None:
        """A report came: the next span starts under the strategy in force."""
        self.peak = None if self.strategy is None else _most(self.strategy)

    def measure(self, requests: int, now: float, interval: float) -> None:
        """Add a report's requests; a span of half an interval or more makes a demand."""
        self.counted += requests
        if requests:
            self.active_at = now
        span = now - self.since
        if span >= MIN_SPAN * interval:
            self.demand = self.counted / span
            self.counted, self.since = 0, now


class QuotaStream:
    """One Envoy's RLQS stream: its domain, reporting interval and buckets."""

    def __init__(self, service: "QuotaService", ident: int, send: Send) -> None:
        self.service, self.ident, self.send = service, ident, send
        self.domain = ""
        self.buckets: dict[BucketKey, _Bucket] = {}
        self.interval = DEFAULT_INTERVAL
        self._spacings: list[float] = []
        self._last: float | None = None
        self.warned = False  # a report past what it could have let through was logged
        self.closed = False
        self.refused = 0  # new buckets its last report had refused at a cap
        self.told: set[str] = set()  # the caps (CAP_FLAGS) whose refusal was logged

    @property
    def last_report(self) -> float | None:
        return self._last

    async def report(self, domain: str, usages: Sequence[Usage]) -> None:
        """Take one usage report; sends this stream's (and others') assignments."""
        await self.service.report(self, domain, usages)

    def close(self) -> None:
        """The stream ended: its buckets leave the division."""
        self.service.close(self)

    def observe(self, now: float) -> None:
        """Estimate the reporting interval: the longest of the last SPACINGS spacings (Envoy
        also sends an immediate report per new bucket, between its periodic ones)."""
        if self._last is not None and now > self._last:
            self._spacings = [*self._spacings[1 - SPACINGS :], now - self._last]
            longest = max(self._spacings)
            full = len(self._spacings) >= SPACINGS
            self.interval = longest if full else max(longest, DEFAULT_INTERVAL)
        self._last = now

    @property
    def ttl(self) -> int:
        return max(2, math.ceil(TTL_INTERVALS * self.interval))


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
        self.max_buckets_per_stream, self.max_buckets = max_buckets_per_stream, max_buckets
        self.held = 0  # subscriptions: the buckets of every stream
        self._high = 0  # the most held since the memory was last handed back
        self._release = False  # the next drip hands the freed memory back
        self._turn = asyncio.Lock()  # one report (or put-off division) at a time (see CHUNK)
        self._closes = 0  # streams closed so far (a division in steps checks it)
        self._paused_at = 0.0  # perf_counter() at the end of RLQS work's last pause
        self._tasks: set[asyncio.Task[None]] = set()  # divisions put off by a close
        self.ledger = UsageLedger(store)
        self.allocation = Allocation({}, {}, {}, {})
        self._next = 0
        self._loaded: Loaded | None = None
        self._matcher: Matcher | None = None
        # The other processes on this store (peers.py): their reports, when they were last
        # read, and the targets of their buckets under this process's rules.
        self.consumer = consumer or uuid.uuid4().hex[:12]
        self.peers: dict[str, peers.Report] = {}
        # RLS demand at caps: the limiter's tally (on while RLQS is in use), as rates
        self.tally = tally
        # the processes an exchange saw, for --failure-mode local (store/degraded.py)
        self.replicas = replicas
        self._rls: list[peers.PeerBucket] = []
        self._tallied_at: float | None = None
        self._remote = peers.remote_counts({})
        self._exchanged_at: float | None = None
        self._peers_seen_at = -math.inf
        self._remote_targets: dict[tuple[str, BucketKey], Target] = {}
        self._figured: tuple[float, QuotaFigures] | None = None
        # Incremental divisions: the regions (buckets linked by caps) a report changed since
        # the last division; None: every region (the first one, a reload, a closed stream,
        # the peers' reports or the RLS demand changed).
        self._regions = Regions()
        self._changed: set[object] | None = None
        self.telemetry.source = self._figures

    def open(self, send: Send) -> QuotaStream:
        self._next += 1
        stream = QuotaStream(self, self._next, send)
        self.streams[stream.ident] = stream
        if self.tally is not None:
            self.tally.on = True  # RLS demand at caps counts in the division from now
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
        self._dropped(len(stream.buckets))
        stream.buckets = {}
        self._figured = None
        self._changed, self._dirty = None, True
        if not self._due(self.now()):
            return  # the next drip divides
        if self.held + len(self._remote) <= SYNC_DIVISION:
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

    def _dropped(self, count: int) -> None:
        """``count`` subscriptions went: after a large fall, the next drip hands the memory
        back."""
        self.held -= count
        if self._high >= RELEASE_FROM and self.held * 4 < self._high:
            self._release = True

    def _release_memory(self) -> None:
        """Hand the memory of the subscriptions gone back: Python's free lists emptied (a
        freed object left in a 1 MiB arena pins it), then glibc's free pages."""
        gc.collect()
        trim_malloc()
        self._high, self._release = self.held, False

    async def _pause(self) -> None:
        """Between two steps of RLQS work: let the event loop turn, and pause for PAUSE
        once the work has run for SLICE (only the pace depends on the time read here)."""
        if time.perf_counter() - self._paused_at < SLICE:
            await asyncio.sleep(0)
            return
        await asyncio.sleep(PAUSE)
        self._paused_at = time.perf_counter()

    def _full(self, stream: QuotaStream) -> str | None:
        """The cap (a CAP_FLAGS key) a new bucket of ``stream`` is refused at, if any."""
        if len(stream.buckets) >= self.max_buckets_per_stream:
            return "stream"
        if self.held >= self.max_buckets:
            return "process"
        return None

    def _refuse(self, stream: QuotaStream, refused: Mapping[str, int]) -> None:
        """Count the new buckets a report had refused at each cap; log the first refusal of
        each cap on the stream."""
        stream.refused = sum(refused.values())
        for cap, count in refused.items():
            self.telemetry.refused(stream.domain, cap, count)
            if cap in stream.told:
                continue
            stream.told.add(cap)
            limit = self.max_buckets_per_stream if cap == "stream" else self.max_buckets
            where = "buckets a stream" if cap == "stream" else "buckets over this process's streams"
            log.warning("RLQS: stream %d (domain %r) reported new buckets past the cap of %d %s"
                        " (%s): %d of this report refused; they get no assignment, so Envoy"
                        " applies their no_assignment_behavior, and are taken when reported"
                        " again with room. Logged once per stream; fairlimit.rlqs.refused_buckets"
                        " counts each", stream.ident, stream.domain, limit, where,
                        CAP_FLAGS[cap], count)  # fmt: skip

    async def report(self, stream: QuotaStream, domain: str, usages: Sequence[Usage]) -> None:
        """Take one usage report, after those before it, CHUNK lines at a time (yielding to
        the event loop between them; a stream closed meanwhile takes the rest no further).

        A new bucket past a cap (``_full``) is refused: not tracked, its usage neither paid
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
                await self._pause()
                if stream.closed:
                    return
            key = bucket_key(line.bucket)
            held = stream.buckets.get(key)
            if held is None and (cap := self._full(stream)) is not None:
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
                held = stream.buckets[key] = _Bucket(usage.bucket, now)
                self._resolve(stream.domain, held)
                self.held += 1
                self._high = max(self._high, self.held)
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
        self._refuse(stream, refused)
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
        if self._release and not self._dirty:
            self._release_memory()

    async def exchange(self) -> None:
        """Every EXCHANGE_SECONDS: hand the store this process's report, read the others'
        (peers.py); a change in them divides at the next drip. Unreachable, the store's
        last reports count until PEER_TTL has passed since they were read."""
        now = self.now()
        if self._exchanged_at is not None and now - self._exchanged_at < peers.EXCHANGE_SECONDS:
            return
        self._exchanged_at = now
        self._take_tally(now)
        # A stream, then EXCHANGE_PART buckets, at a time: a report of 10,000 held the event
        # loop 50-120 ms in one go.
        totals: peers.Totals = {}
        for s in list(self.streams.values()):
            held = list(s.buckets.items())
            for first in range(0, len(held), EXCHANGE_PART):
                part = held[first : first + EXCHANGE_PART]
                peers.add_held(totals, (peers.Held(s.domain, key, b.demand, s.interval)
                                        for key, b in part if b.entries is not None))  # fmt: skip
                await self._pause()
        summed = list(totals.values())
        parts = []
        for first in range(0, len(summed), EXCHANGE_PART):
            parts.append(peers.encode_rows(summed[first : first + EXCHANGE_PART]))
            await self._pause()
        report = peers.assemble(parts, self._rls)
        try:
            texts = await self.store.exchange_demand(self.consumer, report, now, peers.PEER_TTL)
        except StoreUnavailable as exc:
            log.debug("RLQS demand not exchanged: %s", exc)
            if self.peers and now - self._peers_seen_at >= peers.PEER_TTL:
                self._take_peers({})
            return
        if self.replicas is not None:
            self.replicas.saw(self.consumer, texts)
        found: dict[str, peers.Report] = {}
        for consumer, text in texts.items():
            await self._pause()
            try:
                found[consumer] = peers.decode(text)
            except ValueError as exc:
                log.warning("RLQS: the demand report of %s is unreadable: %s", consumer, exc)
        self._peers_seen_at = now
        self._take_peers(found)

    def _take_peers(self, found: dict[str, peers.Report]) -> None:
        if found != self.peers:
            self.peers, self._remote = found, peers.remote_counts(found)
            self._dirty, self._changed = True, None
            self._prune_remote()

    def _take_tally(self, now: float) -> None:
        """This process's RLS demand at caps since the last exchange, as rates; the tally
        stays on while RLQS is in use here or by a peer."""
        if self.tally is None:
            return
        since, self._tallied_at = self._tallied_at, now
        counts = self.tally.take()
        rls = [] if since is None else peers.rls_demand(counts, now - since)
        if rls != self._rls:
            self._rls, self._dirty, self._changed = rls, True, None
            self._prune_remote()
        self.tally.on = bool(self.streams or self.peers)

    def _remote_holders(self, dirty: set[object] | None) -> list[Holder]:
        """The other processes' buckets, and every process's RLS demand at caps, as holders
        of streams not here (negative ids): counted in the division, assigned nothing (those
        of the ``dirty`` regions only, unless None)."""
        out: list[Holder] = []
        ident = 0
        for buckets in self._remote_sources():
            for b in buckets:
                target = self._remote_target(b.domain, b.bucket)
                if target.blanket is not None:
                    continue
                if dirty is not None and self._regions.of(b.bucket, target) not in dirty:
                    continue
                part = None if b.demand is None else b.demand / b.holders
                for _ in range(b.holders):
                    ident -= 1
                    out.append(Holder(ident, b.bucket, target, part, b.interval))
        return out

    def _remote_sources(self) -> list[list[peers.PeerBucket]]:
        return [self._rls, *(r.buckets for r in self.peers.values()),
                *(r.rls for r in self.peers.values())]  # fmt: skip

    def _prune_remote(self) -> None:
        """Forget the targets of remote buckets no longer reported (the remote buckets
        churn: kept, the table would grow with every client ever seen)."""
        live = {(b.domain, b.bucket) for source in self._remote_sources() for b in source}
        if len(self._remote_targets) > 2 * len(live) + 64:
            self._remote_targets = {k: t for k, t in self._remote_targets.items() if k in live}

    def _remote_target(self, domain: str, bucket: BucketKey) -> Target:
        found = self._remote_targets.get((domain, bucket))
        if found is None:
            _, found = self._governing(domain, dict(bucket))
            self._remote_targets[(domain, bucket)] = found
        return found

    def _abandon_idle(self, stream: QuotaStream, now: float) -> list[Action]:
        idle = [k for k, b in stream.buckets.items() if now - b.active_at >= self.abandon_after]
        out: list[Action] = []
        for key in idle:
            held = stream.buckets.pop(key)
            self._mark(key, held.target)  # its region re-divides without it
            self.allocation.strategies.pop((stream.ident, key), None)
            self.allocation.extra.pop((stream.ident, key), None)
            out.append(Abandon(held.bucket))
        self._dropped(len(idle))
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
        self._remote_targets.clear()
        self._regions, self._changed = Regions(), None
        for stream in self.streams.values():
            for held in stream.buckets.values():
                self._resolve(stream.domain, held)

    def _resolve(self, domain: str, held: _Bucket) -> None:
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
                holders += self._remote.get(key, 0)
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
            await self._pause()

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
        if self.peers or self._rls:
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
        if self.peers or self._rls:
            holders += self._remote_holders(dirty)
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

    def describe(self) -> dict[str, Any]:
        """The RLQS state as plain data (for /rlconfig): every stream's buckets, what each
        was assigned and reported, and each cap's water level and headroom."""
        return {
            "streams": [self._describe_stream(s) for s in self.streams.values()],
            "buckets": {
                "held": self.held,
                "max_per_stream": self.max_buckets_per_stream,
                "max": self.max_buckets,
            },
            "caps": {
                cap: {
                    "fair_share_level_per_second": None if math.isinf(level) else level,
                    "headroom_per_second": self.allocation.headroom.get(cap, 0.0),
                }
                for cap, level in sorted(self.allocation.levels.items())
            },
        }

    def _describe_stream(self, stream: QuotaStream) -> dict[str, Any]:
        return {
            "stream": stream.ident,
            "domain": stream.domain,
            "reporting_interval_seconds": stream.interval,
            "assignment_ttl_seconds": stream.ttl,
            "buckets_refused_in_last_report": stream.refused,
            "buckets": [
                {
                    "bucket": dict(held.bucket),
                    "descriptor": None
                    if held.entries is None
                    else "/".join(f"{k}={v}" for k, v in held.entries),
                    "demand_per_second": held.demand,
                    "assignment": _describe_strategy(held.strategy),
                    "requests_allowed": held.allowed,
                    "requests_denied": held.denied,
                }
                for held in stream.buckets.values()
            ],
        }

    def _figures(self) -> QuotaFigures:
        """The gauges' figures as the state stands (worked out when they are read, at most
        once a second: a scan of every subscription)."""
        now = self.now()
        if self._figured is not None and now - self._figured[0] < 1.0:
            return self._figured[1]
        buckets: dict[str, int] = {}
        rates: dict[str, float] = {}
        headroom: dict[str, float] = {}
        for stream in self.streams.values():
            domain = stream.domain
            buckets[domain] = buckets.get(domain, 0) + len(stream.buckets)
            for key, held in stream.buckets.items():
                strategy = held.strategy
                if not isinstance(strategy, TokenBucket):
                    continue
                rates[domain] = rates.get(domain, 0.0) + strategy.rate
                extra = self.allocation.extra.get((stream.ident, key), 0.0)
                headroom[domain] = headroom.get(domain, 0.0) + extra
        figures = QuotaFigures(len(self.streams), buckets, rates, headroom)
        self._figured = (now, figures)
        return figures


def _describe_strategy(strategy: Strategy | None) -> dict[str, Any] | None:
    if strategy is None:
        return None
    if isinstance(strategy, Blanket):
        return {"blanket_rule": strategy.name}
    return {
        "token_bucket": {
            "rate_per_second": strategy.rate,
            "max_tokens": strategy.max_tokens,
            "tokens_per_fill": strategy.tokens_per_fill,
            "fill_interval_seconds": strategy.fill_seconds,
        }
    }


def bounded(usage: Usage, held: "_Bucket | None", span: float | None) -> Usage:
    """``usage`` with its counts bounded: each at most MAX_REPORTED; when only token buckets
    were sent for the bucket since its last report, ``span`` seconds ago, the allowed ones
    at most what the largest of them can have let through (ALLOWED_SLACK times its rate
    times the span and its depth). The usage itself when nothing is cut."""
    allowed = min(usage.allowed, MAX_REPORTED)
    denied = min(usage.denied, MAX_REPORTED)
    if span is not None and held is not None and held.peak is not None:
        rate, depth = held.peak
        if not math.isinf(rate):
            allowed = min(allowed, math.ceil(ALLOWED_SLACK * (rate * span + depth)))
    if allowed == usage.allowed and denied == usage.denied:
        return usage
    return Usage(usage.bucket, allowed, denied)


def _most(strategy: Strategy) -> tuple[float, int]:
    """(rate, depth): the most ``strategy`` lets through; a blanket rule, without bound."""
    if isinstance(strategy, TokenBucket):
        return strategy.rate, strategy.max_tokens
    return math.inf, 0


def target_of(plan: Plan) -> Target:
    """What governs a bucket, from the plan of one request in it: its own limit (per
    second) and the fair-share caps above it; shadow-mode levels restrict nothing."""
    dplan = plan.descriptors[0]
    if dplan.unlimited or not dplan.charges:
        return Target(Blanket.ALLOW_ALL)
    limit = math.inf
    caps: list[CapClaim] = []
    for charge in dplan.charges:
        counter = plan.counters[charge.counter]
        if charge.share is None:
            if not counter.shadow:
                limit = min(limit, counter.limit / counter.window)
            continue
        share = plan.shares[charge.share]
        if share.shadow:
            continue
        per = share.window
        caps.append(CapClaim(share.cap, share.client, share.capacity / per,
                             share.client_limit / per, share.weight))  # fmt: skip
    if limit <= 0 or any(c.capacity <= 0 for c in caps):
        return Target(Blanket.DENY_ALL)
    if math.isinf(limit) and not caps:
        return Target(Blanket.ALLOW_ALL)
    return Target(None, limit, tuple(caps))
