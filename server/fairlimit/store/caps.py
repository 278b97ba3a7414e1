"""In-process fair-share caps of the memory store: each cap's client rows, its division
and its light reserve (core/sharing.py), dropped once idle (store/memory.py drives the steps).
"""

import heapq
import math
from collections.abc import Sequence

from fairlimit.core import sharing
from fairlimit.core.fairshare import CapReport, FairnessFigures, figures_of
from fairlimit.core.plan import Plan, Share
from fairlimit.core.sharing import (
    FORCES,
    STALE,
    Clock,
    Division,
    Light,
    Row,
    ShareClaim,
    contended,
    divide,
    fold,
    last_period,
    leave,
    roll_light,
    same_window,
    schedule,
    stale_division,
)
from fairlimit.core.units import window_start
from fairlimit.store.deadlines import Due


def _idle(window: int) -> float:
    """How long an untouched cap keeps its rows: two windows, and its history's periods."""
    return max(2 * window + 1, STALE * min(window, 1))


class MemoryCap:
    """One cap instance: its client rows and its division (core/sharing.py)."""

    __slots__ = (
        *("capacity", "declared", "division", "figures", "last"),
        *("last_seen", "light", "period", "rows", "window"),
    )

    def __init__(self, share: Share) -> None:
        self.capacity = share.capacity
        self.window = share.window
        self.declared = share.declared
        self.rows: dict[str, Row] = {}
        self.division: Division | None = None
        self.light = Light()  # the light demand it holds room for (core/sharing.py)
        self.period = -1  # the period the figures were last rolled for
        self.figures: FairnessFigures | None = None
        self.last: tuple[list[Row], Clock] | None = None  # for the figures, until asked
        self.last_seen = 0.0

    def divided(self, clock: Clock, now: float) -> Division:
        """The division in force at ``clock``, remade when stale (core/sharing.py)."""
        if clock.period != self.period:
            self.period = clock.period
            # The figures are for telemetry only: worked out when caps() asks, not in the
            # request that rolls the period (at 100k clients they cost twice λ's time).
            self.figures, self.last = None, (list(self.rows.values()), clock)
            # A row is dropped once folding it would give a fresh one: its history gone
            # (STALE periods untouched) and its window neither this one nor the one before
            # (what it asked last window still predicts its demand; an hour cap's client
            # back after 64 s must not start its share afresh; on Redis, prune.lua drops the
            # same rows a few at a time after a division).
            stale, last = clock.period - STALE, clock.start - clock.window
            if any(row.period < stale and row.window < last for row in self.rows.values()):
                self.rows = {
                    c: r for c, r in self.rows.items() if r.period >= stale or r.window >= last
                }
        division = self.division
        if stale_division(division, clock):
            division = self.division = divide(
                self.rows.items(), self.capacity, clock, closing=self.closing(clock)
            )
        assert division is not None
        self.last_seen = now
        return division

    def closing(self, clock: Clock) -> float | None:
        """λ of the window before, when the division in force already knows it."""
        division = self.division
        return division.closing if division and same_window(division, clock) else None

    def row(self, share: Share, clock: Clock) -> Row:
        """The client's row, folded to ``clock``."""
        row = self.rows.get(share.client)
        if row is None:
            row = self.rows[share.client] = Row(share.client_limit, share.weight)
        row.limit, row.weight = share.client_limit, share.weight
        assert self.division is not None
        fold(row, clock, self.division.closing)
        return row

    def report_figures(self) -> FairnessFigures | None:
        """The last full period's fairness figures (computed on first ask)."""
        if self.last is not None:
            rows, clock = self.last
            period = last_period(rows, self.capacity, clock)
            self.figures = None if period is None else figures_of(period)
            self.last = None
        return self.figures

    @property
    def level(self) -> float | None:
        """λ of the division in force (None while nobody at the cap has any history)."""
        division = self.division
        return None if division is None or division.cold else division.level


def _remake(cap: MemoryCap, division: Division, share: Share, row: Row, clock: Clock) -> Division:
    """The cap's division remade for a request that finds it newly contended, the client
    counted with this request (core/sharing.py ``contended``)."""
    extra = max(share.hits, 1)
    closing, forced = cap.closing(clock), division.forced + 1
    if division.epoch // FORCES != clock.epoch:
        forced = 1  # the division in force was made in an earlier sub-period
    remade = divide(cap.rows.items(), cap.capacity, clock, share.client, extra, closing, forced)
    cap.division, row.epoch = remade, remade.epoch
    return remade


def _roll(light: Light, clock: Clock) -> None:
    """Move the cap's light demand to ``clock``'s window, taking its expected hits out of
    the calendar."""
    expected = light.calendar.pop(clock.start, 0.0)
    for at in [at for at in light.calendar if at < clock.start]:
        del light.calendar[at]  # windows nobody asked in
    roll_light(light, clock, expected)


def _claim(share: Share) -> ShareClaim:
    return ShareClaim(
        share.hits, share.client_limit, share.weight, share.capacity, share.declared, share.sized
    )


def _settle_row(row: Row, share: Share, at: float, now: float, hits: int) -> None:
    """Move a client's hits at a cap by ``hits`` (never below 0; settle.lua is the same):
    admitted where its row still counts the window and period of ``at`` (when they were
    charged), asked where it counts those of ``now``. So the demand the cap predicts from
    becomes the real cost as settlements come in, whenever the reservation was made."""
    if not hits:
        return
    if row.window == window_start(share.window, at):
        row.admitted = max(0.0, row.admitted + hits)
    if row.period == math.floor(at / share.period):
        row.period_admitted = max(0.0, row.period_admitted + hits)
    if row.window == window_start(share.window, now):
        row.asked = max(0.0, row.asked + hits)
    if row.period == math.floor(now / share.period):
        row.period_asked = max(0.0, row.period_asked + hits)


class MemoryCaps:
    """Every fair-share cap of one memory store, by its key. ``due``: the store's, lowered
    by each deadline."""

    def __init__(self, due: Due | None = None) -> None:
        self.table: dict[str, MemoryCap] = {}
        self._deadlines: list[tuple[float, str]] = []  # (idle until, key), a heap
        self._due = due or Due()

    def __len__(self) -> int:
        return len(self.table)

    def cap(self, share: Share, now: float) -> MemoryCap:
        """The cap of ``share``, made at ``now`` when it is not held."""
        cap = self.table.get(share.cap)
        if cap is None:
            cap = self.table[share.cap] = MemoryCap(share)
            idle_until = now + _idle(share.window)
            heapq.heappush(self._deadlines, (idle_until, share.cap))
            self._due.by(idle_until)
        return cap

    def claims(self, plan: Plan, now: float) -> list[tuple[Division, ShareClaim, Row, Clock]]:
        """Each share's cap division with the client's row taken out of it
        (core/sharing.py). A request that finds a cap newly contended remakes its division
        with itself counted; the shares of that cap claimed before it leave the new one."""
        states: list[tuple[Division, ShareClaim, Row, Clock]] = []
        for share in plan.shares:
            cap, period = self.cap(share, now), share.period  # a property: read once
            clock = Clock(share.window, period, now)
            division = cap.divided(clock, now)
            row = cap.row(share, clock)
            claim = _claim(share)
            leave(division, row, share.client, share.window, period)
            if contended(division, row, claim, clock):
                remade = _remake(cap, division, share, row, clock)
                for k, (before, c, r, t) in enumerate(states):
                    if before is division:
                        s = plan.shares[k]
                        leave(remade, r, s.client, s.window, s.period)
                        remade.asks += max(s.hits, 1)
                        states[k] = (remade, c, r, t)
                division = remade
            division.asks += max(share.hits, 1)
            states.append((division, claim, row, clock))
        for (division, claim, _, clock), share in zip(states, plan.shares, strict=True):
            light = self.table[share.cap].light
            if light.window != clock.start:
                _roll(light, clock)
            claim.reserve = sharing.reserve(light, division, clock)
        return states

    def claim(self, share: Share, now: float) -> tuple[Division, ShareClaim, Row, Clock]:
        """``claims`` of a plan with one share (most plans with a cap): the same steps, the
        common case of each inlined (the division in force, the row in its window and
        period and in that division), without the lists."""
        cap = self.table.get(share.cap)
        if cap is None:
            cap = self.cap(share, now)
        window, period = share.window, share.period
        clock = Clock(window, period, now)
        division = cap.division
        if (
            division is None
            or clock.period != cap.period
            or division.epoch // FORCES != clock.epoch  # else stale_division may remake it
        ):
            division = cap.divided(clock, now)
        else:
            cap.last_seen = now
        row = cap.rows.get(share.client)
        if row is None or row.period != clock.period or row.window != clock.start:
            row = cap.row(share, clock)
        else:  # fold() would leave it as it is
            row.limit, row.weight = share.client_limit, share.weight
        claim = _claim(share)
        leave(division, row, share.client, window, period)
        if contended(division, row, claim, clock):
            division = _remake(cap, division, share, row, clock)
        division.asks += max(share.hits, 1)
        light = cap.light
        if light.window != clock.start:
            _roll(light, clock)
        claim.reserve = 0.0 if division.cold else sharing.reserve(light, division, clock)
        return division, claim, row, clock

    def light(self, share: Share, row: Row, clock: Clock, cold: bool) -> None:
        """A light request at its cap (core/sharing.py): its window noted in its row, so its
        gap is known at its next one; counted, and its client expected back, unless the
        cap is ``cold`` (nobody has history: everybody is new, nothing light)."""
        at = schedule(row, clock)
        if cold:
            return
        light = self.table[share.cap].light
        light.asked += share.hits
        if at >= 0:
            light.calendar[at] = light.calendar.get(at, 0.0) + share.hits

    def expire(self, now: float, budget: int) -> bool:
        """Drop the caps idle by ``now``, ``budget`` deadlines at most; True when more are
        due."""
        caps = self._deadlines
        for _ in range(budget):
            if not caps or caps[0][0] > now:
                return False
            _, key = heapq.heappop(caps)
            cap = self.table[key]  # each held cap has one deadline here, and only it
            idle_until = cap.last_seen + _idle(cap.window)
            if idle_until <= now:
                del self.table[key]
            else:
                heapq.heappush(caps, (idle_until, key))
                self._due.by(idle_until)
        return bool(caps) and caps[0][0] <= now

    def first(self) -> float:
        """The earliest instant a cap may be idle (infinity when none)."""
        return self._deadlines[0][0] if self._deadlines else math.inf

    def settle(
        self, plan: Plan, shares: Sequence[int], at: float, now: float, refund: int, debt: int
    ) -> None:
        """A settled reservation at the client rows of ``plan``'s ``shares``: ``refund``
        given back where it was charged (at ``at``), ``debt`` charged ``now``."""
        for i in shares:
            share = plan.shares[i]
            cap = self.table.get(share.cap)
            row = None if cap is None else cap.rows.get(share.client)
            if row is not None:
                _settle_row(row, share, at, now, -refund)
                _settle_row(row, share, now, now, debt)

    def reports(self) -> dict[str, CapReport]:
        return {
            key: CapReport(key, cap.level, cap.declared, cap.report_figures())
            for key, cap in self.table.items()
        }

    def clear(self) -> None:
        self.table.clear()
        self._deadlines.clear()
