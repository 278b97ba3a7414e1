"""What governs each RLQS bucket under the rules in force: its descriptor entries, its
``Target`` (its own limit and the caps above it), its region (buckets linked by caps) and its
row in the division's table (``division.Table``). A reload maps every bucket again."""

from collections.abc import Callable, Iterable, Mapping

from fairlimit.core.bucket import BucketKey, entries_for
from fairlimit.core.matching import Entry, Matcher
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.quota import Blanket, Regions, Target, target_of
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Loaded
from fairlimit.quota.division import Table
from fairlimit.quota.stream import QuotaStream, Subscription

# The table is made again from the buckets held once it has this many rows and more than
# twice theirs (rows of buckets gone stay until then: clients churn).
COMPACT_FROM = 1024


class Targets:
    """The rules in force as the quota service reads them, and what they make of buckets."""

    def __init__(self, loaded: Callable[[], Loaded], shadow: bool) -> None:
        self._source = loaded
        self.shadow = shadow  # every bucket allowed (counted and paid all the same)
        self._loaded: Loaded | None = None
        self.matcher: Matcher | None = None
        self.regions = Regions()
        self.table = Table()

    def refresh(self, streams: Iterable[QuotaStream]) -> bool:
        """After a config reload, every bucket of ``streams`` is mapped again under the new
        rules (regions and rows afresh); True when it was."""
        loaded = self._source()
        if loaded is self._loaded:
            return False
        self._loaded, self.matcher = loaded, Matcher(loaded.config)
        self.regions, self.table = Regions(), Table()
        for stream in streams:
            for key, held in stream.buckets.items():
                self.resolve(stream.domain, key, held)
        return True

    def compact(self, streams: Iterable[QuotaStream], remote: int) -> None:
        """Make the table again from the buckets of ``streams`` when most of its rows are
        of buckets gone (``remote``: the buckets of other processes, rowed at divisions)."""
        streams = list(streams)
        held = sum(len(s.buckets) for s in streams)
        if len(self.table) < COMPACT_FROM or len(self.table) <= 2 * (held + remote):
            return
        self.table = table = Table()
        for stream in streams:
            for key, b in stream.buckets.items():
                b.row = table.row(key, b.target)

    def resolve(self, domain: str, key: BucketKey, held: Subscription) -> None:
        held.entries, held.target = self.governing(domain, held.bucket)
        held.row = self.table.row(key, held.target)

    def governing(
        self, domain: str, bucket: Mapping[str, str]
    ) -> tuple[tuple[Entry, ...] | None, Target]:
        """A bucket's descriptor entries and target under the rules in force (its caps
        linked in the regions)."""
        assert self._loaded is not None and self.matcher is not None
        entries = entries_for(self._loaded.config.domains.get(domain), bucket)
        if entries is None or self.shadow:
            return entries, Target(Blanket.ALLOW_ALL)
        request = Request(domain, (Descriptor(entries, None, 1),))
        target = target_of(make_plan(request, self.matcher))
        self.regions.add(target)
        return entries, target

    def target(self, domain: str, bucket: Mapping[str, str]) -> Target:
        return self.governing(domain, bucket)[1]
