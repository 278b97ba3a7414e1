"""The closed forms of fairness v2 (core/sharing.py), each against values worked by hand.

The store tests see these only through whole admissions; here each formula is pinned on its
own, with a period P other than 1 s where the formula divides or multiplies by it (today P is
min(window, 1 s) = 1 s, where x·P and x/P agree; docs/fairness.md writes them for any P).
"""

import math

import pytest

from fairlimit.core.sharing import (
    CapPeriod,
    Clock,
    PeriodLevel,
    Row,
    allowance,
    charge,
    fold,
    last_period,
    period_level,
    predicted,
    record,
)
from maxmin import level as maxmin_level

pytestmark = pytest.mark.unit


class TestPredicted:
    """Window demand = dk + max(r, q, dk / periods done) x periods left (docs/fairness.md)."""

    def test_the_window_average_drives_a_client_without_history(self) -> None:
        """Window [120, 180), now 125.5, P = 1: 5 periods done, 55 left; 10 hits so far are
        2 a period: 10 + 2 x 55 = 120."""
        assert predicted(10.0, 0.0, 0.0, Clock(60, 1.0, 125.5)) == 120.0

    def test_the_largest_rate_wins(self) -> None:
        """Same instant: an EWMA of 3 a period beats the average of 2: 10 + 3 x 55 = 175;
        a last period of 4 beats both: 10 + 4 x 55 = 230."""
        clock = Clock(60, 1.0, 125.5)
        assert predicted(10.0, 3.0, 1.0, clock) == 175.0
        assert predicted(10.0, 1.0, 4.0, clock) == 230.0

    def test_the_first_period_of_a_window_has_no_average(self) -> None:
        """now 120.5: no period done, so no average (no division by 0): 6 + 0.5 x 60 = 36."""
        assert predicted(6.0, 0.5, 0.0, Clock(60, 1.0, 120.5)) == 36.0

    def test_periods_are_counted_in_units_of_p(self) -> None:
        """Window [0, 10), P = 0.5 s, now 2.3: period 4 began at 2.0, so 4 periods are done
        and 16 left; 10 hits so far are 2.5 a period: 10 + 2.5 x 16 = 50."""
        assert predicted(10.0, 0.0, 0.0, Clock(10, 0.5, 2.3)) == 50.0


class TestAllowance:
    """A plan: the predicted demand rounded up, within the limit and λ·w rounded down."""

    def test_a_whole_demand_is_not_rounded_up(self) -> None:
        """5 predicted, uncontended: 5, not 6 (ceil(x - ε) keeps a whole x)."""
        assert allowance(5.0, 10.0, math.inf) == 5.0

    def test_a_fraction_of_demand_rounds_up(self) -> None:
        """4.2 predicted: a sparse client keeps its next request, 5."""
        assert allowance(4.2, 10.0, math.inf) == 5.0

    def test_the_limit_bounds_the_demand(self) -> None:
        """12 predicted, a limit of 10: 10."""
        assert allowance(12.0, 10.0, math.inf) == 10.0

    def test_the_share_bounds_a_contended_plan(self) -> None:
        """λ·w = 3.5 under 5 predicted: 3 (a share rounds down); λ·w a hair under 3: 3."""
        assert allowance(5.0, 10.0, 3.5) == 3.0
        assert allowance(5.0, 10.0, 3.0 - 1e-12) == 3.0


def _row(period: int, start: int, asked: int, admitted: int) -> Row:
    """A client folded to ``period`` of the window at ``start``, then asking and admitted."""
    row = Row(30.0, 2.0)
    fold(row, period, start)
    record(row, asked)
    charge(row, CapPeriod(period, PeriodLevel(None, 0.0)), admitted, True)
    return row


class TestLastPeriod:
    """The previous period's demand and admissions of the clients that asked in it."""

    def test_only_clients_that_asked_last_period_count(self) -> None:
        """At period 125: a row of period 124 that asked 7 (5 admitted) counts; one last seen
        at 123 (q is 0 two periods on) and one seen at 124 without asking do not."""
        clock = Clock(60, 1.0, 125.2)
        rows = [_row(124, 120, 7, 5), _row(123, 120, 4, 4), _row(124, 120, 0, 0)]
        found = last_period(rows, 600.0, clock)
        assert found is not None
        assert (found.capacity, found.scale) == (600.0, 60.0)
        assert (list(found.demands), list(found.admitted)) == ([7.0], [5.0])
        assert (list(found.limits), list(found.weights)) == ([30.0], [2.0])

    def test_no_client_asked_last_period_is_none(self) -> None:
        """Rows that were quiet in the last period give no figures at all."""
        rows = [_row(123, 120, 4, 4), _row(124, 120, 0, 0)]
        assert last_period(rows, 600.0, Clock(60, 1.0, 125.2)) is None

    def test_the_scale_is_periods_per_window(self) -> None:
        """A 2 s window of P = 0.5 s is 4 periods long."""
        found = last_period([_row(3, 0, 1, 1)], 8.0, Clock(2, 0.5, 2.1))
        assert found is not None
        assert found.scale == 4.0


def _asked_last_period(asked: int, limit: float, weight: float) -> Row:
    """A client that asked ``asked`` hits in period 19 (window [10, 20)) and nothing since."""
    row = Row(limit, weight)
    fold(row, 19, 10)
    record(row, asked)
    return row


class TestPeriodLevel:
    """λ and the reservations R at the first period of window [20, 30) (now 20.5, P = 1):
    a client that asked k hits in the period before predicts k x 10 hits for the window."""

    CLOCK = Clock(10, 1.0, 20.5)

    def test_uncontended_plans_are_demand_within_the_limit(self) -> None:
        """30 predicted under a limit of 40 holds 30; 60 over a limit of 45 holds 45: R = 75
        by 2 holders, λ infinite (75 fits in 1000)."""
        rows = [_asked_last_period(3, 40.0, 1.0), _asked_last_period(6, 45.0, 1.0)]
        assert maxmin_level([30, 45], [1, 1], 1000) == math.inf
        assert period_level(rows, 1000.0, self.CLOCK) == PeriodLevel(math.inf, 75.0, 2)

    def test_contended_plans_are_demand_within_the_weighted_share(self) -> None:
        """Wants 10, 40, 60 at weights 1, 2, 1 over 80: λ = 30 (tests/maxmin.py); shares 30,
        60, 30, so the plans are 10, 40 and 30: R = 80 by 3 holders."""
        rows = [
            _asked_last_period(1, 100.0, 1.0),
            _asked_last_period(4, 100.0, 2.0),
            _asked_last_period(6, 100.0, 1.0),
        ]
        assert maxmin_level([10, 40, 60], [1, 2, 1], 80) == 30
        found = period_level(rows, 80.0, self.CLOCK)
        assert found.level == pytest.approx(30.0)
        assert (found.reserved, found.holders) == (80.0, 3)

    def test_reservations_are_what_plans_have_left(self) -> None:
        """Window [20, 30), now 25.5: 5 periods done, 5 left. Asked and admitted 2 in period
        24: 2 + 2 x 5 = 12 predicted, 10 still held; the same under a limit of 2 has taken its
        whole plan and holds nothing: R = 10 by 1 holder."""
        rows = [_row(24, 20, 2, 2), _row(24, 20, 2, 2)]
        rows[1].limit = 2.0
        assert period_level(rows, 1000.0, Clock(10, 1.0, 25.5)) == PeriodLevel(math.inf, 10.0, 1)
