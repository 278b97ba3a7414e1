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
    ShareClaim,
    allowance,
    charge,
    fold,
    history,
    last_period,
    period_level,
    plan_of,
    predicted,
    record,
    touch,
    verdict,
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


def _state(pk: int, ws: int, pd: float, r: float, d: float, a: float, q: float = 0.0) -> Row:
    """A row as a store leaves it: folded to period ``pk`` of the window at ``ws``."""
    row = Row(1000.0, 1.0)
    row.pk, row.ws, row.pd, row.r, row.q, row.d, row.a = pk, ws, pd, r, q, d, a
    return row


# (row, clock, R): window 10 s, P = 1 but where said; 1000 capacity, so λ is infinite and
# R = plan - admitted.
# At now 25.5: period 25 of window [20, 30), 5 periods done, 5 left.
FOLDS = {
    # q = pd = 3, r = 3/2 + 9/2 = 6 wins: 4 + 6 x 5 = 34, 1 admitted
    "last-period-ewma-wins": (
        _state(24, 20, pd=3, r=9, d=4, a=1),
        Clock(10, 1.0, 25.5),
        33.0,
    ),
    # q = pd = 3 wins over r = 3/2 + 1/2 = 2: 4 + 3 x 5 = 19, 1 admitted
    "last-period-q-wins": (
        _state(24, 20, pd=3, r=1, d=4, a=1),
        Clock(10, 1.0, 25.5),
        18.0,
    ),
    # folded already (1 asked so far this period): r = 2 over q = 1 and the average 3/5:
    # 3 + 2 x 5 = 13
    "this-period": (
        _state(25, 20, pd=1, r=2, d=3, a=0, q=1),
        Clock(10, 1.0, 25.5),
        13.0,
    ),
    # r = (6/2 + 2/2) / 4 = 1 over the average 2/5: 2 + 1 x 5 = 7, 1 admitted
    "three-periods-back": (
        _state(22, 20, pd=6, r=2, d=2, a=1),
        Clock(10, 1.0, 25.5),
        6.0,
    ),
    # at a real Unix time (period 1_700_000_005 of [1_700_000_000, +10)), two periods back:
    # r = (2/2) / 2 = 0.5, q = 0: 0.5 x 5 = 2.5, rounded up to 3
    "unix-time-two-periods-back": (
        _state(1_700_000_003, 1_700_000_000, pd=2, r=0, d=0, a=0),
        Clock(10, 1.0, 1_700_000_005.5),
        3.0,
    ),
    # its d and a belong to the last window; r = (64/2) / 32 = 1: 1 x 5
    "last-window": (
        _state(19, 10, pd=64, r=0, d=40, a=3),
        Clock(10, 1.0, 25.5),
        5.0,
    ),
    # 64 periods back still counts: r = 2^63 / 2^63 = 1: 1 x 5
    "64-periods-back": (
        _state(25 - 64, 0, pd=2.0**64, r=0, d=0, a=0),
        Clock(10, 1.0, 25.5),
        5.0,
    ),
    # the first period of [30, 40), the row of the last window: q = pd = 2, 2 x 10
    "new-window": (
        _state(29, 20, pd=2, r=0, d=7, a=7),
        Clock(10, 1.0, 30.5),
        20.0,
    ),
    # a window's first period, no rate: the demand so far, 3, 1 admitted
    "no-rate-first-period": (
        _state(20, 20, pd=3, r=0, d=3, a=1),
        Clock(10, 1.0, 20.5),
        2.0,
    ),
    # P = 0.5 s, now 2.3 of [0, 10): period 4 began at 2.0, 4 periods done, 16 left; q = pd = 1
    # under the average 10/4: 10 + 2.5 x 16 = 50
    "half-second-periods": (
        _state(3, 0, pd=1, r=0, d=10, a=0),
        Clock(10, 0.5, 2.3),
        50.0,
    ),
}


class TestPeriodLevelFolds:
    """period_level folds each row as ``history`` and ``predicted`` do (it inlines them)."""

    @pytest.mark.parametrize(("row", "clock", "reserved"), FOLDS.values(), ids=list(FOLDS))
    def test_a_rows_plan(self, row: Row, clock: Clock, reserved: float) -> None:
        found = period_level([row], 1000.0, clock)
        assert found == PeriodLevel(math.inf, reserved, 1)

    def test_a_row_past_64_periods_takes_no_part(self) -> None:
        """65 periods back its history is gone, and it asked nothing this window."""
        row = _state(25 - 65, 0, pd=2.0**64, r=0, d=0, a=0)
        assert period_level([row], 1000.0, Clock(10, 1.0, 25.5)) == PeriodLevel(None, 0.0)

    def test_a_row_without_rate_or_demand_takes_no_part(self) -> None:
        """A row seen this period that asked nothing: no λ from it, no reservation."""
        idle = _state(25, 20, pd=0, r=0, d=0, a=0)
        assert period_level([idle], 1000.0, Clock(10, 1.0, 25.5)) == PeriodLevel(None, 0.0)

    def test_rows_after_an_idle_one_still_count(self) -> None:
        """An idle row, then the three-periods-back client above: R = 6 by 1 holder."""
        idle = _state(25, 20, pd=0, r=0, d=0, a=0)
        client = _state(22, 20, pd=6, r=2, d=2, a=1)
        found = period_level([idle, client], 1000.0, Clock(10, 1.0, 25.5))
        assert found == PeriodLevel(math.inf, 6.0, 1)


class TestCharge:
    """Admitted hits count in the row and in the period, within plans or from the spare."""

    def test_hits_add_up_by_where_they_came_from(self) -> None:
        """3 then 2 within plans, 4 then 1 from the spare: 5 used, 5 over; the row holds all
        10 this window and period, 5 of them from the spare."""
        row, cap = Row(100.0, 1.0), CapPeriod(7, PeriodLevel(10.0, 0.0))
        for hits, within in ((3, True), (4, False), (2, True), (1, False)):
            charge(row, cap, hits, within)
        assert (cap.used, cap.over) == (5.0, 5.0)
        assert (row.a, row.pa, row.oo) == (10.0, 10.0, 5.0)


class TestClock:
    """Where an instant sits: period, window start, φ and what is left of the window."""

    def test_period_start_elapsed_and_left(self) -> None:
        """Window [120, 180), P = 1, now 125.5: period 125; φ = (5.5 + 1) / 60; of the 55 s
        left at the period's start, 54.5 are left."""
        clock = Clock(60, 1.0, 125.5)
        assert (clock.period, clock.start) == (125, 120)
        assert clock.elapsed == 6.5 / 60
        assert clock.left == 54.5 / 55

    def test_elapsed_stops_at_the_whole_window(self) -> None:
        """In the last second of the window φ is 1, not (59.5 + 1) / 60."""
        assert Clock(60, 1.0, 179.5).elapsed == 1.0

    def test_periods_of_half_a_second(self) -> None:
        """P = 0.5 s, now 2.3 in a 10 s window: period 4, start 0, φ = 2.8 / 10."""
        clock = Clock(10, 0.5, 2.3)
        assert (clock.period, clock.start, clock.elapsed) == (4, 0, (2.3 + 0.5) / 10)


class TestHistory:
    """A row's (r, q, qa, d, a) seen from a later period: the EWMA decays, q lasts a period."""

    def test_the_next_period_takes_the_last_periods_demand(self) -> None:
        """pd 6 (4 admitted), r 2: r = 6/2 + 2/2 = 4, q = 6, qa = 4; same window, so d, a stay."""
        row = _state(24, 20, pd=6, r=2, d=9, a=5)
        row.pa = 4.0
        assert history(row, 25, 20) == (4.0, 6.0, 4.0, 9.0, 5.0)

    def test_quiet_periods_halve_the_rate_and_drop_q(self) -> None:
        """Three periods on: r = (6/2 + 2/2) / 4 = 1, q = qa = 0."""
        row = _state(24, 20, pd=6, r=2, d=9, a=5)
        row.pa = 4.0
        assert history(row, 27, 20) == (1.0, 0.0, 0.0, 9.0, 5.0)

    def test_a_new_window_drops_d_and_a(self) -> None:
        """From period 29 of [20, 30) to period 30 of [30, 40): d = a = 0, history kept."""
        row = _state(29, 20, pd=6, r=2, d=9, a=5)
        row.pa = 4.0
        assert history(row, 30, 30) == (4.0, 6.0, 4.0, 0.0, 0.0)

    def test_a_row_folded_already_is_as_it_is(self) -> None:
        """Asked for its own period (or an earlier one): its fields as they are."""
        row = _state(25, 20, pd=6, r=2, d=9, a=5, q=3)
        row.qa = 1.0
        assert history(row, 25, 20) == history(row, 24, 20) == (2.0, 3.0, 1.0, 9.0, 5.0)

    def test_history_lasts_64_periods(self) -> None:
        """64 periods on: r = (2^64 / 2) / 2^63 = 1; 65 on: gone."""
        row = _state(0, 0, pd=2.0**64, r=0, d=0, a=0)
        assert history(row, 64, 60)[0] == 1.0
        assert history(row, 65, 60)[0] == 0.0


class TestFold:
    """A row moved to a new period keeps its history and starts the period's counts afresh."""

    def test_the_first_touch_in_a_period_folds(self) -> None:
        """From period 24 to 25 of [20, 30): r = 4, q = 6, qa = 4; dk = d = 9; pd, pa, oo, sp
        start at 0."""
        row = _state(24, 20, pd=6, r=2, d=9, a=5)
        row.pa, row.oo, row.sp = 4.0, 2.0, 1
        assert fold(row, 25, 20) is True
        assert (row.r, row.q, row.qa, row.d, row.a, row.dk) == (4.0, 6.0, 4.0, 9.0, 5.0, 9.0)
        assert (row.pd, row.pa, row.oo, row.sp, row.pk, row.ws) == (0.0, 0.0, 0.0, 0, 25, 20)

    @pytest.mark.parametrize("period", [0, 1])
    def test_a_new_client_folds_empty_from_the_first_periods(self, period: int) -> None:
        """A new row is behind every period (an injected clock may start at 0): it folds on
        its first touch, with no history, demand or counts."""
        row = Row(10.0, 1.0)
        assert fold(row, period, 0) is True
        assert (row.r, row.q, row.qa, row.d, row.a, row.dk) == (0.0,) * 6
        assert (row.pd, row.pa, row.oo, row.sp, row.pk, row.ws) == (0.0, 0.0, 0.0, 0, period, 0)

    def test_a_second_touch_changes_nothing(self) -> None:
        """Folded to 25 already: False, and the period's counts stay."""
        row = _state(25, 20, pd=6, r=2, d=9, a=5)
        assert fold(row, 25, 20) is False
        assert (row.pd, row.r, row.pk) == (6.0, 2.0, 25)


# verdict: window [20, 30), now 25.5 (φ = 0.65, 0.9 of the period's rest left); capacity 100;
# a client of weight 2 and limit 50 predicts 4 + 1 x 5 = 9 (dk 4, r 1): at λ = 10 its plan is 9
# (λ·w = 20) and its paced fair amount min(50, 20 x 0.65) = 13.
NOW = Clock(10, 1.0, 25.5)


def _client(a: float, oo: float = 0.0, sp: int = 0) -> Row:
    row = _state(25, 20, pd=0, r=1, d=4, a=a)
    row.dk, row.oo, row.sp = 4.0, oo, sp
    return row


def _claim(hits: int = 1, sized: bool = False) -> ShareClaim:
    return ShareClaim(hits, 50.0, 2.0, 100.0, 4, sized)


class TestVerdictColdStart:
    """No λ yet: capacity x w / max(weights seen, active_clients), paced, within the limit."""

    def test_split_among_the_weights_seen(self) -> None:
        """Weights 5 seen over 4 declared: 100 x 2 / 5 = 40, paced to 40 x 0.65 = 26."""
        cap = CapPeriod(25, PeriodLevel(None, 0.0))
        cap.seen_weight = 5.0
        assert verdict(_client(0), cap, _claim(), 0, NOW) == (26.0, True)

    def test_a_sized_cap_is_not_paced(self) -> None:
        """A sized cap (limit 20) that has seen weights 8 over 4 declared: 100 / 8 = 12.5 a
        client, whole from the window's start."""
        cap = CapPeriod(25, PeriodLevel(None, 0.0))
        cap.seen_weight = 8.0
        claim = ShareClaim(1, 20.0, 1.0, 100.0, 4, True)
        assert verdict(_client(0), cap, claim, 0, NOW) == (12.5, True)

    def test_split_among_the_declared_clients(self) -> None:
        """Weights 3 seen under 4 declared: 100 x 2 / 4 = 50, a sized cap is not paced, and
        the limit of 50 holds."""
        cap = CapPeriod(25, PeriodLevel(None, 0.0))
        cap.seen_weight = 3.0
        assert verdict(_client(0), cap, _claim(sized=True), 0, NOW) == (50.0, True)
        cap.seen_weight = 1.0
        claim = ShareClaim(1, 30.0, 2.0, 100.0, 4, True)
        assert verdict(_client(0), cap, claim, 0, NOW) == (30.0, True)


class TestVerdictWithinPlan:
    """Below its plan and its paced fair amount, a request is within the plan."""

    @pytest.mark.parametrize(
        ("a", "hits"), [(3, 1), (8, 1), (8, 0), (3, 10)], ids=["below", "last", "check", "tokens"]
    )
    def test_within(self, a: float, hits: int) -> None:
        """The plan's last hit (8 + 1 = 9), a check (counted as 1), or tokens ending exactly
        at the fair amount (3 + 10 = 13): within, bound 13."""
        cap = CapPeriod(25, PeriodLevel(10.0, 0.0))
        assert verdict(_client(a), cap, _claim(hits), 0, NOW) == (13.0, True)
        assert cap.spare_weight == 0.0

    def test_tokens_may_end_at_a_fair_amount_a_hair_under_whole(self) -> None:
        """λ = 13 - 1e-9 on a sized cap (φ = 1, weight 1): 3 + 10 hits end within ε of it, as
        water-filling's floats leave a fair amount (fair + ε is exactly 13.0 here)."""
        level = 13 - 1e-9
        assert level + 1e-9 == 13.0
        cap = CapPeriod(25, PeriodLevel(level, 0.0))
        claim = ShareClaim(10, 50.0, 1.0, 100.0, 4, True)
        assert verdict(_client(3), cap, claim, 0, NOW) == (level, True)

    def test_uncontended_the_limit_is_the_bound(self) -> None:
        """λ infinite: the fair amount is the limit, 50, not paced."""
        cap = CapPeriod(25, PeriodLevel(math.inf, 0.0))
        assert verdict(_client(3), cap, _claim(), 0, NOW) == (50.0, True)

    @pytest.mark.parametrize(("a", "hits"), [(9, 1), (3, 11)], ids=["plan-used", "past-fair"])
    def test_past_the_plan_or_the_fair_amount_asks_the_spare(self, a: float, hits: int) -> None:
        """9 + 1 > 9, or 3 + 11 > 13: the spare is asked (none is free: 100 in the window)."""
        cap = CapPeriod(25, PeriodLevel(10.0, 0.0))
        cap.spare_weight = 1.0
        bound, within = verdict(_client(a), cap, _claim(hits), 100, NOW)
        assert (bound, within) == (min(13.0, max(9.0, a)), False)
        assert cap.spare_weight == 3.0


def _spare_cap(**figures: float) -> CapPeriod:
    """R 40 by 5 holders; 2 of them seen with 10; 4 used, 6 from the spare; weight 2 asked."""
    cap = CapPeriod(25, PeriodLevel(10.0, 40.0, 5))
    cap.seen_holders, cap.seen_reserved, cap.used, cap.over, cap.spare_weight = 2, 10.0, 4, 6, 2
    for name, value in figures.items():
        setattr(cap, name, value)
    return cap


# (cap figures, total in the window, the client's hits from the spare, granted):
# unseen R = 40 - 10 = 30, kept max(30 x 0.9, 5 - 2) = 27, held 10 - 4 + 27 = 33; the spare
# may reach min(100 - 33, 100 x 0.65) = 65 in total; the pool 6 + 100 - 33 - total is split by
# weight, 2 of 2 + 2 asking (this client joins): a client may take pool / 2 + 1.
SPARE = {
    "pool-share-edge": ({}, 49, 12, True),  # pool 24: 12 + 1 <= 13
    "pool-share-past": ({}, 49, 13, False),
    "pace-edge": ({}, 64, 0, True),  # 64 + 1 <= 65
    "pace-past": ({}, 65, 0, False),
    # R 70, seen 40: 40 - 4 used + 27 kept of 30 unseen: 63 held, the spare up to 37
    "held-edge": ({"reserved": 70.0, "seen_reserved": 40.0}, 36, 0, True),
    "held-past": ({"reserved": 70.0, "seen_reserved": 40.0}, 37, 0, False),
    # seen R all used (10 - 15 counts 0): 27 held, pool 6 + 100 - 27 - 49 = 30: 15 + 1 <= 16
    "used-up": ({"used": 15.0}, 49, 15, True),
    # 30 holders unseen 28 over 30 x 0.9: kept 28, pool 23: 12 + 1 > 12.5
    "unseen-holders": ({"holders": 30}, 49, 12, False),
    "unseen-holders-edge": ({"holders": 30}, 49, 11, True),  # 11 + 1 <= 12.5
    # 40 holders: kept all 30 unseen, pool 21: 10 + 1 <= 11.5, 11 + 1 is not
    "all-unseen-kept": ({"holders": 40}, 49, 10, True),
    "all-unseen-kept-past": ({"holders": 40}, 49, 11, False),
    # seen R over R: nothing unseen kept; 6 held, pool 6 + 100 - 6 - 49 = 51: 26 + 1 <= 26.5
    "no-unseen": ({"reserved": 5.0}, 49, 25, True),
    "no-unseen-past": ({"reserved": 5.0}, 49, 26, False),
    # the spare's own use adds to the pool: over 10, pool 28: 14 + 1 <= 15
    "over-returns": ({"over": 10.0}, 49, 14, True),
}


class TestVerdictSpare:
    """Past its plan a client draws on the spare: what no reservation holds, paced, split by
    weight among the clients asking (figures worked by hand above SPARE)."""

    @pytest.mark.parametrize(("figures", "total", "oo", "granted"), SPARE.values(), ids=list(SPARE))
    def test_spare(self, figures: dict[str, float], total: int, oo: float, granted: bool) -> None:
        bound, within = verdict(_client(9, oo), _spare_cap(**figures), _claim(), total, NOW)
        assert (bound, within) == (50.0 if granted else 9.0, False)

    def test_nothing_unseen_keeps_nothing(self) -> None:
        """Seen R 10 over R 5: no unseen reservation (not even a hit): 6 held, pool
        6 + 100 - 6 - 49 = 51, over weights 2 of 2 (registered already): 51 + 1."""
        cap = _spare_cap(reserved=5.0)
        assert verdict(_client(9, 51, sp=1), cap, _claim(), 49, NOW) == (50.0, False)
        assert verdict(_client(9, 52, sp=1), cap, _claim(), 49, NOW) == (9.0, False)

    @staticmethod
    def _held(seen_reserved: float) -> CapPeriod:
        """Only a fraction held (kept reservations are fractions), registered weights 2."""
        cap = CapPeriod(25, PeriodLevel(10.0, 0.0))
        cap.seen_reserved, cap.spare_weight = seen_reserved, 2.0
        return cap

    def test_the_room_a_hair_under_whole_is_within_epsilon(self) -> None:
        """A cap of 4 holding 2.000000001, 1 in the window: the room min(4 - held, 2.6) + ε
        is exactly 2.0, so a 2nd hit in the window fits."""
        held = 2.000000001
        assert min(4.0 - held, 4.0 * NOW.elapsed) + 1e-9 == 2.0
        claim = ShareClaim(1, 50.0, 2.0, 4.0, 4, False)
        assert verdict(_client(9, 0, sp=1), self._held(held), claim, 1, NOW) == (50.0, False)

    def test_a_pool_share_a_hair_under_whole_is_within_epsilon(self) -> None:
        """A cap of 2 holding 1.0000000009999999, none in the window: the client's part of the
        pool, (2 - held) x 2 / 2 + 1 + ε, is exactly 2.0, so its 2nd hit from the spare fits."""
        held = 1.0000000009999999
        assert (2.0 - held) * 2.0 / 2.0 + 1 + 1e-9 == 2.0
        claim = ShareClaim(1, 50.0, 2.0, 2.0, 4, False)
        assert verdict(_client(9, 1, sp=1), self._held(held), claim, 0, NOW) == (50.0, False)

    def test_a_client_asks_for_spare_once_a_period(self) -> None:
        """Registered already (sp 1): its weight is not added again, so the pool splits over 2:
        24 / 2 x 2 + 1 = 25 (once more it would be 13)."""
        cap = _spare_cap()
        assert verdict(_client(9, 24, sp=1), cap, _claim(), 49, NOW) == (50.0, False)
        assert cap.spare_weight == 2.0


class TestPeriodStart:
    """A period starts with λ and R as computed, and nothing seen, used or asked."""

    def test_a_new_period_counts_nothing_yet(self) -> None:
        cap = CapPeriod(25, PeriodLevel(10.0, 40.0, 5))
        assert (cap.period, cap.level, cap.reserved, cap.holders) == (25, 10.0, 40.0, 5)
        seen = (cap.seen_holders, cap.seen_reserved, cap.seen_weight)
        assert (*seen, cap.used, cap.over, cap.spare_weight) == (0, 0.0, 0.0, 0.0, 0.0, 0.0)


class TestTouch:
    """A client's first touch in a period: what its plan still holds, and its weight, seen."""

    def test_plans_are_what_the_client_may_take_this_window(self) -> None:
        """The client above: 9 at λ = 10; none before λ exists."""
        claim = _claim()
        assert plan_of(_client(3), CapPeriod(25, PeriodLevel(10.0, 0.0)), claim, NOW) == 9.0
        assert plan_of(_client(3), CapPeriod(25, PeriodLevel(None, 0.0)), claim, NOW) == 0.0

    def test_holders_and_a_client_at_its_plan(self) -> None:
        """3 of a plan of 9 taken: 6 held; all 9 taken: its weight only; 8 taken: its last
        hit held. 7 held by 2 holders, weights seen 2 + 2 + 2."""
        cap = CapPeriod(25, PeriodLevel(10.0, 0.0))
        for taken in (3, 9, 8):
            touch(_client(taken), cap, _claim(), NOW)
        assert (cap.seen_reserved, cap.seen_holders, cap.seen_weight) == (7.0, 2, 6.0)

    def test_before_lambda_only_weights_are_seen(self) -> None:
        cap = CapPeriod(25, PeriodLevel(None, 0.0))
        touch(_client(0), cap, _claim(), NOW)
        touch(_client(0), cap, _claim(), NOW)
        assert (cap.seen_reserved, cap.seen_holders, cap.seen_weight) == (0.0, 0, 4.0)


class TestRecord:
    def test_demand_adds_up_in_the_window_and_the_period(self) -> None:
        """3 then 4 hits asked: 7 this window and this period (admitted or not)."""
        row = Row(10.0, 1.0)
        record(row, 3)
        record(row, 4)
        assert (row.d, row.pd, row.a) == (7.0, 7.0, 0.0)
