"""RLS demand at fair-share caps, tallied for the RLQS division (quota/peers.py).

An RLQS division shares a cap among the Envoys' buckets; RLS requests at the same cap must
count there too. The limiter adds each RLS request's hits (admitted or not) per descriptor
under a cap while ``on`` (the quota service turns it on while any RLQS stream or peer is
there); the quota service takes the tally every exchange and turns it into rates. Keyed by
the descriptor's entries as an RLQS bucket id (``core.bucket.bucket_key``), so an RLS client
and the RLQS bucket of the same descriptor are one bucket in the division.
"""

from fairlimit.core.bucket import BucketKey, bucket_key
from fairlimit.core.plan import Plan
from fairlimit.core.request import Request


class Tally:
    """Hits asked per (domain, bucket) since the last ``take``."""

    __slots__ = ("counts", "on")

    def __init__(self) -> None:
        self.on = False
        self.counts: dict[tuple[str, BucketKey], int] = {}

    def add(self, request: Request, plan: Plan) -> None:
        """Count ``request``'s descriptors that charge a fair-share cap (not shadowed)."""
        for descriptor, dplan in zip(request.descriptors, plan.descriptors, strict=True):
            if any(c.share is not None and not plan.shares[c.share].shadow
                   for c in dplan.charges):  # fmt: skip
                key = (request.domain, bucket_key(dict(descriptor.entries)))
                self.counts[key] = self.counts.get(key, 0) + request.hits_for(descriptor)

    def take(self) -> dict[tuple[str, BucketKey], int]:
        """The tally so far; it starts over."""
        counts, self.counts = self.counts, {}
        return counts
