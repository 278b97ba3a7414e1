"""A row's predicted rate and its want as the admit script works them out (``predicted``
and ``want`` in lua/admit/rows.lua) against core/sharing.py's, on a real redis-server: the
same doubles for rows after random requests at caps of a second to an hour, a client gone
quiet in its window among them (``sharing._quiet``: a burst that is over is predicted
nothing more), and clients of pages some windows apart (``sharing._paging``: what it asked
in its page's window; ``sharing._back``: not predicted again in the window after one).

The division is made in Python (core/sharing.divide) on memory and on Redis alike; the
script predicts the row of the client asking, so a mirror that drifted would decide that
client's request differently from memory only where the cap is contended, which random
traffic reaches now and then: here each row is compared directly."""

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairlimit.core.sharing import LEAD, STALE, Clock, Row, fold, predicted, schedule, want
from fairlimit.store.redis import script
from helpers import lua_function
from redis_servers import RedisProcess
from sharing_rows import ask, row_of

pytestmark = pytest.mark.behaviour

ROWS_LUA = Path(script.__file__).parent / "lua" / "admit" / "rows.lua"
FIELDS = (
    *("asked", "previous", "previous_last", "seen", "first", "window", "gap", "page"),
    *("booked", "limit"),
)

# ARGV: now, start, window, period_len, extra, then FIELDS of each row; per row its rate
# (``predicted``), or its want's fixed and rate (``want``, the row asking ``extra`` more)
HARNESS = """
local c = {now = tonumber(ARGV[1]), start = tonumber(ARGV[2]), window = tonumber(ARGV[3]),
           period_len = tonumber(ARGV[4])}
c.finish = c.start + c.window
local out = {}
for i = 6, #ARGV, 10 do
  local row = {asked = tonumber(ARGV[i]), previous = tonumber(ARGV[i + 1]),
               previous_last = tonumber(ARGV[i + 2]), seen = tonumber(ARGV[i + 3]),
               first = tonumber(ARGV[i + 4]), window = tonumber(ARGV[i + 5]),
               gap = tonumber(ARGV[i + 6]), page = tonumber(ARGV[i + 7]),
               booked = tonumber(ARGV[i + 8]), limit = tonumber(ARGV[i + 9])}
  for _, x in ipairs(WHAT(row, c, tonumber(ARGV[5]))) do
    out[#out + 1] = string.format('%.17g', x)
  end
end
return out
"""
# (gap, page, booked) of a row, in windows: none; a page in the first window, of a gap of
# 1, 2 or 70; a page in the second, booked for it or not
PAGES = [(0.0, -1, -1), (1.0, 0, -1), (2.0, 0, -1), (70.0, 0, 0), (3.0, 1, 1), (3.0, 1, -1)]
WHAT = {
    "predicted": "local function WHAT(row, c) return {predicted(row, c)} end\n",
    "want": "local function WHAT(row, c, extra) return {want(row, c, extra)} end\n",
}


def functions_source() -> str:
    """``left``, ``predicted`` and ``want`` as rows.lua defines them (each to the ``end``
    that closes it), after the contract's constants they read."""
    headers = ("left(c)", "predicted(row, c)", "want(row, c, extra)")
    found = [lua_function(ROWS_LUA, f"local function {header}") for header in headers]
    return f"local STALE, LEAD = {STALE}, {LEAD!r}\n" + "".join(found)


def in_lua(
    server: RedisProcess, rows: list[Row], clock: Clock, what: str = "predicted", extra: float = 0
) -> list[float]:
    args = [clock.now, clock.start, clock.window, clock.period_len, extra]
    for row in rows:
        args += [getattr(row, name) for name in FIELDS]
    with server.client() as client:
        source = functions_source() + WHAT[what] + HARNESS
        reply = client.eval(source, 0, *[repr(float(a)) for a in args])
    return [float(text) for text in reply]


def wants(rows: list[Row], clock: Clock, extra: float = 0) -> list[float]:
    """Python's wants of ``rows``, flat as ``in_lua`` gives them."""
    return [x for row in rows for x in want(row, clock, extra)]


class TestPredictedInTheScript:
    def test_a_burst_gone_quiet(self, redis_server: RedisProcess) -> None:
        """A burst of 4 requests at 20-23 s of a minute, new in it, one request of 41 at
        20 s and one of a hit at 20 s: at 27.69 the burst's rate so far, at 27.70 nothing
        (quiet 3 s, a period and the minute gone over 40 past its last), the request of 41
        nothing at either, the hit its rate at both (one hit is never quiet); a client seen
        in the window before (30 in the first minute, 10 at 70 s) keeps its rate at 100 s."""
        for now in (27.69, 27.70):
            clock = Clock(60, 1.0, now)
            burst = row_of(*[(20.0 + i, 10) for i in range(4)], window=60)
            rows = [burst, row_of((20.0, 41), window=60), row_of((20.0, 1), window=60)]
            for row in rows:
                fold(row, clock, float("inf"))
            got = in_lua(redis_server, rows, clock)
            assert got == [predicted(r, clock) for r in rows]
            assert [r == 0.0 for r in got] == [now > 27.69, True, False]
        steady, clock = row_of((50.0, 30), (70.0, 10), window=60), Clock(60, 1.0, 100.0)
        fold(steady, clock, float("inf"))
        assert in_lua(redis_server, [steady], clock) == [predicted(steady, clock)] != [0.0]

    def test_pages_some_seconds_apart(self, redis_server: RedisProcess) -> None:
        """Pages of 150 at a cap of a second: at 7.3, after pages at 2.9 and 6.9 s (booked
        for 10 s, ``schedule``), nothing of the second before's 150; after pages at 5.9 and
        6.9 s (a page every second), its rate: the 150 taken as spread over [6, 6.9), 0.6 of
        0.9 still inside the last second, 100 a period; in both, the script's double."""
        rates = []
        for times in ((2.9, 6.9), (5.9, 6.9)):
            row = Row(math.inf, 1.0)
            for now in times:
                ask(row, now, 150, window=1, period=1.0)
                schedule(row, Clock(1, 1.0, now))
            clock = Clock(1, 1.0, 7.3)
            fold(row, clock, float("inf"))
            assert in_lua(redis_server, [row], clock) == [predicted(row, clock)]
            rates.append(predicted(row, clock))
        assert rates == [0.0, pytest.approx(100.0)]

    def test_a_page_in_its_window(self, redis_server: RedisProcess) -> None:
        """Pages of 73 at 1.785, 3.785 and 5.785 s at a second's cap (its gap 2 from its
        second, its third booked for 5 s): at 5.79, its page asked, it wants the 73 and no
        more (``_paging``), asking 1 more the 74; with its second page at 5.785 (not
        booked for that second: nobody expected it), its rate, 73 a period for the 0.21
        left; in the script, the same."""
        booked, second = Row(math.inf, 1.0), Row(math.inf, 1.0)
        for row, times in ((booked, (1.785, 3.785, 5.785)), (second, (3.785, 5.785))):
            for now in times:
                ask(row, now, 73, window=1, period=1.0)
                schedule(row, Clock(1, 1.0, now))
        clock = Clock(1, 1.0, 5.79)
        for row in (booked, second):
            fold(row, clock, float("inf"))
        assert wants([booked, second], clock) == [73.0, 0.0, 73.0, pytest.approx(73.0)]
        assert want(booked, clock, 1) == (74.0, 0.0)
        for extra in (0, 1):
            rows = [booked, second]
            assert in_lua(redis_server, rows, clock, "want", extra) == wants(rows, clock, extra)

    @settings(max_examples=50, deadline=None)
    @given(
        st.sampled_from([(1, 1.0), (10, 0.5), (60, 1.0), (3600, 1.0)]),
        st.lists(
            st.tuples(
                st.sampled_from([0, 1, None]),  # within the first window, the second, or both
                st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(1, 12)), max_size=8),
            ),
            min_size=1,
            max_size=5,
        ),
        st.floats(0.0, 0.5),
        st.lists(st.sampled_from(PAGES)),
    )
    def test_random_rows_predict_alike(
        self,
        redis_server: RedisProcess,
        cap: tuple[int, float],
        clients: list[tuple[int | None, list[tuple[float, int]]]],
        after: float,
        pages: list[tuple[float, int, int]],
    ) -> None:
        """Rows after random requests over two windows (a client's all in one of them, or
        spread over both), folded to a clock at or after the last request, some given a gap,
        the window of their last page (the first window or the second) and the window it
        was booked for: the script's rate and want are Python's, double for double."""
        window, period = cap
        requests = [
            [((i % 2 if only is None else only) * window + t * window, hits)
             for i, (t, hits) in enumerate(c)]
            for only, c in clients
        ]  # fmt: skip
        last = max([t for c in requests for t, _ in c], default=0.0)
        clock = Clock(window, period, min(last + after * window, 2 * window - 1e-3))
        rows = [row_of(*sorted(c), window=window, period=period) for c in requests]
        for row, (gap, page, booked) in zip(rows, pages, strict=False):
            row.gap, row.page, row.booked = gap, page * window, booked * window
        for row in rows:
            fold(row, clock, float("inf"))
        assert in_lua(redis_server, rows, clock) == [predicted(r, clock) for r in rows]
        assert in_lua(redis_server, rows, clock, "want", 1) == wants(rows, clock, 1)
