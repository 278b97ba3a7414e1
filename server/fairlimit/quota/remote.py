"""What this process's RLQS division counts besides its own streams (see ``peers.py``).

The other processes' buckets (their reports, traded through the store every
``EXCHANGE_SECONDS``) and every process's RLS demand at fair-share caps (the limiter's
tally, as rates): holders of streams not here, counted in the division and assigned nothing.
Kept apart from the service's streams; an exchange says whether what it counts changed.
"""

import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence

from fairlimit.core.bucket import BucketKey
from fairlimit.core.quota import Holder, Regions, Target
from fairlimit.core.tally import Tally
from fairlimit.errors import StoreUnavailable
from fairlimit.quota import peers
from fairlimit.quota.stream import QuotaStream
from fairlimit.store.base import Store
from fairlimit.store.replicas import Replicas

log = logging.getLogger(__name__)

EXCHANGE_PART = 1000  # buckets of the peers' report encoded at a time (see exchange)
# A bucket's target under the rules in force, from its domain and bucket id (the service's).
Governing = Callable[[str, Mapping[str, str]], Target]


class Remote:
    """The peers' reports and the RLS demand, as the division counts them."""

    def __init__(
        self, store: Store, consumer: str, tally: Tally | None, replicas: Replicas | None
    ) -> None:
        self.store = store
        self.consumer = consumer  # this process's name in the exchange
        self.tally = tally  # RLS demand at caps (on while RLQS is in use), as rates
        self.replicas = replicas  # the processes an exchange saw, for --failure-mode local
        self.peers: dict[str, peers.Report] = {}
        self.rls: list[peers.PeerBucket] = []
        self.counts = peers.remote_counts({})  # streams elsewhere holding each bucket
        # the targets of remote buckets under this process's rules
        self.targets: dict[tuple[str, BucketKey], Target] = {}
        self._tallied_at: float | None = None
        self._exchanged_at: float | None = None
        self._peers_seen_at = -math.inf

    @property
    def present(self) -> bool:
        """Whether the division has anything of theirs to count."""
        return bool(self.peers or self.rls)

    async def exchange(
        self, now: float, streams: Sequence[QuotaStream], pause: Callable[[], Awaitable[None]]
    ) -> bool:
        """Every EXCHANGE_SECONDS: hand the store this process's report, read the others';
        True when what the division counts changed. Unreachable, the store's last reports
        count until PEER_TTL has passed since they were read. ``pause`` between steps."""
        if self._exchanged_at is not None and now - self._exchanged_at < peers.EXCHANGE_SECONDS:
            return False
        self._exchanged_at = now
        changed = self._take_tally(now, bool(streams))
        # A stream, then EXCHANGE_PART buckets, at a time: a report of 10,000 held the event
        # loop 50-120 ms in one go.
        totals: peers.Totals = {}
        for s in streams:
            h = s.holdings  # read as arrays: a property read per bucket cost 0.2 µs each
            subs, keys = list(h.subs), list(h.keys)
            demand = [None if math.isnan(d) else d for d in h.demand[: h.size].tolist()]
            for first in range(0, len(subs), EXCHANGE_PART):
                part = range(first, min(first + EXCHANGE_PART, len(subs)))
                peers.add_held(totals, (peers.Held(s.domain, keys[i], demand[i], s.interval)
                                        for i in part if subs[i].entries is not None))  # fmt: skip
                await pause()
        summed = list(totals.values())
        parts = []
        for first in range(0, len(summed), EXCHANGE_PART):
            parts.append(peers.encode_rows(summed[first : first + EXCHANGE_PART]))
            await pause()
        report = peers.assemble(parts, self.rls)
        try:
            texts = await self.store.exchange_demand(self.consumer, report, now, peers.PEER_TTL)
        except StoreUnavailable as exc:
            log.debug("RLQS demand not exchanged: %s", exc)
            if self.peers and now - self._peers_seen_at >= peers.PEER_TTL:
                changed = self._take_peers({}) or changed
            return changed
        if self.replicas is not None:
            self.replicas.saw(self.consumer, texts)
        found: dict[str, peers.Report] = {}
        for consumer, text in texts.items():
            await pause()
            try:
                found[consumer] = peers.decode(text)
            except ValueError as exc:
                log.warning("RLQS: the demand report of %s is unreadable: %s", consumer, exc)
        self._peers_seen_at = now
        return self._take_peers(found) or changed

    def _take_peers(self, found: dict[str, peers.Report]) -> bool:
        if found == self.peers:
            return False
        self.peers, self.counts = found, peers.remote_counts(found)
        self._prune()
        return True

    def _take_tally(self, now: float, streams: bool) -> bool:
        """This process's RLS demand at caps since the last exchange, as rates; the tally
        stays on while RLQS is in use here (``streams``) or by a peer."""
        if self.tally is None:
            return False
        since, self._tallied_at = self._tallied_at, now
        counts = self.tally.take()
        rls = [] if since is None else peers.rls_demand(counts, now - since)
        changed = rls != self.rls
        if changed:
            self.rls = rls
            self._prune()
        self.tally.on = streams or bool(self.peers)
        return changed

    def holders(
        self, dirty: set[object] | None, regions: Regions, governing: Governing
    ) -> list[Holder]:
        """The other processes' buckets, and every process's RLS demand at caps, as holders
        of streams not here (negative ids): counted in the division, assigned nothing (those
        of the ``dirty`` regions only, unless None)."""
        out: list[Holder] = []
        ident = 0
        for buckets in self._sources():
            for b in buckets:
                target = self._target(b.domain, b.bucket, governing)
                if target.blanket is not None:
                    continue
                if dirty is not None and regions.of(b.bucket, target) not in dirty:
                    continue
                part = None if b.demand is None else b.demand / b.holders
                for _ in range(b.holders):
                    ident -= 1
                    out.append(Holder(ident, b.bucket, target, part, b.interval))
        return out

    def _sources(self) -> list[list[peers.PeerBucket]]:
        return [self.rls, *(r.buckets for r in self.peers.values()),
                *(r.rls for r in self.peers.values())]  # fmt: skip

    def _prune(self) -> None:
        """Forget the targets of remote buckets no longer reported (the remote buckets
        churn: kept, the table would grow with every client ever seen)."""
        live = {(b.domain, b.bucket) for source in self._sources() for b in source}
        if len(self.targets) > 2 * len(live) + 64:
            self.targets = {k: t for k, t in self.targets.items() if k in live}

    def _target(self, domain: str, bucket: BucketKey, governing: Governing) -> Target:
        found = self.targets.get((domain, bucket))
        if found is None:
            found = self.targets[(domain, bucket)] = governing(domain, dict(bucket))
        return found
