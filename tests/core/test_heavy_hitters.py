"""The bounded heavy-hitters summary (core/heavy.py): its guarantees, as properties."""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlimit.core.heavy import HeavyHitters

pytestmark = pytest.mark.unit

# Few distinct clients with skewed weights, so that some streams have real heavy hitters and
# most overflow the summary (up to 60 clients against 2k = 2..16 counters).
CLIENTS = st.integers(0, 59).map(lambda i: f"client-{i}")
STREAMS = st.lists(st.tuples(CLIENTS, st.integers(1, 50)), max_size=400)
CAPACITIES = st.integers(1, 8)


def _truth(stream: list[tuple[str, int]]) -> Counter[str]:
    truth: Counter[str] = Counter()
    for client, weight in stream:
        truth[client] += weight
    return truth


class TestGuarantees:
    @given(STREAMS, CAPACITIES)
    def test_estimates_bound_the_true_count_from_above_within_the_error(
        self, stream: list[tuple[str, int]], k: int
    ) -> None:
        """true <= estimate <= true + error, and error <= total / (k + 1), for every client."""
        summary = HeavyHitters.of(k, stream)
        truth = _truth(stream)
        assert summary.total == sum(truth.values())
        assert summary.error * (k + 1) <= summary.total
        for client, count in truth.items():
            assert count <= summary.estimate(client) <= count + summary.error
        for hitter in summary.top(k):
            assert hitter.error == summary.error
            assert truth[hitter.item] <= hitter.estimate <= truth[hitter.item] + hitter.error

    @given(STREAMS, CAPACITIES, st.data())
    def test_every_client_above_total_over_n_is_in_the_top_n(
        self, stream: list[tuple[str, int]], k: int, data: st.DataObject
    ) -> None:
        """top(n), n <= k, reports every client whose count exceeds total / n."""
        n = data.draw(st.integers(1, k))
        summary = HeavyHitters.of(k, stream)
        reported = {h.item for h in summary.top(n)}
        heavy = {c for c, count in _truth(stream).items() if count * n > summary.total}
        assert heavy <= reported
        assert len(reported) <= n

    @given(STREAMS, CAPACITIES)
    def test_memory_stays_within_twice_the_capacity(
        self, stream: list[tuple[str, int]], k: int
    ) -> None:
        """However many clients pass, at most 2k counters are held."""
        summary: HeavyHitters[str] = HeavyHitters(k)
        for client, weight in stream:
            summary.add(client, weight)
            assert len(summary) <= 2 * k

    @given(STREAMS, STREAMS, CAPACITIES)
    def test_a_merged_summary_keeps_the_guarantees_of_the_joined_stream(
        self, first: list[tuple[str, int]], second: list[tuple[str, int]], k: int
    ) -> None:
        """Merging two summaries bounds the counts of both streams together, in 2k counters."""
        merged = HeavyHitters.of(k, first)
        merged.merge(HeavyHitters.of(k, second))
        truth = _truth(first + second)
        assert len(merged) <= 2 * k
        assert merged.total == sum(truth.values())
        assert merged.error * (k + 1) <= merged.total
        for client, count in truth.items():
            assert count <= merged.estimate(client) <= count + merged.error
        reported = {h.item for h in merged.top(k)}
        assert {c for c, count in truth.items() if count * k > merged.total} <= reported


class TestExamples:
    def test_exact_while_the_clients_fit(self) -> None:
        """Up to 2k distinct clients, every count is exact (error 0), largest (then first) first."""
        summary = HeavyHitters.of(2, [("a", 1), ("b", 5), ("c", 2), ("a", 1)])
        assert [(h.item, h.estimate, h.error) for h in summary.top(3)] == [
            ("b", 5, 0),
            ("a", 2, 0),
            ("c", 2, 0),
        ]

    def test_a_full_summary_cuts_every_count_by_the_k_plus_1th_largest(self) -> None:
        """k = 2 holds 4 counters: a 5, b 4, c 3, d 2. A fifth client cuts by the 3rd largest
        count, c's 3 (the module's rule, worked by hand): a 2 and b 1 stay, c and d drop,
        error 3; then e counts 1. Estimates are count + error: a 5, b 4, e 4, c and d 3."""
        summary = HeavyHitters.of(2, [("a", 5), ("b", 4), ("c", 3), ("d", 2), ("e", 1)])
        assert (summary.error, len(summary)) == (3, 3)
        assert [(h.item, h.estimate) for h in summary.top(3)] == [("a", 5), ("b", 4), ("e", 4)]
        assert summary.estimate("c") == summary.estimate("d") == 3

    def test_a_hog_survives_a_flood_of_one_off_clients(self) -> None:
        """A client with most of the traffic stays on top among 10 000 others of one hit each."""
        stream = [(f"once-{i}", 1) for i in range(10_000)] + [("hog", 20_000)]
        summary = HeavyHitters.of(4, stream)
        top = summary.top(1)[0]
        assert top.item == "hog"
        assert 20_000 <= top.estimate <= 20_000 + summary.error
        assert len(summary) <= 8

    def test_weights_of_zero_count_nothing_and_capacity_must_be_positive(self) -> None:
        """A check without hits is no demand; a summary of no counters is refused."""
        summary = HeavyHitters.of(1, [("a", 0)])
        assert summary.total == 0 and summary.top(1) == []
        with pytest.raises(ValueError, match="capacity must be 1 or more"):
            HeavyHitters(0)
