"""A finished period at a cap -> λ and the fairness figures (core.fairshare), for every store."""

import dataclasses
import math

import pytest
from hypothesis import given

from fairlimit.core.fairshare import PeriodDemand, figures_of
from oracles import level_of
from strategies import periods

pytestmark = pytest.mark.unit


class TestPeriodDemand:
    def test_the_level_is_in_the_window_and_the_figures_in_the_period(self) -> None:
        """A 60 s cap of 600: demand of 10 and 2 per period gives λ 480 per window, 8 per period."""
        period = PeriodDemand.of(600, {"a": 10, "b": 2}, {"a": 8, "b": 2}, scale=60)
        assert level_of(period) == pytest.approx(480)
        figures = figures_of(period)
        assert figures.level == pytest.approx(8)
        assert figures.utilization == pytest.approx(1.0)
        assert figures.jain_index == pytest.approx(1) and figures.starved_clients == 0
        assert figures.active_clients == 2 and figures.top_client_share == pytest.approx(0.8)

    def test_of_fills_in_what_a_shared_bucket_lacks(self) -> None:
        """No limits means none, no weights means 1, a client never admitted has 0."""
        period = PeriodDemand.of(5, {"a": 3, "b": 4}, {"b": 4})
        assert period == PeriodDemand(5, 1.0, [3.0, 4.0], [0.0, 4.0], [math.inf] * 2, [1.0] * 2)

    def test_of_keeps_each_clients_limit_and_weight(self) -> None:
        """Clients are taken in the order of the demand, each with its own limit and weight."""
        period = PeriodDemand.of(
            9, {"b": 1, "a": 2}, {}, limits={"a": 3.0, "b": 4.0}, weights={"a": 2.0, "b": 1.0}
        )
        assert (period.limits, period.weights) == ([4.0, 3.0], [1.0, 2.0])

    def test_uncontended_period_has_no_level(self) -> None:
        """When every demand fits, λ is infinite in both units."""
        period = PeriodDemand.of(100, {"a": 1, "b": 1}, {"a": 1, "b": 1}, scale=10)
        assert math.isinf(level_of(period)) and math.isinf(figures_of(period).level)

    @given(periods())
    def test_the_two_levels_differ_by_the_scale_only(self, period: PeriodDemand) -> None:
        """λ per window is λ per period times window/period: one level, two units."""
        per_window, per_period = level_of(period), figures_of(period).level
        assert math.isinf(per_window) == math.isinf(per_period)
        if not math.isinf(per_window):
            assert per_window == pytest.approx(per_period * period.scale, rel=1e-6)

    @given(periods())
    def test_admitting_the_ideal_reads_as_perfectly_fair(self, period: PeriodDemand) -> None:
        """A period that admitted each client min(d_i, L_i, λ·w_i) has index 1, none starved."""
        level = figures_of(period).level
        ideal = tuple(
            min(d, lim / period.scale, level * w)
            for d, lim, w in zip(period.demands, period.limits, period.weights, strict=True)
        )
        figures = figures_of(dataclasses.replace(period, admitted=ideal))
        assert figures.jain_index == pytest.approx(1) and figures.starved_clients == 0
