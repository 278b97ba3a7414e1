"""The yardstick itself: the exact weighted max-min solver of tests/support/maxmin.py."""

import itertools
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maxmin import INF, Node, allocate, effective_demand, jain, level, maxmin, unfolding_bound
from strategies import allocation_cases

pytestmark = pytest.mark.unit

Case = tuple[list[int], list[int], list[int], int]


def exact(case: Case) -> tuple[list[Fraction], list[Fraction], list[Fraction], Fraction]:
    demands, limits, weights, capacity = case
    return (
        [Fraction(d) for d in demands],
        [Fraction(x) for x in limits],
        [Fraction(w) for w in weights],
        Fraction(capacity),
    )


class TestHandComputed:
    def test_everything_fits(self) -> None:
        """Uncontended: λ is infinite and each client gets min(d, L)."""
        assert level([10, 20], [1, 1], 100) == INF
        assert maxmin([10, 20, 70], [50, 15, 100], [1, 1, 1], 100) == [10, 15, 70]

    def test_the_issue_burst_case(self) -> None:
        """6000/min, ten steady clients and a burst: 6000/11 each (the issue's 545)."""
        got = maxmin([Fraction(600)] * 10 + [Fraction(3001)], [INF] * 11, [1] * 11, 6000)
        assert got == [Fraction(6000, 11)] * 11

    def test_small_are_met_the_rest_split(self) -> None:
        """5 is met, 45 - 5 = 40 is split between the two big ones."""
        assert maxmin([5, 50, 50], [30, 30, 30], [1, 1, 1], 45) == [5, 20, 20]

    def test_limits_bind_before_the_level(self) -> None:
        """A client held by its own limit leaves the rest to the others."""
        assert maxmin([100, 100, 100], [10, 100, 100], [1, 1, 1], 100) == [10, 45, 45]

    def test_weights_at_saturation(self) -> None:
        """Weight 3 gets three times weight 1 when both ask for more."""
        assert maxmin([100, 100], [100, 100], [3, 1], 100) == [75, 25]

    def test_fractional_level_is_exact(self) -> None:
        """Three saturated clients over 100: a third each, in rationals."""
        got = maxmin([Fraction(50)] * 3, [INF] * 3, [1] * 3, Fraction(100))
        assert got == [Fraction(100, 3)] * 3 and sum(got) == 100

    def test_zero_demand_and_ties(self) -> None:
        """A silent client gets nothing; tied clients get the same."""
        assert maxmin([0, 40, 40, 40], [INF] * 4, [1] * 4, 60) == [0, 20, 20, 20]

    def test_zero_capacity(self) -> None:
        """Nothing to share: nobody gets anything."""
        assert maxmin([5, 5], [INF, INF], [1, 2], 0) == [0, 0]

    def test_jain(self) -> None:
        """1 for equal shares, 1/n for one holding everything."""
        assert jain([2, 2, 2]) == 1 and jain([1, 0, 0, 0]) == 0.25 and jain([]) == 1


class TestNested:
    def test_the_issue_nested_case(self) -> None:
        """route 1000 > tenants 600 > users 200: tenant A (5 users of 300) is held to 600,
        so B gets the other 400 and nothing is stranded at the route."""
        a = Node("A", 600, children=tuple(Node(f"a{i}", 200, demand=300) for i in range(5)))
        b = Node("B", 600, children=tuple(Node(f"b{i}", 200, demand=300) for i in range(2)))
        got = allocate(Node("route", 1000, children=(a, b)))
        assert got["route/A"] == 600 and got["route/B"] == 400
        assert all(got[f"route/A/a{i}"] == 120 for i in range(5))
        assert all(got[f"route/B/b{i}"] == 200 for i in range(2))

    def test_effective_demand_is_bounded_by_children(self) -> None:
        """A tenant whose users are capped by their own limits asks only what they can use."""
        small = Node("S", 600, children=tuple(Node(f"u{i}", 50, demand=500) for i in range(3)))
        assert effective_demand(small) == 150
        got = allocate(Node("route", 1000, children=(small, Node("T", 900, demand=2000))))
        assert got["route/S"] == 150 and got["route/T"] == 850

    def test_weights_at_a_nested_level(self) -> None:
        """Weights act at the level they are declared on."""
        users = (Node("heavy", weight=3, demand=1000), Node("light", demand=1000))
        got = allocate(Node("route", 100, children=(Node("T", 80, children=users),)))
        assert got["route/T/heavy"] == 60 and got["route/T/light"] == 20


class TestUnfolding:
    def test_a_burst_at_second_zero_gets_its_part_of_the_elapsed(self) -> None:
        """6000/min, slack 1 s: at second 0 a burst of 3000 next to ten clients asking 10
        each shares the 100 of the first second: 100/11 each, the burst included."""
        samples = [(0.0, [10] * 10 + [3000])]
        bound = unfolding_bound(6000, 60, 1, samples, [INF] * 11, [1] * 11)
        assert bound[0] == [Fraction(100, 11)] * 11

    def test_the_bound_keeps_what_was_once_fair(self) -> None:
        """Alone for 30 s a client may take 30 s of capacity and keep it when others come."""
        samples = [(29.0, [5000, 0]), (59.0, [5000, 5000])]
        bound = unfolding_bound(6000, 60, 1, samples, [INF, INF], [1, 1])
        assert bound[0] == [3000, 0] and bound[1] == [3000, 3000]


class TestProperties:
    @given(allocation_cases())
    def test_sum_is_the_cap_or_every_want(self, case: Case) -> None:
        """Σx = min(C, Σ min(d, L)) exactly: never over the cap, never capacity left while
        someone wants more."""
        demands, limits, weights, capacity = exact(case)
        got = maxmin(demands, limits, weights, capacity)
        wants = sum(min(d, lim) for d, lim in zip(demands, limits, strict=True))
        assert sum(got) == min(capacity, wants)

    @given(allocation_cases())
    def test_no_client_above_its_demand_or_limit(self, case: Case) -> None:
        """0 <= x_i <= min(d_i, L_i)."""
        demands, limits, weights, capacity = exact(case)
        got = maxmin(demands, limits, weights, capacity)
        for x, d, lim in zip(got, demands, limits, strict=True):
            assert 0 <= x <= min(d, lim)

    @given(allocation_cases())
    def test_no_client_can_be_raised_without_lowering_a_poorer_one(self, case: Case) -> None:
        """Max-min optimality: a client short of its want has a normalised share x/w at
        least that of every other client (so raising it takes from one no richer)."""
        demands, limits, weights, capacity = exact(case)
        got = maxmin(demands, limits, weights, capacity)
        wants = [min(d, lim) for d, lim in zip(demands, limits, strict=True)]
        normalised = [x / w for x, w in zip(got, weights, strict=True)]
        for x, want, share in zip(got, wants, normalised, strict=True):
            if x < want:
                assert share == max(normalised)

    @given(allocation_cases(), st.integers(2, 5))
    def test_weights_proportional_at_saturation(self, case: Case, k: int) -> None:
        """Two clients both held by the level get shares in the ratio of their weights."""
        demands, limits, weights, capacity = exact(case)
        got = maxmin(demands, limits, weights, capacity)
        wants = [min(d, lim) for d, lim in zip(demands, limits, strict=True)]
        held = [(x, w) for x, want, w in zip(got, wants, weights, strict=True) if x < want]
        for (x1, w1), (x2, w2) in itertools.pairwise(held):
            assert x1 * w2 == x2 * w1
        scaled = maxmin(demands, limits, [w * k for w in weights], capacity)
        assert scaled == got  # only the ratio of weights matters

    @given(allocation_cases(max_clients=6), st.integers(1, 4))
    def test_a_nested_cap_strands_nothing(self, case: Case, groups: int) -> None:
        """Clients split into tenants under a route: every cap gets min(its cap, effective
        demand) of what its parent can give, and the route is full or every want is met."""
        demands, limits, weights, capacity = exact(case)
        tenants = tuple(
            Node(
                f"t{g}",
                limit=capacity / 2 + 1,
                children=tuple(
                    Node(f"c{i}", limits[i], weights[i], demands[i])
                    for i in range(g, len(demands), groups)
                ),
            )
            for g in range(groups)
        )
        root = Node("r", capacity, children=tenants)
        got = allocate(root)
        assert got["r"] == min(capacity, effective_demand(root))
        assert sum(got[f"r/{t.name}"] for t in tenants) == got["r"]
        for t in tenants:
            assert got[f"r/{t.name}"] <= effective_demand(t)
            assert sum(got[f"r/{t.name}/{c.name}"] for c in t.children) == got[f"r/{t.name}"]
