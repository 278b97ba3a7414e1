"""Fairness v3 at a cap: client rows, the division of the cap, and the per-request rule.

The memory store keeps these values in objects, the Redis script in hash fields; both run the
same closed forms (``store/redis/lua/admit/`` mirrors this module function by function,
and ``ROW_FIELDS`` / ``DIVISION_FIELDS`` name the hash fields), so both give the same doubles.

The rule (docs/fairness.md states it with its reasons). Per cap of C hits per window W, with
period P = min(W, 1 s), each client i *wants* ``min(L_i, d_i + r_i·(end - t)/P)``: what it
asked this window so far (refused hits included) plus its predicted rate r_i (hits per
period: what it asked over the last window's length, ``predicted``) times the periods left.
Weighted max-min over the wants gives the level λ; a client whose want is above λ·w_i is
*held* at λ·w_i, the others are *open* (they get what they want). The division keeps
only sums: the weight W_H of the held clients and the open wants as ``fixed + rate·left``,
which shrink as the window runs out. The asking client takes its own part out and is put
back in with this request counted, so its share is the exact water-filling insertion of its
demand into the others' division (``verdict``): O(1) per request. A newcomer or a burst is
therefore counted at once, and held clients yield to it from that request on.

A held client is paced by its own history: of its share it may not yet take what it is
predicted (by its history alone, not by the burst under way) to ask for later in the window,
up to the part of the window still to come; one that had asked all it asked in the window
before by this point of it comes in a lump (a page), and is not paced (``_asked_by_now``).
A steady client is so paced linearly; a client with no history (a newcomer, a one-shot
burst) takes its share at once, and one that arrived during a window longer than a period
(a burst of seconds at a cap of minutes) keeps back only what the clients declared and not
yet seen would take (``_arrived``). A request is a whole hit: at its last hits of a window
a held client's share λ·w_i is rounded up while the cap has the hit, and the fraction it got
above or below λ·w_i is carried into the next window as a credit or a debt below one hit, so
the rounding rotates (a cap of 100 for 30 clients admits 100 a window, not 90).

Light clients (open below their own limit: page loads) that come back at a gap of two
windows or more are expected again (``Light``, ``schedule``): the cap holds the hits it
expects and has not seen yet back from its paced clients (``reserve``), each keeping its
part while its own predicted demand could still take it back (``_for_light``), so a page
late in a window finds its share and a reserve nobody claims is not wasted (fairness v4).

The division is recomputed from every row (O(n log n)) at each new period, up to ``SPLIT``
times a period while the cap has had hits enough since (amortised), and at once when a
request finds the cap newly contended (``contended``; again only after hits enough).
"""

import math
from collections.abc import Iterable

from fairlimit.core.fairshare import PeriodDemand, water_level

ALPHA = 0.5  # EWMA weight of the last period's demand
STALE = 64  # periods after which a row's history counts as gone (0.5^64 ~ 5e-20)
SPLIT = 4  # sub-periods per period at which the division may be recomputed
FORCES = 64  # division ids a sub-period: its first, then up to 63 forced remakes
AMORTISE = 8  # recompute at a sub-period only after rows / AMORTISE requests since the last
LEAD = 1 / 32  # of a period: how far ahead of the elapsed window a paced client may be
BURST = 2  # asking this many times faster than its history, a client is bursting
EPSILON = 1e-9
ROUNDING = 2  # a held client's last hits of a window (by its history): its share rounded up
RELEASE = 1 / 512  # of a period: a paced client's demand this close to the window's end
# counts as arriving now (requests come in lumps), so the light reserve is all released by
# then (2 ms of a second: a page due at 0.99 of its window still finds its reserve)

# A row's part in the division.
NONE, OPEN, HELD = 0, 1, 2


class Row:
    """One client at one cap (amounts in hits; ``limit`` and ``weight`` as last seen)."""

    __slots__ = (
        *("admitted", "asked", "credit", "epoch", "fixed", "history", "kind"),
        *("last_admitted", "last_asked", "limit", "mass", "period", "period_admitted"),
        *("period_asked", "previous", "previous_last", "rate", "seen", "weight", "window"),
        *("page", "gap", "booked", "first"),
    )

    def __init__(self, limit: float, weight: float) -> None:
        self.window = -1  # the window start admitted, asked and credit belong to
        self.admitted = self.asked = 0.0
        self.previous = -1.0  # what it asked in the window before (-1: it was not there)
        self.previous_last = 0.0  # when it last asked in the window before
        self.seen = 0.0  # when it last asked
        self.credit = 0.0  # the fraction of a hit carried from the window before (< 0: owed)
        self.period = -1  # the period period_asked and period_admitted belong to
        self.period_asked = self.period_admitted = 0.0
        self.history = 0.0  # EWMA of its demand per period, up to the period before
        self.mass = 0.0  # the EWMA's weight over the periods since the row was made
        self.last_asked = self.last_admitted = 0.0  # the period before's (fairness figures)
        self.epoch = -1  # the division its live part (kind, fixed, rate) belongs to
        self.kind = NONE
        self.fixed = self.rate = 0.0
        self.limit, self.weight = limit, weight
        self.page = -1  # the window start of its last light request (``schedule``)
        self.gap = 0.0  # windows between its last two windows of light requests
        # the window start its page of window ``page`` was booked for (``schedule``); it is
        # that window only when the page came there, at the same gap as the page before it
        self.booked = -1.0
        self.first = -1.0  # when it first asked in window ``window`` (before it: not yet)


# Row attribute -> field of the row in the Redis rows hash (``<field>:<client>``); the
# script's ROW table is generated from this one (store/redis/script.py).
ROW_FIELDS = {
    "window": "ws",
    "admitted": "a",
    "asked": "d",
    "previous": "pw",
    "previous_last": "pt",
    "seen": "t",
    "credit": "c",
    "period": "pk",
    "period_asked": "pd",
    "period_admitted": "pa",
    "history": "r",
    "mass": "m",
    "last_asked": "q",
    "last_admitted": "qa",
    "epoch": "e",
    "kind": "k",
    "fixed": "f",
    "rate": "fr",
    "limit": "l",
    "weight": "w",
    "page": "lg",
    "gap": "gp",
    "booked": "bk",
    "first": "ft",
}
WHOLE_FIELDS = frozenset({"window", "period", "epoch", "kind", "page"})
# The Row attributes a division reads (``divide``, ``last_period`` and what they call): a
# row read only to divide needs no others (a test holds the two to the same division).
DIVIDED_BY = (
    *("window", "asked", "previous", "previous_last", "seen", "gap", "page", "booked"),
    *("limit", "weight", "history", "mass", "period", "period_asked", "period_admitted"),
    *("last_asked", "last_admitted", "first"),
)


class Clock:
    """Where ``now`` sits for a cap of ``window`` s: period, sub-period, window start.

    A plain slotted class, worked out once: one is made per claim of every request, and
    a request reads ``left`` several times.
    """

    __slots__ = ("end", "epoch", "left", "now", "period", "period_len", "start", "window")

    def __init__(self, window: int, period_len: float, now: float) -> None:
        self.window, self.period_len, self.now = window, period_len, now
        self.period = math.floor(now / period_len)
        self.epoch = math.floor(now * SPLIT / period_len)
        self.start = math.floor(now / window) * window
        self.end = self.start + window
        self.left = (self.end - now) / period_len  # periods left in the window

    @property
    def into(self) -> float:
        """The part of the current period gone, and LEAD more."""
        return (self.now - self.period * self.period_len) / self.period_len + LEAD

    @property
    def elapsed(self) -> float:
        """φ: the part of the window gone, and ``LEAD`` of a period more."""
        return min(1.0, (self.now - self.start + LEAD * self.period_len) / self.window)


def _history(row: Row, gap: int) -> tuple[float, float]:
    """(history, mass) of ``row`` ``gap`` periods on: the EWMA of its demand per period over
    the periods it has been seen, bias-corrected, so that its first whole period counts in
    full (not at ALPHA of it); gone after STALE periods."""
    if gap > STALE:
        return 0.0, 0.0
    if row.period < 0:
        return row.history, row.mass
    keep = 1 - ALPHA
    decay = keep ** (gap - 1)
    total = (ALPHA * row.period_asked + keep * row.history * row.mass) * decay
    mass = 1 - (1 - (ALPHA + keep * row.mass)) * decay
    return total / mass, mass


def fold(row: Row, clock: Clock, closing: float) -> None:
    """Move ``row`` to ``clock``'s period (its history) and window (its counts, its credit);
    ``closing`` is λ of the window before, as its whole demand shares it."""
    if row.period < clock.period:
        gap = clock.period - row.period
        if gap == 1:
            row.last_asked, row.last_admitted = row.period_asked, row.period_admitted
        else:
            row.last_asked = row.last_admitted = 0.0
        row.history, row.mass = _history(row, gap)
        row.period_asked = row.period_admitted = 0.0
        row.period = clock.period
    if row.window != clock.start:
        carried = 0.0
        follows = row.window == clock.start - clock.window
        row.previous = row.asked if follows else -1.0
        row.previous_last = row.seen
        if row.asked > row.admitted and follows:
            # the deficit against its exact max-min share of that window, or the debt: its
            # fraction of a hit, what rounding λ·w down took or up gave (``_paced``); whole
            # hits short are not owed (the hit was there to take), nor whole hits over
            share = min(row.asked, row.limit, closing * row.weight)
            carried = math.fmod(share + row.credit - row.admitted, 1.0)
        row.credit = carried
        row.admitted = row.asked = 0.0
        row.window = clock.start


def _seen(row: Row, clock: Clock) -> tuple[float, float, float, float]:
    """(asked, previous, previous_last, history) of the row as ``fold`` would leave them at
    ``clock``, the row unchanged (a division reads every row; only a request moves its own)."""
    history = row.history
    if row.period < clock.period:
        history = _history(row, clock.period - row.period)[0]
    return (*_in_window(row, clock), history)


def _in_window(row: Row, clock: Clock) -> tuple[float, float, float]:
    """(asked, previous, previous_last) of the row as ``fold`` would leave them at
    ``clock``'s window (``_seen`` without the history, which ``want`` does not read)."""
    if row.window != clock.start:
        follows = row.window == clock.start - clock.window
        return 0.0, row.asked if follows else -1.0, row.seen
    return row.asked, row.previous, row.previous_last


def predicted(row: Row, clock: Clock) -> float:
    """The row's rate in hits per period: what it asked over the last window's length (this
    window so far, and of the window before the part still inside that length, taken as
    spread evenly up to its last request there), so a sparse client keeps its rate between
    requests and a client gone quiet loses it; a row not seen last window, what it asked
    over the part of this window gone, and nothing once it has gone quiet (``_quiet``)."""
    asked, previous, previous_last, _ = _seen(row, clock)
    if previous < 0 and _quiet(row, clock):
        return 0.0
    return _rate(asked, _back(row, clock, previous), previous_last, clock)


def _back(row: Row, clock: Clock, previous: float) -> float:
    """What the client asked in the window before, as its rate counts it: nothing when that
    window held one of its pages and it is booked for a later one (``schedule``: its gap is
    more than one window): a page of 150 every 4 s, predicted again in the second after it
    by its rate over the last second, was counted as open demand still to come, and held
    the clients asking then to the rest (a cap of 600 used 452)."""
    if previous > 0 and 1 < row.gap <= STALE and row.page == clock.start - clock.window:
        return 0.0
    return previous


def _paging(row: Row, clock: Clock) -> bool:
    """Whether, at a cap of one period's window, this window holds a page of a client that
    comes in pages some windows apart and was booked for this one (``schedule``): it is
    predicted by what it has asked, no more (``want``). The cap held its page back in its
    reserve (``reserve``) until it came; its rate, its page taken as kept up to the
    window's end, counted it as a client still asking once its page was over, and held the
    others to the rest (a cap of 157 a second: 73 for a page at 0.785 of it, and the batch
    job beside it 78 of its 84). A page nobody expected (a client's second, its gap not
    known before it) keeps its rate: room that the pacing leaves for the pages as
    unexpected as it (the shared page-loads case: a user's second page at 0.93 of the
    second found 7 of its 8 without it)."""
    # booked for this window, its page is this window's and its gap more than one window
    return clock.window == clock.period_len and row.booked == clock.start


def _quiet(row: Row, clock: Clock) -> bool:
    """Whether a client has gone quiet in this window: it has not asked for longer than it
    had been asking in it (its first request here to its last), a period more, and the gap
    between hits that its rate predicts (the part of the window gone over the hits it
    asked). A client not seen in the window before is predicted by its rate over the part
    of the window gone, as if it had been asking since the window began; once it has gone
    quiet, a burst that is over, it is predicted nothing more (it would hold its rate to the
    window's end: at a cap of an hour, capacity left unused while a client beside it is
    refused). A client spreading its requests comes back sooner, and at a cap of one
    period's window no client is quiet. A client that has asked one hit is never quiet in
    the window (it has not been quiet for longer than the window has gone): its rate, one
    hit over the part gone, fades as the window runs on. Taken as quiet after a period,
    six clients asking once every 4 s from a minute's start, each seen once, were predicted
    nothing 1.5 s in, and a one-shot then took the minute: 1 of each one's 15."""
    return (
        row.window == clock.start
        and row.first >= clock.start
        and row.asked > 0
        and clock.now - row.seen
        > row.seen - row.first + clock.period_len + (clock.now - clock.start) / row.asked
    )


def _rate(asked: float, previous: float, previous_last: float, clock: Clock) -> float:
    if previous < 0:
        gone = (clock.now - clock.start) / clock.period_len
        return asked / max(1.0, gone)
    since = clock.now - clock.window  # where the last window's length begins
    inside = 0.0
    if previous_last > since:
        spread = previous_last - (clock.start - clock.window)
        inside = min(1.0, (previous_last - since) / spread) if spread > 0 else 1.0
    return (asked + previous * inside) * clock.period_len / clock.window


def want(row: Row, clock: Clock, extra: float = 0.0) -> tuple[float, float]:
    """(fixed, rate): the row's want is ``fixed + rate·left`` (its limit when that is less).

    At a cap of one period's window (a second), a client that comes every window (its
    light requests one window apart, ``schedule``) is predicted by the window before: until
    the point of that window where it last asked has come round in this one (and LEAD of a
    period more), it wants what it asked then, while it has not asked more; once past it,
    having asked as much, no more. Its rate, taken as spread evenly up to that point,
    predicted little of a lump still to come (a page load every second at its own phase),
    and during and after the lump more than it asks; a steady client's rate predicts about
    as much as its window before. (At longer windows a client's rate is kept per period,
    and a window before holds many of them: a tenant's tokens a minute came out at a lower
    utilisation predicted so.) A client that comes in pages some windows apart is predicted
    by what it asked, in its page's window (``_paging``), and in the window after it by
    what it asks there (``_back``)."""
    asked, previous, previous_last = _in_window(row, clock)
    if row.gap > 1:  # (the call only for a client that comes windows apart)
        previous = _back(row, clock, previous)
    fixed, rate = asked + extra, _rate(asked, previous, previous_last, clock)
    if previous < 0 and rate:  # new in the window (and in it: asked), unless gone quiet
        seen, first, now = row.seen, row.first, clock.now  # ``_quiet``, inline: a want is
        gap = (now - clock.start) / asked  # worked out often (gap: between hits, by its rate)
        if first >= clock.start and now - seen > seen - first + clock.period_len + gap:
            rate = 0.0
    if row.gap == 1.0 and previous >= 0 and clock.window == clock.period_len:  # every window
        if previous_last + LEAD * clock.period_len > clock.now - clock.window:
            if fixed <= previous:  # no more asked than then: its lump (or its rest) to come
                fixed, rate = previous, 0.0
        elif asked >= previous:  # past where it last asked then, and as much asked: done
            rate = 0.0
    elif row.booked == clock.start and _paging(row, clock):  # (a want is worked out at
        rate = 0.0  # every request: the call only for a page booked for this window)
    if fixed + rate * clock.left > row.limit:
        return row.limit, 0.0
    return fixed, rate


def part(row: Row, clock: Clock, level: float, extra: float = 0.0) -> tuple[int, float, float]:
    """(kind, fixed, rate) of the row in a division of ``level`` made at ``clock``."""
    fixed, rate = want(row, clock, extra)
    wanted = fixed + rate * clock.left
    if wanted <= 0:
        return NONE, 0.0, 0.0
    if wanted > level * row.weight:
        return HELD, 0.0, 0.0
    return OPEN, fixed, rate


class Division:
    """A cap's division: λ when it was made, the held weight and the open wants' sums, and
    what has happened since (requests, a forced remake).

    Rows are not written when a division is made: a row untouched since takes its part as
    ``part`` gives it at the division's instant (``leave``), so the Redis script needs only
    these sums. ``excluded`` is the client that asked when the division was forced: it is
    counted in λ, not in the sums, since its request is decided next.
    """

    __slots__ = (
        *("asks", "at", "closing", "cold", "epoch", "excluded", "fixed", "forced"),
        *("held", "level", "rate", "rows", "top"),
    )

    def __init__(self, epoch: int, at: float, level: float, rows: int) -> None:
        # epoch: FORCES x the sub-period it was made in, + the forced remakes before it in
        # that sub-period (a row's live part names
        # the division it belongs to, so a remade division is a new one)
        self.epoch, self.at, self.level, self.rows = epoch, at, level, rows
        self.held = self.fixed = self.rate = 0.0
        self.top = 0.0  # the largest open want per weight counted (then): an upper bound
        self.asks = 0  # requests since it was made
        self.forced = 0  # forced remakes in its sub-period, this one included
        self.excluded = ""
        self.cold = 0  # 1 when no row has any history: every held client is then paced
        self.closing = math.inf  # λ of the window before over its whole demand (the credit)


# Division attribute -> field of the cap's meta hash in Redis.
DIVISION_FIELDS = {
    "epoch": "e",
    "at": "t",
    "level": "v",
    "rows": "n",
    "held": "h",
    "fixed": "f",
    "rate": "fr",
    "asks": "k",
    "forced": "x",
    "cold": "c",
    "closing": "pl",
    "top": "tp",
    "excluded": "xc",  # last: a client value may hold any character (the Lua reads the rest)
}


def divide(
    rows: Iterable[tuple[str, Row]],
    capacity: float,
    clock: Clock,
    asker: str = "",
    extra: float = 0.0,
    closing: float | None = None,
    forced: int = 0,
) -> Division:
    """The division of ``capacity`` over the (client, row) pairs as they stand at ``clock``
    (rows are not changed), the client ``asker`` counted in λ with ``extra`` more hits
    asked and left out of the sums (the ``forced``-th remake of the sub-period); ``closing``
    carried from a division of the same window, else worked out from the rows. O(n log n)."""
    # One pass, with ``_seen``, ``predicted`` and ``want`` inlined (the same operations in
    # the same order, so the same doubles as ``part`` gives a row later): at 100k clients a
    # call per row is most of the time.
    listed: list[tuple[str, Row]] = []
    fixeds: list[float] = []
    rates: list[float] = []
    wants: list[float] = []
    limits: list[float] = []
    weights: list[float] = []
    add_row, add_fixed, add_rate = listed.append, fixeds.append, rates.append
    add_want, add_limit, add_weight = wants.append, limits.append, weights.append
    now, start, window, length = clock.now, clock.start, clock.window, clock.period_len
    before, since, left = start - window, clock.now - clock.window, clock.left
    gone = (now - start) / length
    first = gone if gone > 1.0 else 1.0
    cold = 1
    pairs = list(rows)
    for pair in pairs:
        row = pair[1]
        if cold and (row.history > 0 or row.period_asked > 0) and _has_history(row, clock):
            cold = 0
        if row.window != start:
            asked, last = 0.0, row.seen
            previous = row.asked if row.window == before else -1.0
        else:
            asked, previous, last = row.asked, row.previous, row.previous_last
        if previous > 0 and 1 < row.gap <= STALE and row.page == before:
            previous = 0.0  # a page the window before, booked for a later one (``_back``)
        if previous < 0:
            rate = asked / first
            if (
                rate
                and row.first >= start
                and now - row.seen > row.seen - row.first + length + (now - start) / asked
            ):
                rate = 0.0  # gone quiet (``_quiet``; asked here: its row is in this window)
        elif last > since:
            spread = last - before
            inside = (last - since) / spread if spread > 0 else 1.0
            rate = (asked + previous * (inside if inside < 1.0 else 1.0)) * length / window
        else:
            rate = (asked + previous * 0.0) * length / window
        fixed = asked + extra if pair[0] == asker else asked
        if row.gap == 1.0 and previous >= 0 and window == length:  # every window (``want``)
            if last + LEAD * length > since:
                if fixed <= previous:
                    fixed, rate = previous, 0.0
            elif asked >= previous:
                rate = 0.0
        elif window == length and row.booked == start:
            rate = 0.0  # its page of this window, booked for it (``_paging``)
        limit = row.limit
        if fixed + rate * left > limit:
            fixed, rate = limit, 0.0
        wanted = fixed + rate * left
        if wanted > 0:
            add_row(pair)
            add_fixed(fixed)
            add_rate(rate)
            add_want(wanted)
            add_limit(limit)
            add_weight(row.weight)
    level = water_level(wants, limits, weights, capacity) if wants else math.inf
    division = Division(FORCES * clock.epoch + forced, clock.now, level, len(listed))
    division.closing = closing if closing is not None else _closing(pairs, capacity, clock)
    division.forced = forced
    division.cold = cold
    held = fixed_sum = rate_sum = top = 0.0
    for (client, _), fixed, rate, wanted, weight in zip(
        listed, fixeds, rates, wants, weights, strict=True
    ):
        if client == asker:
            division.excluded = asker
        elif wanted > level * weight:
            held = max(0.0, held + weight)
        else:
            fixed_sum += fixed
            rate_sum += rate
            ratio = wanted / weight
            top = ratio if ratio > top else top
    division.held, division.fixed, division.rate = held, fixed_sum, rate_sum
    division.top = top
    return division


def _has_history(row: Row, clock: Clock) -> bool:
    """Whether the row has any demand history at ``clock``."""
    if row.period < clock.period:
        return _history(row, clock.period - row.period)[0] > 0
    return row.history > 0


def _closing(pairs: list[tuple[str, Row]], capacity: float, clock: Clock) -> float:
    """λ of the window before ``clock``'s over what each row asked in it."""
    before = clock.start - clock.window
    asked: list[float] = []
    limits: list[float] = []
    weights: list[float] = []
    for _, row in pairs:
        if row.window == before:
            demand = row.asked
        elif row.window == clock.start:
            demand = max(row.previous, 0.0)
        else:
            continue
        if demand > 0:
            asked.append(demand)
            limits.append(row.limit)
            weights.append(row.weight)
    return water_level(asked, limits, weights, capacity) if asked else math.inf


def same_window(division: Division, clock: Clock) -> bool:
    """Whether ``division`` was made in ``clock``'s window."""
    return math.floor(division.at / clock.window) * clock.window == clock.start


def _count(
    division: Division, kind: int, weight: float, fixed: float, rate: float, sign: float
) -> None:
    if kind == HELD:
        division.held = max(0.0, division.held + sign * weight)
    elif kind == OPEN:
        division.fixed += sign * fixed
        division.rate += sign * rate


def leave(division: Division, row: Row, client: str, window: int, period_len: float) -> None:
    """Take the row's part out of the division (before its request is decided): its live
    part, or the part it had when the division was made."""
    if row.epoch == division.epoch:
        _count(division, row.kind, row.weight, row.fixed, row.rate, -1.0)
    elif client != division.excluded:
        kind, fixed, rate = part(row, Clock(window, period_len, division.at), division.level)
        _count(division, kind, row.weight, fixed, rate, -1.0)
    row.epoch, row.kind = division.epoch, NONE


def enter(division: Division, row: Row, kind: int, clock: Clock) -> None:
    """Put the row back in the division as ``kind``, its request counted."""
    row.epoch = division.epoch
    row.fixed, row.rate = want(row, clock) if kind == OPEN else (0.0, 0.0)
    row.kind = kind
    _count(division, kind, row.weight, row.fixed, row.rate, 1.0)
    if kind == OPEN:
        division.top = max(division.top, (row.fixed + row.rate * clock.left) / row.weight)


class ShareClaim:
    """One client's claim at a cap: what it asks and what bounds it (made per request, so
    slotted and not frozen)."""

    __slots__ = (
        *("capacity", "declared", "hits", "limit", "nested", "reserve", "sized", "wanted"),
        "weight",
    )

    def __init__(
        self,
        hits: int,
        limit: float,
        weight: float,
        capacity: float,
        declared: int,
        sized: bool,
        nested: bool = False,
    ) -> None:
        self.hits, self.limit, self.weight = hits, limit, weight
        self.capacity = capacity  # of the cap, or what the cap above gives it when less
        self.declared = declared  # active_clients
        self.sized = sized  # capacity >= active_clients x limit: never paced
        self.nested = nested  # the client is itself a cap (a tenant): it paces its own
        self.reserve = 0.0  # hits the cap holds for light demand still to come (``reserve``)
        # the row's want with this request, once ``contended`` has worked it out: ``verdict``
        # asks the same of the same row (its request not yet recorded)
        self.wanted: tuple[float, float] | None = None


def contended(division: Division, row: Row, claim: ShareClaim, clock: Clock) -> bool:
    """Whether the request finds the cap newly contended: nobody held, the open wants with
    this client's no longer fit, and some open client wants more per weight than the level
    that holding this client at the room left would set (so it too must be held: the
    division must be remade with this client counted). A division
    remade so is remade again only after rows / AMORTISE hits asked since."""
    if division.held > 0 or division.forced >= FORCES - 1:
        return False
    if division.forced and division.asks * AMORTISE < division.rows:
        return False  # remade for a request already: again once hits enough have come
    fixed, rate = claim.wanted = want(row, clock, max(claim.hits, 1))
    wanted = fixed + rate * clock.left
    room = claim.capacity - division.fixed - division.rate * clock.left
    # this client held at the room left is exact unless an open client wants more than the
    # level that gives it: room / its weight, per unit of weight
    return wanted > room + EPSILON and division.top > room / row.weight + EPSILON


class Verdict:
    """A claim's verdict: the most the client may hold after the request (``bound``), its
    share of the window unpaced (what a cap nested below it may divide), its part, and
    whether its demand is light (open, below its own limit: ``Light``)."""

    __slots__ = ("bound", "kind", "light", "share")

    def __init__(self, bound: float, share: float, kind: int, light: bool = False) -> None:
        self.bound, self.share, self.kind, self.light = bound, share, kind, light


def verdict(row: Row, division: Division, claim: ShareClaim, clock: Clock, total: float) -> Verdict:
    """The claim's verdict at the cap whose counter stands at ``total``. The row has left
    the division."""
    fixed, rate = claim.wanted or want(row, clock, max(claim.hits, 1))
    left = clock.left
    wanted = fixed + rate * left
    # the open clients' requests still to come, whole: a fraction of one is no request
    # (the last moments of a window must not keep a hit for a client gone quiet)
    coming = math.floor(division.rate * left + EPSILON)
    room = max(0.0, claim.capacity - division.fixed - coming)
    if wanted * (division.held + row.weight) <= room * row.weight + EPSILON:
        share = claim.limit  # nobody held: uncontended
        if division.held > 0:  # the level with this client open (its want is below it)
            share = min(share, (room - wanted) / division.held * row.weight)
        if rate or fixed < claim.limit or division.cold or room - wanted >= 1:
            bound = _cold(share, division, row, claim, clock, total)
            return Verdict(bound, share, OPEN, fixed < claim.limit)
        # held by its own limit, which takes all the cap has left: paced as a held client,
        # so a newcomer still finds the cap open; and counted as one, so a newcomer's
        # insertion sees it yield (open at its limit it would leave the newcomer no room)
        bound = _paced(share, row, division, claim, clock, total, coming)
        return Verdict(bound, share, HELD, _in_page(row, clock))
    share = room * row.weight / (division.held + row.weight)
    bound = _paced(share + row.credit, row, division, claim, clock, total, coming)
    return Verdict(bound, share + row.credit, HELD, _in_page(row, clock))


def _in_page(row: Row, clock: Clock) -> bool:
    """Whether a held request is light all the same: the rest of a page, its client come
    back windows apart (booked for a later window, ``schedule``) and light earlier in this
    one. Counted and booked with the page's first requests, it is expected next time whole
    (``reserve``): booked only while open, a page held partway by its rate (its user's
    second, not yet expected) was expected at its third with part of itself, and got 61
    of 82 there."""
    return row.page == clock.start and 1 < row.gap <= STALE


def _bursting(row: Row, share: float, clock: Clock) -> bool:
    """Whether the client asks more than BURST times as fast this period as its history
    says, and its history is below its share (a client whose history alone passes its share
    is greedy, however its rate jitters from one period to the next), or, at a cap of one
    period's window, is one period old (``mass`` ALPHA): a burst that began late in the
    window before has a history of that part of it alone, not a rate it kept (a burst
    across a second's edge, paced by it, got 11 of its 92 in the second second; at longer
    windows ``_arrived`` serves such a burst). Such a row is measured against the part of
    the period gone without the LEAD that spares a steady client's first requests, and a
    hit more: with it, the first 13 ms of a burst's tail (240 over 0.2 s from 6.85 s, 1,200
    a second beside a history of 180) went paced, and the tail got 45 of the 60 it asked
    after 7.0 s (max-min 60)."""
    young = row.mass <= ALPHA + EPSILON and clock.window <= clock.period_len
    if young:
        return row.period_asked > BURST * row.history * (clock.into - LEAD) + 1.0
    if row.history * clock.window / clock.period_len >= share:
        return False
    return row.period_asked > BURST * row.history * clock.into


def _paced(
    share: float,
    row: Row,
    division: Division,
    claim: ShareClaim,
    clock: Clock,
    total: float,
    coming: int,
) -> float:
    """The bound of a client held at ``share`` (``coming``: the open clients' requests still
    to come, whole, as ``verdict`` worked them out): its part of the cap's reserve for light
    demand is held back while its history says it will ask for it later (``_for_light``);
    what its history predicts it will ask for
    later in the window waits for later (up to the part still to come), unless it had asked
    all it asked in the window before by this point of it (``_asked_by_now``); a client asking
    faster than that this period is bursting, and takes its share now; a nested cap paces
    its own clients; a cap sized for its clients is never paced; where nobody has history
    it is paced by the elapsed window, unless it arrived during it (``_arrived``: then its
    cold split, ``_cold``, at once; a one-shot 0.5 s into a new cap of a minute got 9 hits
    of a minute paced), or has asked more than that split within the period
    (``_cold_burst``). At its last ROUNDING hits of the window (as its
    history predicts them) or in its last LEAD, its share is rounded up to a whole hit, while
    the cap has it beside the open clients' requests still to come and the reserve."""
    held_back = part = kept = 0.0
    eased = False
    if not claim.sized:
        if division.cold:
            if not _arrived(row, clock) and not _cold_burst(row, division, claim, clock):
                held_back = share * (1 - clock.elapsed)
        elif not claim.nested and not _bursting(row, share, clock):
            part, kept = _for_light(share, row, division, claim, clock)
            share -= kept
            held_back = min(share * (1 - clock.elapsed), row.history * clock.left)
            if _asked_by_now(row, clock):
                held_back = 0.0
            if _arrived(row, clock):
                unseen = _unseen(share, row, division, claim)
                eased = unseen < held_back
                held_back = min(held_back, unseen)
    bound = share - held_back
    if held_back and row.admitted + 1 <= max(bound, 1.0):
        # below its paced share (and a paced client may always hold one request), a request
        # of many hits (tokens) may pass it by less than itself, within its share: else it
        # would wait for the pace to pass a whole request
        bound = max(bound, min(share, row.admitted + max(claim.hits, 1)))
    beside = claim.capacity - total - coming  # the cap left beside the open clients' to come
    if kept and kept >= part:
        # holding its whole part, it leaves the whole reserve in the cap, and the open
        # clients' requests still to come, which the reserve counts on (``reserve``): the
        # held clients' fractional shares and credits (and the request above) must not eat
        # into them
        bound = min(bound, row.admitted + beside - claim.reserve)
    if eased:
        # paced less than its history says, it leaves the open clients' requests still to
        # come in the cap (a client held now may hold more than its share: it took it while
        # open, before this one came)
        bound = min(bound, row.admitted + beside)
    top = math.ceil(share - EPSILON)
    if bound < top and (row.history > 0.0 or _cold_rounding(division, clock)):
        # its share rounded up, at its last hits of the window: paced, whole requests
        # never reach a fractional share (3.33 a window took 3), and every held client
        # rounding down left a hit each unused (a cap of 100 for 30 clients admitted 90);
        # the hit above its share is carried as a debt (``fold``), so the rounding rotates.
        # In a cap's first window nobody has history to tell its last hits
        # (``_cold_rounding``: 19 clients at a cap of 127 took 6 of their 6.68 each)
        ahead = row.history * clock.left  # its hits still to come, this request's included
        if clock.elapsed >= 1.0 or ahead < ROUNDING + 1:
            lag = max(0, math.floor(ahead + EPSILON) - 1) if clock.elapsed < 1.0 else 0
            spare = math.floor(beside - claim.reserve + EPSILON)  # beside the reserve too
            bound = max(bound, min(float(top - lag), row.admitted + spare))
    return _cold(bound, division, row, claim, clock, total)


def _cold_rounding(division: Division, clock: Clock) -> bool:
    """Whether a held client's share is rounded up at a cap where nobody has history (its
    first period: the first window of a cap of one period's window; a longer window's
    last LEAD is never in it), which cannot tell a client's last hits: in the window's
    last LEAD, and only while no open client is predicted to ask again (a fraction of its
    request, taken as no request, would go to the rounding: a client asking 5 a second
    beside clients held at 16 lost its fifth at 0.98 of the first second)."""
    return bool(division.cold) and clock.elapsed >= 1.0 and division.rate <= 0.0


def _asked_by_now(row: Row, clock: Clock) -> bool:
    """Whether the client, in the window before, had asked all it asked there by this point
    of it (and LEAD of a period more): it comes in a lump (a page of requests), and its
    history, which pacing spreads over the rest of the window, predicts nothing of it still
    to come. A page bigger than the client's share, paced so, got one request of it."""
    by_now = clock.now - clock.window + LEAD * clock.period_len  # this point, a window before
    return row.previous >= 0 and row.previous_last <= by_now


def _arrived(row: Row, clock: Clock) -> bool:
    """Whether the client arrived during this window, at a cap whose window is longer than
    a period: it first asked in the window after more of it had gone than it has been
    asking since. Its history is then that of a burst of a few periods, not a rate it has
    kept: pacing it as if it kept that rate to the window's end would hold back, for
    nobody, what max-min gives a burst of seconds at a cap of minutes or hours. So has a
    client whose one period of history (``mass`` ALPHA) is the last of the window before: a
    burst that runs on across the window's edge. Paced by that period, the part of a burst
    from 0.1 s before a minute's edge after it got 1 hit of the 533 max-min gave it (a
    minute's cap of 4,800 beside eight steady clients), and the others were held to their
    shares beside its: 0.89 of the minute used."""
    if clock.window <= clock.period_len:
        return False
    if row.previous >= 0.0 and row.mass <= ALPHA + EPSILON:
        return True
    if row.first < clock.start:
        return False
    return clock.now - row.first < row.first - clock.start


def _unseen(share: float, row: Row, division: Division, claim: ShareClaim) -> float:
    """What a client that arrived during the window (``_arrived``) keeps back of ``share``:
    what the clients declared (``active_clients``) and not yet in the division would take
    from it, each of weight 1 held beside it; nothing when all have come."""
    unseen = claim.declared - division.rows
    if unseen <= 0:
        return 0.0
    return share * unseen / (division.held + row.weight + unseen)


def _for_light(share: float, row: Row, division: Division, claim: ShareClaim, clock: Clock
               ) -> tuple[float, float]:  # fmt: skip
    """(part, kept): of the cap's reserve for light demand still to come
    (``claim.reserve``), the paced client's part by weight among the held, and what it
    keeps of it: as much as its own predicted demand in the rest of the window (at most a
    period of it, up to RELEASE before the end) covers beside what pacing already keeps
    for later. So the reserve is released as that demand runs out: a reserve nobody claims
    in time goes back to the client while it still asks, and is not wasted."""
    if claim.reserve <= 0:
        return 0.0, 0.0
    part = claim.reserve * row.weight / (division.held + row.weight)
    # at most a period ahead: what it asks while held includes its retries, which stop
    # once it is admitted, so a longer forecast overstates what it could take back
    coming = row.history * min(max(0.0, clock.left - RELEASE), 1.0)
    margin = coming - min(share * (1 - clock.elapsed), coming)
    return part, (part if part < margin else margin)


def _cold(
    bound: float, division: Division, row: Row, claim: ShareClaim, clock: Clock, total: float
) -> float:
    """At a cap where nobody has history, a client takes at most its equal split among the
    active clients declared (or seen), or what the elapsed window leaves beside the others,
    and always one hit: a split below one (a cap of 5 a minute for 10 declared clients) is
    no request at all, and would refuse a new client's first one while nothing is
    contended (the cap's own counter still holds the cap)."""
    if not division.cold or claim.sized:
        return bound
    paced = claim.capacity * clock.elapsed - (total - row.admitted)
    return min(bound, max(_split(row, division, claim), paced, 1.0))


def _split(row: Row, division: Division, claim: ShareClaim) -> float:
    """The client's equal split of a cap where nobody has history: by weight among the
    active clients declared, or seen (and itself) when more (``_cold``)."""
    return claim.capacity * row.weight / max(claim.declared, division.rows + 1)


def _cold_burst(row: Row, division: Division, claim: ShareClaim, clock: Clock) -> bool:
    """Whether, at a cap where nobody has history and whose window is longer than a period,
    the client has asked more than its whole split of the window this period: a burst (no
    client keeps such a rate: it would pass the cap many times over), so it is not paced
    by the elapsed window (it takes its split at once, ``_cold``). Paced, a burst at the
    first instant of a cap of a minute got a sliver of its split, held for it all minute
    while the others were held beside it (the shared burst-at-minute-start case with its
    burst at 0 s: 71 of the 533 max-min gives it, the minute 0.90 used). A steady client
    asking more than its split a window, but not within a period, is paced as before."""
    if clock.window <= clock.period_len:
        return False
    return row.period_asked > _split(row, division, claim)


class Light:
    """A cap's light demand: the hits asked this window by clients open below their own
    limit (page loads, sparse clients, newcomers; ``Verdict.light``), and the hits expected
    in it from the light clients that come back: each is expected again one gap (between
    its last two windows of light requests) after its last, with what it asked then
    (``schedule``; the store keeps that calendar and hands ``roll_light`` the window's)."""

    __slots__ = ("asked", "calendar", "expected", "window")

    def __init__(self) -> None:
        self.window = -1  # the window start ``asked`` and ``expected`` belong to
        self.asked = 0.0
        self.expected = 0.0
        # window start -> light hits expected in it (Redis: meta fields CALENDAR + start)
        self.calendar: dict[float, float] = {}


# Light attribute -> field of the cap's meta hash in Redis (lua/admit/ reads and writes them).
LIGHT_FIELDS = {"window": "lw", "asked": "la", "expected": "le"}
CALENDAR = "lc:"  # + a window start (whole seconds): the light hits expected in that window


def roll_light(light: Light, clock: Clock, expected: float) -> None:
    """Move ``light`` to ``clock``'s window, ``expected`` the light hits the calendar holds
    for it (taken out of the calendar by the store)."""
    if light.window != clock.start:
        light.window, light.asked, light.expected = clock.start, 0.0, expected


def schedule(row: Row, clock: Clock) -> float:
    """A light request of ``row`` at ``clock``: the window start the client is expected back
    in, one gap (between its last two windows of light requests) on; -1 while it has no gap
    yet, a gap of one window (a client seen in the window before is predicted by its rate,
    ``predicted``: booking it too would count it twice) or one past STALE windows. The row
    keeps the window its page of this window was booked for (``booked``, ``_paging``); the
    rest of a page begun in the window before leaves its page window and gap as they are
    (``_continues``)."""
    if row.page != clock.start and not _continues(row, clock):
        row.booked = -1.0
        if row.page >= 0:
            if 1 < row.gap <= STALE:  # the booking made at its last page
                row.booked = row.page + row.gap * clock.window
            row.gap = (clock.start - row.page) / clock.window
        row.page = clock.start
    if 1 < row.gap <= STALE:
        return clock.start + row.gap * clock.window
    return -1.0


def _continues(row: Row, clock: Clock) -> bool:
    """Whether a light request goes on with a page begun in the window before, across the
    edge: the client's page was there, it asked last within LEAD of that window's end and
    now within 2·LEAD of that (one lump), and it does not come every window. Its page
    window and its gap stand (``schedule``), and its hits here are booked a gap on from
    here: taken as a page of this window, a page every 5 s across a second's edge had gaps
    of 1 and 4 by turns and was expected in the wrong seconds (held for nobody there, 3 of
    its 18 where it came)."""
    lead = LEAD * clock.period_len
    return (
        row.page == clock.start - clock.window
        and row.gap != 1.0
        and row.previous_last >= clock.start - lead
        and clock.now - row.previous_last <= 2 * lead
    )


def reserve(light: Light, division: Division, clock: Clock) -> float:
    """The hits a cap holds back from its paced clients for light demand still to come in
    the window: what is expected beyond what has come, and beyond the open clients'
    requests still to come that the division already leaves room for; whole hits, as in
    ``verdict`` (a fraction of a request predicted holds nothing back)."""
    if division.cold:
        return 0.0
    coming = math.floor(division.rate * clock.left + EPSILON)
    return max(0.0, math.floor(light.expected - light.asked + EPSILON) - coming)


def charge(row: Row, hits: int) -> None:
    """Count admitted hits in the row."""
    row.admitted += hits
    row.period_admitted += hits


def record(row: Row, hits: int, now: float) -> None:
    """Count demand (hits asked, admitted or not) at ``now``."""
    row.asked += hits
    row.period_asked += hits
    row.seen = now
    if row.first < row.window:
        row.first = now


def stale_division(division: Division | None, clock: Clock) -> bool:
    """Whether the division must be remade at ``clock``: a new period, or a new sub-period
    after requests enough since (rows / AMORTISE)."""
    if division is None:
        return True
    made = division.epoch // FORCES
    if made == clock.epoch:
        return False
    if made // SPLIT != clock.period:
        return True
    return division.asks * AMORTISE >= division.rows


def last_period(rows: Iterable[Row], capacity: float, clock: Clock) -> PeriodDemand | None:
    """The period before ``clock``'s: each client's demand and admissions, for the fairness
    figures."""
    demand: list[float] = []
    admitted: list[float] = []
    limits: list[float] = []
    weights: list[float] = []
    for row in rows:
        if row.period == clock.period - 1:
            q, qa = row.period_asked, row.period_admitted
        elif row.period == clock.period:
            q, qa = row.last_asked, row.last_admitted
        else:
            continue
        if q > 0:
            demand.append(q)
            admitted.append(qa)
            limits.append(row.limit)
            weights.append(row.weight)
    if not demand:
        return None
    scale = clock.window / clock.period_len
    return PeriodDemand(capacity, scale, demand, admitted, limits, weights)
