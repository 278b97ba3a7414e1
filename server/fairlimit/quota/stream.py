"""One Envoy's RLQS stream as the quota service keeps it: its reporting interval and buckets.

Plain state and the arithmetic on it (the interval from the reports' spacing, a bucket's
demand over a span, the most a report may count as allowed); what to assign and when is
the service's (``service.py``). A stream neither calls the service nor is called back by it:
the service reads and updates it, and hands what to send to ``send``.

A stream's buckets' figures live in arrays, a slot per bucket (``Holdings``), so that a
report measures its lines and a division reads and assigns every holder in a few numpy
passes (issue 41: a report of 50,000 lines took 0.1 s taking its lines and 0.05 s
renewing their assignments, a Python object touched per bucket each time);
``Subscription`` is the handle of one slot.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from fairlimit.core.bucket import BucketKey
from fairlimit.core.matching import Entry
from fairlimit.core.quota import (
    FILL_SECONDS,
    NONE,
    TOKEN,
    UINT32_MAX,
    Blanket,
    Strategy,
    Target,
    code_of,
    most,
    strategy_of,
)

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

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.intp]
Counts = npt.NDArray[np.int64]
Codes = npt.NDArray[np.uint64]
Objects = npt.NDArray[np.object_]

_FIELDS = {  # array, its dtype and the value of a new slot
    "row": (np.intp, -1),
    "code": (np.uint64, NONE),  # the strategy in force, as core.quota.code_of
    "planned": (np.uint64, NONE),  # the last division's, before settling
    "extra": (np.float64, math.nan),  # this holder's part of its caps' headroom (nan: none)
    "demand": (np.float64, math.nan),  # requests/s (nan: not measured yet)
    "counted": (np.int64, 0),  # requests since ``since``, not yet turned into a demand
    "since": (np.float64, 0.0),
    "active_at": (np.float64, 0.0),  # the last report with requests
    # the most the strategies in force since the last report let through: rate (inf once a
    # blanket rule was among them; nan before the first) and depth
    "peak_rate": (np.float64, math.nan),
    "peak_depth": (np.float64, 0.0),
    "force_rate": (np.float64, math.nan),  # the same, of the strategy in force alone
    "force_depth": (np.float64, 0.0),
    "allowed": (np.int64, 0),  # totals, for /rlconfig
    "denied": (np.int64, 0),
    "renew": (np.bool_, False),  # reported since the last division: its assignment is renewed
}


class Holdings:
    """The figures of one stream's subscriptions, by slot (0 .. ``size``)."""

    def __init__(self) -> None:
        self.size = 0
        self.subs: list[Subscription] = []
        self.keys: list[BucketKey] = []
        self.index: dict[BucketKey, int] = {}  # each key's slot
        # each slot's bucket map by its identity (the map is the subscription's, alive as
        # long as the slot): the RLQS servicer hands the same map report after report, so
        # a report in a new order finds its lines without keying them
        self.by_map: dict[int, int] = {}
        # the last report's lines' buckets and their slots, in order (emptied by a
        # removal): Envoy lists its buckets in the same order report after report
        self.order: tuple[Sequence[Mapping[str, str]], list[int]] = ([], [])
        self.row: Ints
        self.code: Codes
        self.planned: Codes
        self.extra: Floats
        self.demand: Floats
        self.counted: Counts
        self.since: Floats
        self.active_at: Floats
        self.peak_rate: Floats
        self.peak_depth: Floats
        self.force_rate: Floats
        self.force_depth: Floats
        self.allowed: Counts
        self.denied: Counts
        self.renew: npt.NDArray[np.bool_]
        self.strategy: Objects  # the strategy in force (None before the first)
        self.bucket: Objects  # each slot's bucket map (for the actions sent)
        self._allocate(4)

    def _allocate(self, capacity: int) -> None:
        for name, (dtype, fill) in _FIELDS.items():
            grown: npt.NDArray[Any] = np.full(capacity, fill, dtype=dtype)
            if self.size:
                grown[: self.size] = getattr(self, name)[: self.size]
            setattr(self, name, grown)
        for name in ("strategy", "bucket"):
            objects = np.full(capacity, None, dtype=object)
            if self.size:
                objects[: self.size] = getattr(self, name)[: self.size]
            setattr(self, name, objects)

    def add(self, sub: "Subscription", key: BucketKey, now: float) -> int:
        """A new slot for ``sub`` (bucket ``key``), measured from ``now``; its slot."""
        slot = self.size
        if slot == len(self.row):
            self._allocate(2 * slot)
        self.size += 1
        self.subs.append(sub)
        self.keys.append(key)
        self.index[key] = slot
        self.by_map[id(sub.bucket)] = slot
        self.since[slot] = self.active_at[slot] = now
        self.bucket[slot] = sub.bucket
        return slot

    def remove(self, slot: int) -> "Subscription":
        """Take ``slot``'s subscription out (the last slot moves into its place); it keeps
        its figures in a holdings of its own."""
        sub = self.subs[slot]
        alone = Holdings()
        alone.add(sub, self.keys[slot], 0.0)
        last = self.size - 1
        for name in (*_FIELDS, "strategy", "bucket"):
            values = getattr(self, name)
            getattr(alone, name)[0] = values[slot]
            values[slot] = values[last]
        for name, (_, fill) in _FIELDS.items():
            getattr(self, name)[last] = fill
        self.strategy[last] = self.bucket[last] = None
        sub.holdings, sub.slot = alone, 0
        del self.index[self.keys[slot]]
        del self.by_map[id(sub.bucket)]
        if slot != last:
            moved = self.subs[slot] = self.subs[last]
            key = self.keys[slot] = self.keys[last]
            moved.slot = self.index[key] = self.by_map[id(moved.bucket)] = slot
        self.subs.pop()
        self.keys.pop()
        self.size = last
        self.order = ([], [])
        return sub

    def assign(self, slots: Ints, codes: Codes) -> list[Strategy]:
        """The strategies of ``codes`` (none NONE) are sent to ``slots`` (and in force at
        the Envoy from now on); the strategies, in order."""
        unique, inverse = np.unique(codes, return_inverse=True)
        made = np.empty(len(unique), dtype=object)
        made[:] = [strategy_of(c) for c in unique.tolist()]
        strategies = made[inverse.reshape(-1)]
        self.code[slots] = codes
        self.strategy[slots] = strategies
        token = codes >= TOKEN
        with np.errstate(invalid="ignore"):
            rate = np.where(token, (codes >> np.uint64(32)).astype(np.float64) / FILL_SECONDS,
                            math.inf)  # fmt: skip
        depth = np.where(token, (codes & np.uint64(UINT32_MAX)).astype(np.float64), 0.0)
        self.force_rate[slots], self.force_depth[slots] = rate, depth
        peak = self.peak_rate[slots]
        first = np.isnan(peak)
        self.peak_rate[slots] = np.where(first, rate, np.maximum(peak, rate))
        self.peak_depth[slots] = np.where(first, depth,
                                          np.maximum(self.peak_depth[slots], depth))  # fmt: skip
        out: list[Strategy] = strategies.tolist()
        return out

    def measure(self, slots: Ints, requests: Counts, now: float, interval: float) -> None:
        """A report's requests (each slot at most once): a span of MIN_SPAN intervals or
        more makes a demand; the next span starts under the strategy in force."""
        counted = self.counted[slots] + requests
        self.active_at[slots] = np.where(requests > 0, now, self.active_at[slots])
        span = now - self.since[slots]
        due = span >= MIN_SPAN * interval
        with np.errstate(divide="ignore", invalid="ignore"):
            self.demand[slots] = np.where(due, counted / span, self.demand[slots])
        self.counted[slots] = np.where(due, 0, counted)
        self.since[slots] = np.where(due, now, self.since[slots])
        self.peak_rate[slots] = self.force_rate[slots]
        self.peak_depth[slots] = self.force_depth[slots]


class Subscription:
    """One stream's subscription to one bucket: a slot of the stream's ``Holdings``."""

    __slots__ = ("bucket", "entries", "holdings", "slot", "target")

    def __init__(
        self,
        bucket: Mapping[str, str],
        now: float,
        holdings: Holdings | None = None,
        key: BucketKey = (),
    ) -> None:
        # a plain dict is kept as given (its giver does not change it: the RLQS servicer
        # knows its own maps by their identity, grpc_api/rlqs.py)
        self.bucket = bucket if type(bucket) is dict else dict(bucket)
        self.entries: tuple[Entry, ...] | None = None
        self.target = Target(Blanket.ALLOW_ALL)
        self.holdings = Holdings() if holdings is None else holdings
        self.slot = self.holdings.add(self, key, now)

    @property
    def row(self) -> int:
        """The bucket's row in the division's table (-1: in none)."""
        return int(self.holdings.row[self.slot])

    @row.setter
    def row(self, value: int) -> None:
        self.holdings.row[self.slot] = value

    @property
    def demand(self) -> float | None:
        """Requests/s allowed and denied; None before the first measurement."""
        value = float(self.holdings.demand[self.slot])
        return None if math.isnan(value) else value

    @property
    def strategy(self) -> Strategy | None:
        """The strategy in force at the Envoy (None before the first)."""
        found: Strategy | None = self.holdings.strategy[self.slot]
        return found

    @property
    def code(self) -> int:
        return int(self.holdings.code[self.slot])

    @property
    def planned(self) -> int:
        return int(self.holdings.planned[self.slot])

    @property
    def extra(self) -> float:
        return float(self.holdings.extra[self.slot])

    @property
    def active_at(self) -> float:
        return float(self.holdings.active_at[self.slot])

    @property
    def peak(self) -> tuple[float, int] | None:
        """(rate, depth): the most the strategies in force since the last report let
        through (an infinite rate once a blanket rule was among them); None before any."""
        h, slot = self.holdings, self.slot
        rate = float(h.peak_rate[slot])
        return None if math.isnan(rate) else (rate, int(h.peak_depth[slot]))

    @property
    def allowed(self) -> int:
        return int(self.holdings.allowed[self.slot])

    @property
    def denied(self) -> int:
        return int(self.holdings.denied[self.slot])

    def assign(self, strategy: Strategy) -> None:
        """``strategy`` is sent to the Envoy (and in force there from now on)."""
        h, slot = self.holdings, self.slot
        h.code[slot] = code_of(strategy)
        h.strategy[slot] = strategy
        rate, depth = most(strategy)
        h.force_rate[slot], h.force_depth[slot] = rate, depth
        peak = h.peak_rate[slot]
        if not math.isnan(peak):
            rate, depth = max(rate, float(peak)), max(depth, int(h.peak_depth[slot]))
        h.peak_rate[slot], h.peak_depth[slot] = rate, depth

    def start_span(self) -> None:
        """A report came: the next span starts under the strategy in force."""
        h, slot = self.holdings, self.slot
        h.peak_rate[slot], h.peak_depth[slot] = h.force_rate[slot], h.force_depth[slot]


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
