"""A row's predicted rate as the admit script works it out (``predicted`` in
lua/admit/rows.lua) against core/sharing.py's, on a real redis-server: the same doubles for
rows after random requests at caps of a second to an hour, a client gone quiet in its window
among them (``sharing._quiet``: a burst that is over is predicted nothing more).

The division is made in Python (core/sharing.divide) on memory and on Redis alike; the
script predicts the row of the client asking, so a mirror that drifted would decide that
client's request differently from memory only where the cap is contended, which random
traffic reaches now and then: here each row is compared directly."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairlimit.core.sharing import Clock, Row, fold, predicted
from fairlimit.store.redis import script
from helpers import lua_function
from redis_servers import RedisProcess
from sharing_rows import row_of

pytestmark = pytest.mark.behaviour

ROWS_LUA = Path(script.__file__).parent / "lua" / "admit" / "rows.lua"
FIELDS = ("asked", "previous", "previous_last", "seen", "first", "window")

# ARGV: now, start, window, period_len, then FIELDS of each row; one rate per row
HARNESS = """
local c = {now = tonumber(ARGV[1]), start = tonumber(ARGV[2]), window = tonumber(ARGV[3]),
           period_len = tonumber(ARGV[4])}
local out = {}
for i = 5, #ARGV, 6 do
  local row = {asked = tonumber(ARGV[i]), previous = tonumber(ARGV[i + 1]),
               previous_last = tonumber(ARGV[i + 2]), seen = tonumber(ARGV[i + 3]),
               first = tonumber(ARGV[i + 4]), window = tonumber(ARGV[i + 5])}
  out[#out + 1] = string.format('%.17g', predicted(row, c))
end
return out
"""


def predicted_source() -> str:
    """``predicted`` as rows.lua defines it (to the ``end`` that closes it)."""
    return lua_function(ROWS_LUA, "local function predicted(row, c)")


def in_lua(server: RedisProcess, rows: list[Row], clock: Clock) -> list[float]:
    args = [clock.now, clock.start, clock.window, clock.period_len]
    for row in rows:
        args += [getattr(row, name) for name in FIELDS]
    with server.client() as client:
        reply = client.eval(predicted_source() + HARNESS, 0, *[repr(float(a)) for a in args])
    return [float(text) for text in reply]


class TestPredictedInTheScript:
    def test_a_burst_gone_quiet(self, redis_server: RedisProcess) -> None:
        """A burst of 4 requests at 20-23 s of a minute, new in it, and one request of 41 at
        20 s: at 27.0 the burst's rate so far, at 27.01 nothing (quiet 3 s and a period past
        its last), the one request nothing at either; a client seen in the window before
        (30 in the first minute, 10 at 70 s) keeps its rate at 100 s."""
        for now in (27.0, 27.01):
            clock = Clock(60, 1.0, now)
            burst = row_of(*[(20.0 + i, 10) for i in range(4)], window=60)
            rows = [burst, row_of((20.0, 41), window=60)]
            for row in rows:
                fold(row, clock, float("inf"))
            assert in_lua(redis_server, rows, clock) == [predicted(r, clock) for r in rows]
            assert (predicted(rows[0], clock) == 0.0) == (now > 27.0)
        steady, clock = row_of((50.0, 30), (70.0, 10), window=60), Clock(60, 1.0, 100.0)
        fold(steady, clock, float("inf"))
        assert in_lua(redis_server, [steady], clock) == [predicted(steady, clock)] != [0.0]

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
    )
    def test_random_rows_predict_alike(
        self,
        redis_server: RedisProcess,
        cap: tuple[int, float],
        clients: list[tuple[int | None, list[tuple[float, int]]]],
        after: float,
    ) -> None:
        """Rows after random requests over two windows (a client's all in one of them, or
        spread over both), folded to a clock at or after the last request: the script's
        rate is Python's, double for double."""
        window, period = cap
        requests = [
            [((i % 2 if only is None else only) * window + t * window, hits)
             for i, (t, hits) in enumerate(c)]
            for only, c in clients
        ]  # fmt: skip
        last = max([t for c in requests for t, _ in c], default=0.0)
        clock = Clock(window, period, min(last + after * window, 2 * window - 1e-3))
        rows = [row_of(*sorted(c), window=window, period=period) for c in requests]
        for row in rows:
            fold(row, clock, float("inf"))
        assert in_lua(redis_server, rows, clock) == [predicted(r, clock) for r in rows]
