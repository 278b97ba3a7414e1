"""One Envoy's RLQS stream as the quota service keeps it: its reporting interval and buckets.

Plain state and the arithmetic on it (the interval from the reports' spacing, a bucket's
demand over a span, the most a report may count as allowed); what to assign and when is
the service's (``service.py``). A stream neither calls the service nor is called back by it:
the service reads and updates it, and hands what to send to ``send``.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fairlimit.core.bucket import BucketKey
from fairlimit.core.quota import Strategy
from fairlimit.quota.holdings import MIN_SPAN, Counts, Holdings, Ints, Subscription

__all__ = ["MIN_SPAN", "Abandon", "Action", "Assign", "QuotaStream", "Send", "Subscription",
           "Usage", "bounded", "bounded_counts"]  # fmt: skip

# Envoy 1.40's RLQS client reports every 5 s whatever the buckets' reporting_interval says
# (a hard-coded interval in its filter_persistence.cc); a stream is taken to report at least
# that slowly until SPACINGS reports have measured its real interval.
DEFAULT_INTERVAL = 5.0
SPACINGS = 8
TTL_INTERVALS = 3  # an assignment outlives two missed reports
# A usage line counts at most this many requests of each kind (Envoy sends uint64s): no
# Envoy lets four billion requests through one bucket in one report, and counts past int64
# would overflow the counters (a Redis payment failing takes the domain's others with it).
MAX_REPORTED = 2**32 - 1
# Under a token bucket, a report counts as allowed at most what the bucket can have let
# through since the last report, with this much slack (assignments change as they land).
ALLOWED_SLACK = 2.0


@dataclass(frozen=True, slots=True)
class Usage:
    """One bucket's line of a usage report."""

    bucket: Mapping[str, str]
    allowed: int
    denied: int


class Assign(NamedTuple):
    """Apply ``strategy`` to the bucket for ``ttl`` whole seconds (a named tuple: a division
    sends one per bucket renewed, 50,000 at a time, and a frozen dataclass took 1 µs each)."""

    bucket: Mapping[str, str]
    strategy: Strategy
    ttl: int


@dataclass(frozen=True, slots=True)
class Abandon:
    """The server stops tracking the bucket; Envoy forgets it."""

    bucket: Mapping[str, str]


Action = Assign | Abandon
Send = Callable[[Sequence[Action]], None]


class QuotaStream:
    """One Envoy's RLQS stream: its domain, reporting interval and buckets."""

    def __init__(self, ident: int, send: Send) -> None:
        self.ident, self.send = ident, send
        self.domain = ""
        self.buckets: dict[BucketKey, Subscription] = {}
        self.holdings = Holdings()  # the buckets' figures, a slot each
        self.interval = DEFAULT_INTERVAL
        self._spacings: list[float] = []
        self._last: float | None = None
        self.warned = False  # a report past what it could have let through was logged
        self.closed = False
        self.refused = 0  # new buckets its last report had refused at a cap
        self.told: set[str] = set()  # the caps (bounds.CAP_FLAGS) whose refusal was logged

    @property
    def last_report(self) -> float | None:
        return self._last

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


def bounded(usage: Usage, held: Subscription | None, span: float | None) -> Usage:
    """``usage`` with its counts bounded: each at most MAX_REPORTED; when only token buckets
    were sent for the bucket since its last report, ``span`` seconds ago, the allowed ones
    at most what the largest of them can have let through (ALLOWED_SLACK times its rate
    times the span and its depth). The usage itself when nothing is cut."""
    allowed, denied = usage.allowed, usage.denied
    if allowed > MAX_REPORTED:
        allowed = MAX_REPORTED
    if denied > MAX_REPORTED:
        denied = MAX_REPORTED
    if allowed and span is not None and held is not None and held.peak is not None:
        rate, depth = held.peak
        if rate != math.inf:
            allowed = min(allowed, math.ceil(ALLOWED_SLACK * (rate * span + depth)))
    if allowed == usage.allowed and denied == usage.denied:
        return usage
    return Usage(usage.bucket, allowed, denied)


def bounded_counts(holdings: Holdings, slots: Ints, allowed: Counts, span: float | None) -> Counts:
    """``bounded``'s cut of the allowed counts of a report's lines (``slots``: their
    buckets', each known before the report; counts at most MAX_REPORTED already)."""
    if span is None:
        return allowed
    rate = holdings.peak_rate[slots]
    cut = (allowed > 0) & ~np.isnan(rate) & (rate != math.inf)
    if not cut.any():
        return allowed
    with np.errstate(invalid="ignore"):
        most = np.ceil(ALLOWED_SLACK * (rate * span + holdings.peak_depth[slots]))
    out: Counts = np.where(cut, np.minimum(allowed, most), allowed).astype(np.int64)
    return out
