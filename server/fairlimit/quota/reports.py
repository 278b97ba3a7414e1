"""One RLQS usage report taken: each line bounded, its bucket measured (or subscribed), its
allowed usage owed to the store's counters (``usage.py``), idle buckets abandoned, then a
division or, within the division gap, provisional assignments (``divider.py``).

A new bucket past a cap (``Room.full``) is refused: not tracked, its usage neither paid nor
counted, no assignment sent. Envoy then applies the bucket's no_assignment_behavior and
lists it in each periodic report, where it costs a lookup, and is taken like any new bucket
once the stream has room (an AbandonAction would make Envoy forget it and report it afresh
at its next request, one report per request). The stream is not ended: that would drop what
it holds, and Envoy would reopen it and report the same buckets again.
"""

import logging
from collections.abc import Sequence

from fairlimit.core.bucket import BucketKey, bucket_key
from fairlimit.quota.bounds import Room
from fairlimit.quota.divider import Divider
from fairlimit.quota.stream import Abandon, Action, QuotaStream, Subscription, Usage, bounded
from fairlimit.quota.targets import Targets
from fairlimit.quota.usage import UsageLedger
from fairlimit.telemetry.quota import QuotaTelemetry

log = logging.getLogger(__name__)

# A report is taken this many lines at a time, yielding to the event loop in between (a new
# bucket costs about 30 µs: its descriptor, plan and target; a known one a few), and one
# report at a time: twenty streams' reports side by side each ran a chunk in every turn of
# the loop, and an RLS call waited for all of them (240 ms).
CHUNK = 128


class Intake:
    """Takes the reports of every stream (one at a time: the service holds its turn)."""

    def __init__(
        self,
        targets: Targets,
        divider: Divider,
        room: Room,
        ledger: UsageLedger,
        telemetry: QuotaTelemetry,
        abandon_after: float,
    ) -> None:
        self.targets, self.divider, self.room = targets, divider, room
        self.ledger, self.telemetry, self.abandon_after = ledger, telemetry, abandon_after

    async def take(
        self, stream: QuotaStream, domain: str, usages: Sequence[Usage], now: float
    ) -> None:
        """CHUNK lines at a time (a stream closed meanwhile takes the rest no further)."""
        since = stream.last_report
        stream.observe(now)
        stream.domain = domain or stream.domain
        if self.targets.refresh(self.divider.streams.values()):
            self.divider.remote.targets.clear()
            self.divider.changed = None
        span = None if since is None else now - since
        buckets, interval, ident = stream.buckets, stream.interval, stream.ident
        reported: list[BucketKey] = []
        renewing: list[Subscription] = []
        allowed = denied = 0  # as counted
        refused: dict[str, int] = {}
        pause = self.divider.pace.pause
        for n, line in enumerate(usages):
            if n and not n % CHUNK:
                await pause()
                if stream.closed:
                    return
            key = bucket_key(line.bucket)
            held = buckets.get(key)
            if held is None and (cap := self.room.full(stream)) is not None:
                refused[cap] = refused.get(cap, 0) + 1
                continue
            usage = bounded(line, held, span)
            if usage is not line and not stream.warned:
                stream.warned = True
                log.warning("RLQS: stream %d reported more requests than it can have let"
                            " through (counted as at most %d allowed, %d denied)",
                            ident, usage.allowed, usage.denied)  # fmt: skip
            if held is None:
                held = buckets[key] = Subscription(usage.bucket, now)
                self.targets.resolve(stream.domain, key, held)
                self.room.took()
            else:
                held.measure(usage.allowed + usage.denied, now, interval)
                held.start_span()
            allowed, denied = allowed + usage.allowed, denied + usage.denied
            held.allowed += usage.allowed
            held.denied += usage.denied
            if held.entries is not None and usage.allowed > 0:
                self.ledger.owe((ident, key), stream.domain, held.entries, usage.allowed,
                                interval)  # fmt: skip
            reported.append(key)
            renewing.append(held)
        self.room.refuse(stream, refused, self.telemetry)
        self.telemetry.reported(stream.domain, allowed, denied)
        # Only a periodic report lists every bucket; scanning on each subscription (a report
        # of one new bucket) would cost O(buckets) per new client.
        full = len(usages) >= len(buckets)
        abandoned = self._abandon_idle(stream, now) if full else []
        if self.divider.due(now):
            await self.divider.divide_yielding(stream, reported, abandoned, renewing)
        else:
            self.divider.provisional(stream, reported, abandoned)

    def _abandon_idle(self, stream: QuotaStream, now: float) -> list[Action]:
        idle = [k for k, b in stream.buckets.items() if now - b.active_at >= self.abandon_after]
        out: list[Action] = []
        for key in idle:
            held = stream.buckets.pop(key)
            self.divider.mark(key, held.target)  # its region re-divides without it
            held.row = -1  # in no table from now on (it may be in the report's renewals)
            out.append(Abandon(held.bucket))
        self.room.dropped(len(idle))
        return out
