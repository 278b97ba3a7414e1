"""When and over what the RLQS division runs, and what it sends.

A report marks the regions (buckets linked by caps) of the buckets it changed; a division
re-divides those regions only (all of them after a reload, a closed stream, or a change in
what other processes report), in arrays (``division.py``), then sends the reporting stream
an assignment for every bucket it reported (renewing their TTL) and every stream the
assignments that changed. Between divisions (``divide_gap``), a new bucket gets a
provisional assignment from the levels in force. A division runs in steps (a generator):
gathered, divided, and each stream's assignments sent; a stream closing between them ends
the rest, as what is left was worked out with its buckets.
"""

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fairlimit.core.bucket import BucketKey
from fairlimit.core.quota import (
    NONE,
    STEP,
    Allocation,
    Regions,
    Target,
    provisional,
    strategy_of,
)
from fairlimit.quota.bounds import Pace
from fairlimit.quota.columns import Assigns
from fairlimit.quota.division import changed, divide
from fairlimit.quota.remote import Remote
from fairlimit.quota.stream import Action, Assign, Ints, QuotaStream
from fairlimit.quota.targets import Targets


class Divider:
    """The division of every cap among the streams' (and other processes') buckets."""

    def __init__(
        self,
        streams: dict[int, QuotaStream],
        targets: Targets,
        remote: Remote,
        now: Callable[[], float],
        divide_gap: float,
    ) -> None:
        self.streams, self.targets, self.remote, self.now = streams, targets, remote, now
        self.divide_gap = divide_gap
        self.pace = Pace()
        self.levels: dict[str, float] = {}  # λ per cap key; math.inf when uncontended
        self.headroom: dict[str, float] = {}  # H per cap key: assigned rates above the grants
        self.divisions = 0
        self.divided_at: float | None = None
        self.dirty = False  # a division is due
        self.closes = 0  # streams closed so far (a division in steps checks it)
        # the regions a report changed since the last division; None: every region
        self.changed: set[object] | None = None

    def due(self, now: float) -> bool:
        return self.divided_at is None or now - self.divided_at >= self.divide_gap

    def everything(self) -> None:
        """The next division re-divides every region."""
        self.changed, self.dirty = None, True

    def mark(self, key: BucketKey, target: Target) -> None:
        """The region of ``key`` is to be re-divided."""
        if self.changed is not None:
            self.changed.add(Regions.handle(key, target))

    def allocation(self) -> Allocation:
        """Every stream's bucket's strategy of the last division (before settling), each
        cap's level and headroom, and the holders' parts of it (for tests and /rlconfig)."""
        streams = list(self.streams.values())
        return Allocation(
            {(s.ident, k): strategy_of(b.planned) for s in streams
             for k, b in s.buckets.items() if b.planned != NONE},
            dict(self.levels), dict(self.headroom),
            {(s.ident, k): b.extra for s in streams
             for k, b in s.buckets.items() if not math.isnan(b.extra)},
        )  # fmt: skip

    def provisional(
        self, stream: QuotaStream, reported: Sequence[BucketKey], abandoned: Sequence[Action]
    ) -> None:
        """Between divisions: renew the reported buckets' assignments, give new ones a
        provisional one from the levels in force, divide at the next drip."""
        self.dirty = True
        actions: list[Action] = list(abandoned)
        stream.holdings.renew[:] = False  # renewed here, not by the next division
        for key in dict.fromkeys(reported):
            held = stream.buckets.get(key)
            if held is None:
                continue
            self.mark(key, held.target)
            strategy = held.strategy
            if strategy is None:
                holders = sum(1 for s in self.streams.values() if key in s.buckets)
                holders += self.remote.counts.get(key, 0)
                strategy = provisional(held.target, self.levels, holders)
                held.assign(strategy)
            actions.append(Assign(held.bucket, strategy, stream.ttl))
        if actions:
            stream.send(actions)

    def divide(self, reporter: QuotaStream | None, abandoned: Sequence[Action] = ()) -> None:
        """A division at once."""
        for _ in self._division(reporter, abandoned):
            pass

    async def divide_yielding(
        self, reporter: QuotaStream | None, abandoned: Sequence[Action] = ()
    ) -> None:
        """A division yielding to the event loop between its steps (the reporter's
        buckets renewed: those its report marked in its holdings, ``abandoned`` sent
        first). Called with the report turn held, so that no report or reload changes the
        buckets meanwhile."""
        for _ in self._division(reporter, abandoned):
            await self.pace.pause()

    def _division(
        self, reporter: QuotaStream | None, abandoned: Sequence[Action]
    ) -> Iterator[None]:
        targets = self.targets
        if self.remote.present and targets.refresh(self.streams.values()):
            self.remote.targets.clear()
            self.changed = None
        targets.compact(self.streams.values(), len(self.remote.targets))
        table = targets.table
        # the reporter's buckets to renew: their regions are divided (not those the report
        # abandoned: out of its holdings already)
        renewing = _renewing(reporter)
        renewed = reporter.holdings.row[renewing] if reporter is not None else renewing
        changed_regions, self.changed = self.changed, set()
        closes = self.closes
        regions = targets.regions
        dirty = None if changed_regions is None else {regions.root(h) for h in changed_regions}
        if dirty is not None and reporter is not None and len(renewed):
            first = table.arrays().first_cap[renewed]
            dirty |= {regions.root(table.cap_names[c]) for c in np.unique(first[first >= 0])}
            keys = reporter.holdings.keys
            dirty |= {keys[s] for s in renewing[first < 0].tolist()}  # a region of its own
        streams = list(self.streams.values())
        spans: list[tuple[QuotaStream, int, int]] = []
        n = 0
        for s in streams:
            spans.append((s, n, n + s.holdings.size))
            n += s.holdings.size
        remote = (self.remote.holders(dirty, regions, targets.target)
                  if self.remote.present else [])  # fmt: skip
        remote_rows = [table.row(h.bucket, h.target) for h in remote]
        rows = _joined([s.holdings.row[: s.holdings.size] for s in streams], np.intp)
        taken = np.ones(n, dtype=bool) if dirty is None else self._dirty_rows(dirty)[rows]
        picked = np.flatnonzero(taken)
        # only the holders of the regions divided are read further
        demand = _joined([s.holdings.demand[: s.holdings.size] for s in streams], np.float64)
        interval = np.repeat([s.interval for s, _, _ in spans],
                             [hi - lo for _, lo, hi in spans]).astype(np.float64)  # fmt: skip
        yield
        if self.closes != closes:
            return
        far = np.array([h.demand for h in remote], dtype=np.float64)
        far_interval = np.array([h.interval for h in remote], dtype=np.float64)
        result = divide(
            table,
            np.concatenate([rows[picked], np.array(remote_rows, dtype=np.intp)]),
            np.concatenate([demand[picked], far]),
            np.concatenate([interval[picked], far_interval]),
        )
        new = np.full(n, NONE, dtype=np.uint64)
        new[picked] = result.codes[: len(picked)]
        extra = np.full(n, math.nan)
        extra[picked] = result.extra[: len(picked)]
        current = _joined([s.holdings.code[: s.holdings.size] for s in streams], np.uint64)
        moved = np.zeros(n, dtype=bool)
        moved[picked] = changed(current[picked], new[picked])
        for s, lo, hi in spans:
            h, mine = s.holdings, taken[lo:hi]
            h.planned[: h.size][mine] = new[lo:hi][mine]
            h.extra[: h.size][mine] = extra[lo:hi][mine]
        if dirty is None:
            self.levels, self.headroom = result.levels, result.headroom
        else:
            self.levels.update(result.levels)
            self.headroom.update(result.headroom)
        self.divisions += 1
        self.divided_at, self.dirty = self.now(), False
        yield
        for stream, lo, hi in spans:
            if self.closes != closes:
                return
            sending = moved[lo:hi].copy()
            head: Sequence[Action] = ()
            if stream is reporter:
                sending[renewing] = True
                head = abandoned
            h = stream.holdings
            at = np.flatnonzero(sending)
            strategies = h.strategy[at]
            move = moved[lo:hi][at]
            if move.any():
                strategies[move] = h.assign(at[move], new[lo:hi][at[move]])
            buckets, assigned = h.bucket[at].tolist(), strategies.tolist()
            n = len(head)
            for start in range(0, n + len(buckets), STEP):  # a response at a time, a turn each
                if start:
                    yield
                    if self.closes != closes:
                        return
                i, j = max(start - n, 0), max(start + STEP - n, 0)
                stream.send(Assigns(head[start : start + STEP], buckets[i:j], assigned[i:j],
                                    stream.ttl))  # fmt: skip
            yield

    def _dirty_rows(self, dirty: set[object]) -> npt.NDArray[np.bool_]:
        """Per table row, whether its bucket's region is among ``dirty`` (regions' roots)."""
        table, regions = self.targets.table, self.targets.regions
        t = table.arrays()
        caps = np.fromiter((regions.root(name) in dirty for name in table.cap_names), bool,
                           len(table.cap_names))  # fmt: skip
        out = np.zeros(len(t.limit), dtype=bool)
        capped = t.first_cap >= 0
        out[capped] = caps[t.first_cap[capped]]
        out[[table.rows[k] for k in dirty if isinstance(k, tuple) and k in table.rows]] = True
        return out


def _renewing(reporter: QuotaStream | None) -> Ints:
    """The slots of the reporter's buckets its report renews (their marks cleared)."""
    if reporter is None:
        return np.zeros(0, dtype=np.intp)
    h = reporter.holdings
    marked = h.renew[: h.size]
    out: Ints = np.flatnonzero(marked)
    marked[:] = False
    return out


def _joined(parts: list[npt.NDArray[Any]], dtype: type) -> npt.NDArray[Any]:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
