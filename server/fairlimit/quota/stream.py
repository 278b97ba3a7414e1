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

from fairlimit.core.bucket import BucketKey
from fairlimit.core.matching import Entry
from fairlimit.core.quota import NONE, Blanket, Strategy, Target, TokenBucket, code_of, most

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


class Subscription:
    """One stream's subscription to one bucket."""

    __slots__ = ("active_at", "allowed", "bucket", "code", "counted", "demand", "denied",
                 "entries", "extra", "peak", "planned", "row", "since", "strategy",
                 "target")  # fmt: skip

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
        # for the division (quota/division.py): the bucket's row in its table, the strategy
        # in force as a code, and the last division's own (before settling) and this
        # holder's part of the headroom (nan: none)
        self.row = -1
        self.code = NONE
        self.planned = NONE
        self.extra = math.nan

    def assign(self, strategy: Strategy, code: int | None = None) -> None:
        """``strategy`` (whose ``code_of`` is ``code`` when given) is sent to the Envoy
        (and in force there from now on)."""
        self.strategy = strategy
        self.code = code_of(strategy) if code is None else code
        if type(strategy) is TokenBucket:  # most(strategy), inline: 50,000 a division
            rate, depth = strategy.tokens_per_fill / strategy.fill_seconds, strategy.max_tokens
        else:
            rate, depth = most(strategy)
        peak = self.peak
        if peak is not None:
            if peak[0] > rate:
                rate = peak[0]
            if peak[1] > depth:
                depth = peak[1]
        self.peak = (rate, depth)

    def start_span(self) -> None:
        """A report came: the next span starts under the strategy in force."""
        strategy = self.strategy
        if type(strategy) is TokenBucket:  # most(strategy), inline: every line of a report
            self.peak = (strategy.tokens_per_fill / strategy.fill_seconds, strategy.max_tokens)
        else:
            self.peak = None if strategy is None else most(strategy)

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

    def __init__(self, ident: int, send: Send) -> None:
        self.ident, self.send = ident, send
        self.domain = ""
        self.buckets: dict[BucketKey, Subscription] = {}
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
