"""Weighted water-filling and the fairness figures (pure core), with Hypothesis properties."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlimit.core.fairshare import fairness_figures, jain_index, water_level
from maxmin import INF, maxmin
from maxmin import level as exact_level
from oracles import grants

pytestmark = pytest.mark.unit

amounts = st.floats(0, 1000, allow_nan=False)
weights = st.floats(0.1, 10, allow_nan=False)


@st.composite
def allocations(draw: st.DrawFn) -> tuple[list[float], list[float], list[float], float]:
    n = draw(st.integers(1, 12))
    demands = draw(st.lists(amounts, min_size=n, max_size=n))
    limits = draw(st.lists(amounts, min_size=n, max_size=n))
    ws = draw(st.lists(weights, min_size=n, max_size=n))
    return demands, limits, ws, draw(st.floats(0, 5000, allow_nan=False))


class TestWaterFilling:
    def test_uncontended_level_is_infinite(self) -> None:
        """When every capped demand fits, λ is infinite and everyone gets it all."""
        assert water_level([10, 20], [50, 50], [1, 1], 100) == math.inf
        assert grants([10, 20], [50, 50], [1, 1], 100) == [10, 20]

    def test_small_demands_are_met_and_the_rest_split(self) -> None:
        """Max-min: the small client is met, the big ones split what is left."""
        assert grants([5, 50, 50], [30, 30, 30], [1, 1, 1], 45) == [5, 20, 20]

    def test_weights_scale_the_split(self) -> None:
        """Weight 3 gets three times weight 1 when both are saturated."""
        assert grants([100, 100], [100, 100], [3, 1], 100) == [75, 25]

    @given(allocations())
    def test_grants_fill_the_cap_or_every_capped_demand(
        self, case: tuple[list[float], list[float], list[float], float]
    ) -> None:
        """sum of grants = min(C, sum of capped demands); no grant exceeds d_i or L_i."""
        demands, limits, ws, capacity = case
        got = grants(demands, limits, ws, capacity)
        wanted = sum(min(d, lim) for d, lim in zip(demands, limits, strict=True))
        assert sum(got) == pytest.approx(min(capacity, wanted), rel=1e-9, abs=1e-6)
        for g, d, lim in zip(got, demands, limits, strict=True):
            assert -1e-9 <= g <= min(d, lim) + 1e-9

    @given(allocations())
    def test_no_client_can_gain_without_a_poorer_one_losing(
        self, case: tuple[list[float], list[float], list[float], float]
    ) -> None:
        """Max-min: a client short of its want has the highest normalised grant of all
        clients that are short (no one with a larger normalised grant could give to it)."""
        demands, limits, ws, capacity = case
        got = grants(demands, limits, ws, capacity)
        wants = [min(d, lim) for d, lim in zip(demands, limits, strict=True)]
        short = [g / w for g, want, w in zip(got, wants, ws, strict=True) if g < want - 1e-6]
        everyone = [g / w for g, w in zip(got, ws, strict=True)]
        for level in short:
            assert level >= max(everyone) - 1e-6

    @given(allocations(), st.floats(0.5, 4))
    def test_scaling_all_weights_changes_nothing(
        self, case: tuple[list[float], list[float], list[float], float], k: float
    ) -> None:
        """Only the ratio of weights matters."""
        demands, limits, ws, capacity = case
        a = grants(demands, limits, ws, capacity)
        b = grants(demands, limits, [w * k for w in ws], capacity)
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6)

    def test_sequences_of_different_lengths_are_refused(self) -> None:
        """A weight missing is a caller's error even when the cap is uncontended (λ needs no
        weights then): refused, never a shorter answer."""
        with pytest.raises(ValueError):
            grants([1, 2], [5, 5], [1], 100)

    @pytest.mark.parametrize(
        ("demands", "limits", "ws", "capacity"),
        [
            ([1, 2, 3], [5, 5], [1, 1, 1], 100),  # a limit missing, uncontended
            ([5, 5], [5, 5], [1, 1, 1], 2),  # a weight too many, contended
            ([5, 5], [5, 5], [1], 2),  # a weight missing, contended
        ],
    )
    def test_the_level_refuses_sequences_of_different_lengths(
        self, demands: list[float], limits: list[float], ws: list[float], capacity: float
    ) -> None:
        """The level alone (sharing and quota call it without grants) refuses them too,
        contended or not: never the level of fewer or more clients than asked."""
        with pytest.raises(ValueError):
            water_level(demands, limits, ws, capacity)

    @pytest.mark.parametrize(
        ("demands", "limits", "ws", "capacity"),
        [
            ([50, 50], [INF, INF], [1, 1], 100),
            ([61], [INF], [7], 61),  # 61 / 7 * 7 is not 61 in floats
            ([61, 33], [INF, INF], [7, 6], 94),
            ([100, 33], [61, INF], [7, 6], 94),  # a limit brings the wants to the cap
        ],
    )
    def test_demand_exactly_at_the_cap_is_uncontended(
        self, demands: list[float], limits: list[float], ws: list[float], capacity: float
    ) -> None:
        """Capped demands adding up to exactly C fit: λ is infinite, as the exact solver says,
        and each client gets all it asked, whatever the weights."""
        wants = [min(d, lim) for d, lim in zip(demands, limits, strict=True)]
        assert water_level(demands, limits, ws, capacity) == exact_level(wants, ws, capacity) == INF
        assert grants(demands, limits, ws, capacity) == maxmin(demands, limits, ws, capacity)


class TestFigures:
    def test_jain_index_bounds(self) -> None:
        """1 for equal shares, 1/n when one client has everything."""
        assert jain_index([1, 1, 1, 1]) == pytest.approx(1)
        assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)

    def test_jain_index_of_shares_all_zero_is_one(self) -> None:
        """Nothing each is still all equal: 1 (the formula's 0/0 read as its limit)."""
        assert jain_index([0, 0, 0]) == 1

    def test_global_bucket_starvation_reads_as_unfair(self) -> None:
        """The section 1 split (batch takes nearly all) gives a low index and starved clients."""
        demands = [5000.0] + [50.0] * 9
        admitted = [990.0] + [1.0] * 9
        figures = fairness_figures(demands, admitted, [1000.0] * 10, [1.0] * 10, 1000)
        assert figures.jain_index < 0.2 and figures.starved_clients == 9
        assert figures.top_client_share == pytest.approx(990 / 999)

    def test_fair_split_reads_as_fair(self) -> None:
        """Per-client buckets: everyone at its fair amount, index 1, none starved."""
        demands = [5000.0] + [50.0] * 9
        admitted = [100.0] + [50.0] * 9
        figures = fairness_figures(demands, admitted, [100.0] * 10, [1.0] * 10, 1000)
        assert figures.jain_index == pytest.approx(1) and figures.starved_clients == 0
        assert figures.utilization == pytest.approx(0.55)

    def test_a_cap_of_one_hit_per_period(self) -> None:
        """C = 1 (60 a minute in 1 s periods), two clients ask 1 each, one is admitted. By
        hand: λ = C / (w1 + w2) = 0.5, so each fair share is 0.5 and x = (2, 0); Jain
        (2 + 0)² / (2 · (4 + 0)) = 0.5, one starved, utilisation 1/1, top share 1/1."""
        figures = fairness_figures([1.0, 1.0], [1.0, 0.0], [math.inf] * 2, [1.0] * 2, 1)
        assert (figures.level, figures.jain_index, figures.starved_clients) == (0.5, 0.5, 1)
        assert (figures.utilization, figures.top_client_share) == (1.0, 1.0)
        assert figures.active_clients == 2

    def test_a_cap_of_zero_reads_as_unused_not_a_division_by_zero(self) -> None:
        """requests_per_unit 0 is a valid cap: it admits nothing, so utilisation and the top
        client's share are 0, and λ = 0 / 1 = 0 (no fair share to measure against)."""
        figures = fairness_figures([3.0], [0.0], [math.inf], [1.0], 0)
        assert (figures.utilization, figures.top_client_share, figures.level) == (0.0, 0.0, 0.0)
        assert figures.active_clients == 1 and figures.starved_clients == 0

    def test_ninety_percent_of_the_fair_share_is_not_starved(self) -> None:
        """Starved means x < 0.9 (FairnessFigures): 9 of a fair 10 is not, 8 of 10 is."""
        demands = [10.0, 10.0, 10.0]
        figures = fairness_figures(demands, [9.0, 8.0, 10.0], [math.inf] * 3, [1.0] * 3, 100)
        assert figures.starved_clients == 1

    def test_a_client_without_demand_is_not_active(self) -> None:
        """Active clients are those with demand in the period: a listed client that asked
        for nothing is not one, and has no fair share to be measured against."""
        figures = fairness_figures([5.0, 0.0], [5.0, 0.0], [math.inf] * 2, [1.0] * 2, 10)
        assert figures.active_clients == 1 and figures.jain_index == 1

    def test_an_admission_for_every_demand_is_required(self) -> None:
        """Admitted and demanded are per client: one short is a caller's error, refused."""
        with pytest.raises(ValueError):
            fairness_figures([1.0, 2.0], [1.0], [5.0, 5.0], [1.0, 1.0], 100)
