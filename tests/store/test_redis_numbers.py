"""The text the admit script writes numbers in (``fmt`` in lua/admit/args.lua), on a real
redis-server: a row, a division and every reply cross the boundary as that text, which
Python reads back as the same double. A whole number below 1e15 takes a faster way to it
(its integer digits); the text must be what ``%.17g`` gives, as it was before that way."""

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairlimit.store.redis import script
from helpers import lua_function
from redis_servers import RedisProcess

pytestmark = pytest.mark.behaviour

ARGS_LUA = Path(script.__file__).parent / "lua" / "admit" / "args.lua"

# Each value's text by the script's fmt and by the rule it keeps ('inf', else %.17g).
HARNESS = """
local out = {}
for i = 1, #ARGV do
  local x = tonumber(ARGV[i])
  local rule = x == math.huge and 'inf' or string.format('%.17g', x)
  out[i] = {fmt(x), rule}
end
return out
"""

EDGES = [0.0, -0.0, 1.0, -1.0, 5.0, 0.5, -2.25, 1 / 3, 1765103456.0, 1765103456.654321,
         112966621184.0, 1e15 - 1, -(1e15 - 1), 1e15, -1e15, 2.0**53, 1e17, 1e17 + 2**14,
         5e-324, 1e-300, 1e300, math.inf, -math.inf, math.nan]  # fmt: skip


def fmt_source() -> str:
    """``fmt`` as args.lua defines it (from its line to the first ``end`` that closes it)."""
    return lua_function(ARGS_LUA, "local function fmt(x)")


def texts(server: RedisProcess, values: list[float]) -> list[tuple[str, str]]:
    with server.client() as client:
        reply = client.eval(fmt_source() + HARNESS, 0, *[repr(v) for v in values])
    return [(mine, rule) for mine, rule in reply]


class TestNumberText:
    def test_edges_are_written_as_percent_17g_writes_them(self, redis_server: RedisProcess) -> None:
        """Zero and -0, whole numbers at the fast way's bounds and past them (1e15, 2^53,
        1e17, which %.17g writes with an exponent), fractions, the extremes, inf and nan."""
        for value, (mine, rule) in zip(EDGES, texts(redis_server, EDGES), strict=True):
            assert mine == rule, f"{value!r}: {mine!r} != {rule!r}"
        assert texts(redis_server, [-0.0])[0][0] == "-0"  # a sign Python reads back

    @settings(max_examples=25, deadline=None)
    @given(
        st.lists(
            st.one_of(
                st.floats(allow_nan=False),
                st.integers(-(2**62), 2**62).map(float),
                st.integers(-(10**15) - 5, 10**15 + 5).map(float),
            ),
            min_size=1,
            max_size=200,
        )
    )
    def test_any_value_is_written_as_percent_17g_writes_it(
        self, redis_server: RedisProcess, values: list[float]
    ) -> None:
        for value, (mine, rule) in zip(values, texts(redis_server, values), strict=True):
            assert mine == rule, f"{value!r}: {mine!r} != {rule!r}"
            assert float(mine) == value or (math.isinf(value) and mine in ("inf", "-inf"))
