"""The recent average real cost per counter (core/reserve.Averages): the estimate a token
reservation falls back on, kept for a bounded number of counters."""

import pytest

from fairlimit.core.reserve import Averages

pytestmark = pytest.mark.unit


class TestAverages:
    def test_the_least_recently_settled_counter_is_forgotten_first(self) -> None:
        """Room for two: a and b settled, then a again, then c: b goes (the least recently
        settled), a keeps its average (a busy client's estimate is not lost to newcomers)."""
        averages = Averages(capacity=2)
        averages.add("a", 10)
        averages.add("b", 20)
        averages.add("a", 20)  # 10 + 0.2 x (20 - 10) = 12
        averages.add("c", 5)
        assert (averages.get("a"), averages.get("b"), averages.get("c")) == (12, None, 5)
        assert len(averages) == 2
