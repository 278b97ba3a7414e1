"""One RLQS usage report taken: each line bounded, its bucket measured (or subscribed), its
allowed usage owed to the store's counters (``usage.py``), idle buckets abandoned, then a
division or, within the division gap, provisional assignments (``divider.py``).

A new bucket past a cap (``Room.full``) is refused: not tracked, its usage neither paid nor
counted. It is sent the assignment a new bucket gets until the next division (its bound as
a greedy newcomer under the levels in force, ``core.quota.provisional``), renewed at each
report that lists it: so it is held to its own limit and its share, where Envoy's
no_assignment_behavior (``ALLOW_ALL`` in the documented settings) would let it through
unlimited; the caps do not count it. Envoy lists it in each periodic report, where it costs a
lookup and a plan, and it is taken like any new bucket once the stream has room (an
AbandonAction would make Envoy forget it and report it afresh at its next request, one
report per request). The stream is not ended: that would drop what it holds, and Envoy would
reopen it and report the same buckets again.
"""

import logging
import operator
from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from fairlimit.core.bucket import bucket_key
from fairlimit.core.quota import provisional
from fairlimit.quota.bounds import Room
from fairlimit.quota.columns import Lines
from fairlimit.quota.divider import Divider
from fairlimit.quota.stream import (
    MAX_REPORTED,
    Abandon,
    Action,
    Assign,
    Counts,
    Ints,
    QuotaStream,
    Subscription,
    Usage,
    bounded_counts,
)
from fairlimit.quota.targets import Targets
from fairlimit.quota.usage import UsageLedger
from fairlimit.telemetry.quota import QuotaTelemetry

log = logging.getLogger(__name__)

# A report's lines are keyed and looked up this many new buckets (or KNOWN_CHUNK lines) at a
# time, yielding to the event loop in between (a new bucket costs about 30 µs: its
# descriptor, plan and target; a known one under 0.5 µs, its counts then taken in arrays),
# and one report at a time: twenty streams' reports side by side each ran a chunk in every
# turn of the loop, and an RLS call waited for all of them (240 ms).
CHUNK = 128
KNOWN_CHUNK = 2048
_BUCKET = operator.attrgetter("bucket")
_SLOT = operator.attrgetter("slot")


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
        """Each line keyed and looked up (a new bucket subscribed), then every line's
        counts at once (``_count``); a stream closed meanwhile takes the rest no further."""
        since = stream.last_report
        stream.observe(now)
        stream.domain = domain or stream.domain
        if self.targets.refresh(self.divider.streams.values()):
            self.divider.remote.targets.clear()
            self.divider.changed = None
        span = None if since is None else now - since
        buckets = usages.buckets if isinstance(usages, Lines) else list(map(_BUCKET, usages))
        kept: list[Sequence[int]] = []  # the lines taken (the others refused), in parts
        slots: list[int] = []
        new: list[int] = []  # the lines (of those taken) that subscribed their bucket
        refused: dict[str, int] = {}
        turned: list[Mapping[str, str]] = []  # the refused lines' buckets
        h = stream.holdings
        listed, listed_slots = h.order
        for start in range(0, len(buckets), KNOWN_CHUNK):
            if start:
                await self.divider.pace.pause()
                if stream.closed:
                    return
            end = start + KNOWN_CHUNK
            part = buckets[start:end]
            # the buckets of the last report's lines at the same places: their slots (a
            # list's equality is C's, and a bucket parsed by the servicer is the same map)
            if part == listed[start:end]:
                found: list[int | None] = list(listed_slots[start:end])
            else:  # by the maps' identity (``Holdings.by_map``), else keyed
                found = list(map(h.by_map.get, map(id, part)))
                if None in found:
                    # each key dropped once looked up (kept, 50,000 cost the collector)
                    found = [h.index.get(bucket_key(part[i])) if slot is None else slot
                             for i, slot in enumerate(found)]  # fmt: skip
            lines: Sequence[int] = range(start, start + len(part))
            if None in found:  # new buckets (or refused ones) are subscribed (or dropped)
                lines = await self._subscribe(stream, part, found, now, refused, turned, new,
                                              start, len(slots))  # fmt: skip
                if stream.closed:
                    return
            kept.append(lines)
            slots += cast(list[int], found)
        taken = None if len(slots) == len(buckets) else [i for part in kept for i in part]
        h.order = (buckets if taken is None else [buckets[i] for i in taken], slots)
        self.room.refuse(stream, refused, self.telemetry)
        counts = _columns(usages, taken)
        allowed, denied = self._count(stream, counts, np.array(slots, dtype=np.intp), new,
                                      span, now)  # fmt: skip
        self.telemetry.reported(stream.domain, allowed, denied)
        due = self.divider.due(now)
        # the reported buckets, for a provisional renewal (before an abandon moves slots)
        reported = [] if due else [h.keys[slot] for slot in slots]
        # Only a periodic report lists every bucket; scanning on each subscription (a report
        # of one new bucket) would cost O(buckets) per new client.
        full = len(usages) >= len(stream.buckets)
        abandoned = self._abandon_idle(stream, now) if full else []
        if turned:  # sent with the abandons, first in the response
            abandoned = [*abandoned, *await self._turned(stream, turned)]
            if stream.closed:
                return
        if due:
            await self.divider.divide_yielding(stream, abandoned)
        else:
            self.divider.provisional(stream, reported, abandoned)

    async def _subscribe(
        self,
        stream: QuotaStream,
        part: Sequence[Mapping[str, str]],
        found: list[int | None],
        now: float,
        refused: dict[str, int],
        turned: list[Mapping[str, str]],
        new: list[int],
        start: int,
        offset: int,
    ) -> list[int]:
        """Subscribe the buckets of ``part`` (the report's lines from ``start``) not found
        (``found`` their slots, filled in here), CHUNK at a time; drop the lines of those
        refused (``Room.full``), counted in ``refused``, their buckets in ``turned``. The
        lines kept; ``new``: those (from ``offset`` among the lines taken) that subscribed
        their bucket. The stream may have closed meanwhile (then what is left is not
        taken)."""
        kept: list[int] = []
        h, added = stream.holdings, 0
        for i, (bucket, slot) in enumerate(zip(part, found, strict=True)):
            if slot is None:
                key = bucket_key(bucket)
                slot = h.index.get(key)  # subscribed by a line before it in ``part``
                if slot is None:
                    if added and not added % CHUNK:
                        await self.divider.pace.pause()
                        if stream.closed:
                            return kept
                    if (cap := self.room.full(stream)) is not None:
                        refused[cap] = refused.get(cap, 0) + 1
                        turned.append(bucket)
                        continue
                    held = stream.buckets[key] = Subscription(bucket, now, h, key)
                    self.targets.resolve(stream.domain, key, held)
                    self.room.took()
                    new.append(offset + len(kept))
                    added += 1
                    slot = held.slot
            found[len(kept)] = slot
            kept.append(start + i)
        del found[len(kept) :]
        return kept

    async def _turned(self, stream: QuotaStream, turned: Sequence[Mapping[str, str]]
                      ) -> list[Action]:  # fmt: skip
        """Each refused bucket's assignment: a new bucket's, held by this stream alone,
        under the levels in force (not tracked: the next report that lists it renews it).
        A plan each, CHUNK at a time (a report may list thousands)."""
        levels, target = self.divider.levels, self.targets.target
        out: list[Action] = []
        for start in range(0, len(turned), CHUNK):
            if start:
                await self.divider.pace.pause()
            out += [Assign(bucket, provisional(target(stream.domain, bucket), levels, 1),
                           stream.ttl) for bucket in turned[start : start + CHUNK]]  # fmt: skip
        return out

    def _count(
        self,
        stream: QuotaStream,
        counts: "_Counts",
        slots: Ints,
        new: list[int],
        span: float | None,
        now: float,
    ) -> tuple[int, int]:
        """The taken lines' counts, bounded (``stream.bounded_counts``), measured into their
        buckets' demand and totals, their allowed requests owed (``usage.py``); each bucket
        reported for renewal. A bucket listed twice is measured in turns, in order, as
        line by line. The counts as counted, allowed and denied."""
        h = stream.holdings
        allowed, over, denied, past = counts
        lines = range(len(slots))
        fresh = np.zeros(len(lines), dtype=bool)
        fresh[new] = True  # a new bucket's first line is not measured: its span starts now
        cuts = np.flatnonzero(over | past)  # lines past MAX_REPORTED
        first_cut = int(cuts[0]) if len(cuts) else len(lines)
        for turn in _turns(slots):
            known = turn[~fresh[turn]]
            cut = bounded_counts(h, slots[known], allowed[known], span)
            moved = np.flatnonzero(cut != allowed[known])
            if len(moved):
                first_cut = min(first_cut, int(known[moved[0]]))
                allowed[known] = cut
            h.measure(slots[known], allowed[known] + denied[known], now, stream.interval)
            h.allowed[slots[turn]] += allowed[turn]  # (a turn's slots are distinct)
            h.denied[slots[turn]] += denied[turn]
        h.renew[slots] = True
        if first_cut < len(lines) and not stream.warned:
            stream.warned = True
            log.warning("RLQS: stream %d reported more requests than it can have let"
                        " through (counted as at most %d allowed, %d denied)",
                        stream.ident, int(allowed[first_cut]), int(denied[first_cut]))  # fmt: skip
        owing = np.flatnonzero(allowed > 0).tolist()
        for i, paid in zip(owing, allowed[owing].tolist(), strict=True):
            held = h.subs[slots[i]]
            if held.entries is not None:
                self.ledger.owe((stream.ident, h.keys[slots[i]]), stream.domain,
                                held.entries, paid, stream.interval)  # fmt: skip
        return int(allowed.sum()), int(denied.sum())

    def _abandon_idle(self, stream: QuotaStream, now: float) -> list[Action]:
        h = stream.holdings
        idle = np.flatnonzero(now - h.active_at[: h.size] >= self.abandon_after)
        out: list[Action] = []
        for slot in reversed(idle.tolist()):  # from the last: a removal moves the last slot
            key = h.keys[slot]
            held = stream.buckets.pop(key)
            self.divider.mark(key, held.target)  # its region re-divides without it
            h.remove(slot)
            held.row = -1  # in no table from now on
            out.append(Abandon(held.bucket))
        out.reverse()
        self.room.dropped(len(idle))
        return out


_Counts = tuple[Counts, npt.NDArray[np.bool_], Counts, npt.NDArray[np.bool_]]


def _columns(usages: Sequence[Usage], taken: list[int] | None) -> _Counts:
    """The allowed and denied counts of the lines ``taken`` (None: every line), each at
    most MAX_REPORTED (Envoy sends uint64s), and whether each was cut to it."""
    if isinstance(usages, Lines):
        allowed, over = _bounded_counts(usages.allowed if taken is None
                                        else usages.allowed[taken])  # fmt: skip
        denied, past = _bounded_counts(usages.denied if taken is None else usages.denied[taken])
        return allowed, over, denied, past
    lines = usages if taken is None else [usages[i] for i in taken]
    return (*_counts(lines, "allowed"), *_counts(lines, "denied"))


def _bounded_counts(raw: npt.NDArray[np.uint64]) -> tuple[Counts, npt.NDArray[np.bool_]]:
    over = raw > MAX_REPORTED
    return np.minimum(raw, MAX_REPORTED).astype(np.int64), over


def _counts(lines: Sequence[Usage], field: str) -> tuple[Counts, npt.NDArray[np.bool_]]:
    """One count of every line, at most MAX_REPORTED, and whether each was cut to it."""
    try:
        raw = np.fromiter(map(operator.attrgetter(field), lines), np.uint64, len(lines))
    except OverflowError:  # not from protobuf: past uint64, or negative
        values = [getattr(line, field) for line in lines]
        over = np.array([v > MAX_REPORTED for v in values], dtype=bool)
        return np.array([min(v, MAX_REPORTED) for v in values], dtype=np.int64), over
    return _bounded_counts(raw)


def _turns(slots: Ints) -> list[Ints]:
    """The lines (indices into ``slots``) in turns: each bucket's first line, then its
    second, ... (a report lists each bucket once; a bucket listed twice is taken in order)."""
    if not len(slots) or np.bincount(slots).max() <= 1:
        return [np.arange(len(slots))]
    order = np.argsort(slots, kind="stable")
    ordered = slots[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    rank = np.arange(len(slots)) - np.repeat(starts, np.diff(np.r_[starts, len(slots)]))
    return [np.sort(order[rank == k]) for k in range(int(rank.max()) + 1)]
