"""The closed forms of fairness v2 (core/sharing.py), each against values worked by hand.

The store tests see these only through whole admissions; here each formula is pinned on its
own, with a period P other than 1 s where the formula divides or multiplies by it (today P is
min(window, 1 s) = 1 s, where x·P and x/P agree; docs/fairness.md writes them for any P).
"""

import pytest

from fairlimit.core.sharing import (
    CapPeriod,
    Clock,
    PeriodLevel,
    Row,
    charge,
    fold,
    last_period,
    predicted,
    record,
)

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
        """now 120.5: no period done, so no average (no division by 0): 6 + 1 x 60 = 66."""
        assert predicted(6.0, 1.0, 0.0, Clock(60, 1.0, 120.5)) == 66.0

    def test_periods_are_counted_in_units_of_p(self) -> None:
        """Window [0, 10), P = 0.5 s, now 2.3: period 4 began at 2.0, so 4 periods are done
        and 16 left; 10 hits so far are 2.5 a period: 10 + 2.5 x 16 = 50."""
        assert predicted(10.0, 0.0, 0.0, Clock(10, 0.5, 2.3)) == 50.0


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
