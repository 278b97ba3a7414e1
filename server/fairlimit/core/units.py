"""Time units and windows: epoch-aligned fixed windows as envoyproxy/ratelimit counts them,
any whole number of seconds, calendar windows in a time zone, and the smooth algorithms."""

import enum
import math
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo


class Unit(enum.Enum):
    """A rate-limit unit; the value is the window length in seconds."""

    SECOND = 1
    MINUTE = 60
    HOUR = 3600
    DAY = 86400
    WEEK = 7 * 86400
    MONTH = 30 * 86400
    YEAR = 365 * 86400

    @property
    def seconds(self) -> int:
        return self.value

    @classmethod
    def parse(cls, text: str) -> "Unit":
        """The unit named ``text`` (case-insensitive); KeyError when there is none."""
        return cls[text.strip().upper()]

    @classmethod
    def within(cls, seconds: float) -> "Unit":
        """The longest unit no longer than ``seconds`` (SECOND for anything shorter): Envoy's
        enum has no other way to say 10 s or 5 minutes, and a unit that never overstates
        the window keeps Envoy's ``w=`` from promising a longer one (10 s says ``w=1``,
        not ``w=60``)."""
        return max((u for u in cls if u.seconds <= seconds), key=lambda u: u.seconds,
                   default=cls.SECOND)  # fmt: skip


class Algorithm(enum.Enum):
    """How a limit counts: upstream's fixed window, a sliding window, or GCRA."""

    FIXED = "fixed"
    SLIDING = "sliding"
    GCRA = "gcra"


# A sliding window is counted in this many sub-windows (store/counters.py, lua/admit/meters.lua).
SLIDING_PARTS = 20
CALENDAR_UNITS = (Unit.DAY, Unit.WEEK, Unit.MONTH, Unit.YEAR)


@dataclass(frozen=True, slots=True)
class Calendar:
    """Civil days, weeks (from Monday), months or years in a time zone (``zone`` is loaded
    by the config layer: nothing here reads a file)."""

    unit: Unit
    name: str
    zone: tzinfo

    def bounds(self, now: float) -> tuple[int, int]:
        """(start, end) in Unix seconds of the civil period that holds ``now``."""
        day = datetime.fromtimestamp(math.floor(now), self.zone).date()
        first, after = self._period(day)
        return self._at(first), self._at(after)

    def _period(self, day: date) -> tuple[date, date]:
        if self.unit is Unit.DAY:
            return day, day + timedelta(days=1)
        if self.unit is Unit.WEEK:
            monday = day - timedelta(days=day.weekday())
            return monday, monday + timedelta(days=7)
        if self.unit is Unit.MONTH:
            first = day.replace(day=1)
            after = date(first.year + first.month // 12, first.month % 12 + 1, 1)
            return first, after
        return date(day.year, 1, 1), date(day.year + 1, 1, 1)

    def _at(self, day: date) -> int:
        """Local midnight of ``day`` in Unix seconds (the earlier one where DST repeats it;
        where a DST gap skips it, the moment the gap ends)."""
        midnight = datetime(day.year, day.month, day.day, tzinfo=self.zone)
        moved = datetime.fromtimestamp(midnight.timestamp(), self.zone)
        if moved.date() != day:  # skipped by a gap: PEP 495 maps it to before the jump
            midnight = datetime(day.year, day.month, day.day, tzinfo=self.zone).replace(fold=1)
        return math.floor(midnight.timestamp())


UTC_ZONE: tzinfo = UTC


@dataclass(frozen=True, slots=True)
class Shape:
    """A limit that is not a plain epoch-aligned fixed window: calendar windows, or the
    sliding and GCRA algorithms (``burst``: GCRA's hits beyond the steady pace)."""

    algorithm: Algorithm = Algorithm.FIXED
    burst: int = 0
    calendar: Calendar | None = None

    @property
    def tag(self) -> str:
        """What a counter key carries after its window (``#60s``, ``#2592000@UTC``), so
        that no two ways of counting share a key."""
        if self.calendar is not None:
            return "@" + self.calendar.name
        return "s" if self.algorithm is Algorithm.SLIDING else "g"


def window_start(window: int, now: float) -> int:
    """Start (Unix seconds) of the window of length ``window`` that holds ``now``."""
    return math.floor(now / window) * window


def bounds(window: int, shape: Shape | None, now: float) -> tuple[int, int]:
    """(start, end) of the fixed window that holds ``now`` (a calendar one, or epoch-aligned
    of ``window`` seconds)."""
    if shape is not None and shape.calendar is not None:
        return shape.calendar.bounds(now)
    start = window_start(window, now)
    return start, start + window


def seconds_until_reset(window: int, now: float) -> int:
    """Whole seconds from ``now`` until its window of length ``window`` ends, rounded up.

    As envoyproxy/ratelimit reports it (``window - now % window`` in whole seconds): 1 to
    ``window``, never 0, so that a per-second limit never tells a client to retry at once,
    into the window that just refused it.
    """
    return window - math.floor(now) % window


# the float noise of ``end - now`` (GCRA's tat is a sum of intervals): a remaining time
# this close above a whole second is that second, so the reset never gains one by rounding
RESET_EPSILON = 1e-9


def seconds_until(end: float, now: float) -> int:
    """Whole seconds from ``now`` until ``end`` (any instant: a sliding window's or GCRA's
    is rarely a whole second), the true remaining time rounded up, at least 1. For a
    whole-second ``end`` it is ``seconds_until_reset``'s figure; rounding ``now`` down
    first instead overstated a fractional ``end`` by up to a second."""
    return max(1, math.ceil(end - now - RESET_EPSILON))
