"""Fairness v3 at a cap (core/sharing.py), as specifications: a row's history and window, the
sliding prediction of its demand, the division of the cap and the per-request verdict.

The store tests see these only through whole admissions; here each rule is pinned on its own.
Expected values are worked by hand (the arithmetic is in each docstring) or by
tests/support/maxmin.py, the independent exact max-min solver; the code under test never makes
its own expectation.
The window is [0, 10) or a later one of 10 s, the period P = 1 s, unless a test says.
"""

import copy
import math
import random
from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlimit.core.sharing import (
    ALPHA,
    AMORTISE,
    BURST,
    DIVIDED_BY,
    EPSILON,
    FORCES,
    HELD,
    LEAD,
    NONE,
    OPEN,
    SPLIT,
    STALE,
    Clock,
    Division,
    Row,
    ShareClaim,
    charge,
    contended,
    divide,
    enter,
    fold,
    last_period,
    leave,
    part,
    predicted,
    record,
    schedule,
    stale_division,
    verdict,
    want,
)
from maxmin import INF, level
from sharing_rows import P, W, ask, at, row_of

pytestmark = pytest.mark.unit

def state(of: Row | Division) -> dict[str, object]:
    return {name: getattr(of, name) for name in type(of).__slots__}


def sums(division: Division) -> tuple[float, float, float]:
    return division.held, division.fixed, division.rate


def ewma(demands: Sequence[int]) -> tuple[Fraction, Fraction]:
    """(EWMA, its weight) of per-period demands, oldest first, in rationals: the k-th last
    period weighs ALPHA·(1 - ALPHA)^k, and the sum is divided by the weights' sum (bias
    corrected, so that a client seen n periods is not taken as quiet before them)."""
    alpha = Fraction(ALPHA)
    weights = [alpha * (1 - alpha) ** k for k in range(len(demands))]
    total = sum((w * d for w, d in zip(weights, reversed(demands), strict=True)), Fraction(0))
    return total / sum(weights), sum(weights, Fraction(0))


class TestClock:
    def test_where_an_instant_sits(self) -> None:
        """Window [120, 180), P = 1, now 125.5: period 125, sub-period 125.5 x SPLIT = 502,
        54.5 periods left, half the period and LEAD more gone, φ = (5.5 + LEAD) / 60."""
        clock = Clock(60, 1.0, 125.5)
        assert (clock.period, clock.epoch, clock.start, clock.end) == (125, 502, 120, 180)
        assert (clock.left, clock.into) == (54.5, 0.5 + LEAD)
        assert clock.elapsed == pytest.approx((5.5 + LEAD) / 60)

    def test_elapsed_stops_at_the_whole_window(self) -> None:
        """In the window's last LEAD of a period φ is 1, not more."""
        assert Clock(60, 1.0, 179.99).elapsed == 1.0

    def test_periods_shorter_than_a_second(self) -> None:
        """P = 0.5 s, now 2.3 of [0, 10): period 4, sub-period 2.3 x 4 / 0.5 = 18.4 -> 18,
        7.7 s = 15.4 periods left, 0.6 + LEAD of the period gone, φ = (2.3 + 0.5 LEAD) / 10."""
        clock = Clock(10, 0.5, 2.3)
        assert (clock.period, clock.epoch, clock.start) == (4, 18, 0)
        assert clock.left == pytest.approx(15.4)
        assert clock.into == pytest.approx(0.6 + LEAD)
        assert clock.elapsed == pytest.approx((2.3 + 0.5 * LEAD) / 10)


class TestHistory:
    """fold moves a row's EWMA of demand per period on (``_history``), bias-corrected."""

    def test_a_clients_first_whole_period_counts_in_full(self) -> None:
        """6 asked in its first period: one period on its history is 6 (not ALPHA x 6 = 3),
        with the weight of one period, ALPHA."""
        row = row_of((10.3, 6))
        fold(row, at(11.2), INF)
        assert (row.history, row.mass) == (6.0, ALPHA)
        assert ewma([6]) == (Fraction(6), Fraction(1, 2))

    def test_two_periods(self) -> None:
        """6 then 2: (2/2 + 6/4) / (1/2 + 1/4) = 10/3, weight 3/4."""
        row = row_of((10.3, 6), (11.5, 2))
        fold(row, at(12.0), INF)
        assert row.history == pytest.approx(10 / 3)
        assert row.mass == 0.75
        assert ewma([6, 2]) == (Fraction(10, 3), Fraction(3, 4))

    @pytest.mark.parametrize("gap", [1, 2, 3, 5, 10, STALE])
    def test_a_gap_decays_the_history_by_one_less_alpha_each_quiet_period(self, gap: int) -> None:
        """6 then 2 asked in periods 10 and 11, folded ``gap`` periods after 11: the weighted
        sum history x mass is (ALPHA x 2 + (1 - ALPHA) x 6 x ALPHA) x (1 - ALPHA)^(gap - 1),
        the mass 1 - (1 - ALPHA)^(gap + 1): the EWMA of 6, 2 and gap - 1 quiet periods."""
        row = row_of((10.3, 6), (11.5, 2))
        fold(row, at(11 + gap + 0.5), INF)
        keep = 1 - ALPHA
        assert row.history * row.mass == pytest.approx(
            (ALPHA * 2 + keep * 6 * ALPHA) * keep ** (gap - 1)
        )
        assert row.mass == pytest.approx(1 - keep ** (gap + 1))
        value, mass = ewma([6, 2] + [0] * (gap - 1))
        assert (row.history, row.mass) == pytest.approx((float(value), float(mass)))

    def test_history_lasts_stale_periods_then_is_gone(self) -> None:
        """2^64 asked in period 0: STALE = 64 periods on it weighs ALPHA^64 = 2^-64, so the
        history is 1 (the weights add up to 1 - 2^-64, 1 in doubles); 65 on: 0, no weight."""
        assert STALE == 64
        kept = row_of((0.5, 2**64))
        fold(kept, at(64.5), INF)
        assert kept.history == 1.0
        gone = row_of((0.5, 2**64))
        fold(gone, at(65.5), INF)
        assert (gone.history, gone.mass) == (0.0, 0.0)

    def test_a_client_back_after_its_history_is_gone_starts_afresh(self) -> None:
        """Asked 6 in period 0, then 4 in period 70: one period on its history is 4, its
        first whole period since counted in full."""
        row = row_of((0.5, 6), (70.5, 4))
        fold(row, at(71.5), INF)
        assert (row.history, row.mass) == (4.0, ALPHA)

    @given(st.lists(st.tuples(st.integers(1, 70), st.integers(0, 1000)), min_size=1, max_size=12))
    def test_the_history_is_the_ewma_of_every_period_since_the_row_was_made(
        self, steps: list[tuple[int, int]]
    ) -> None:
        """A client asking ``hits`` in the period ``gap`` after the one of its last request:
        one period on, its history is the EWMA of its demand in every period since its
        first (the quiet ones count 0), or since its history went stale."""
        row = Row(INF, 1.0)
        period = 0
        demands: list[int] = []
        for gap, hits in steps:
            period += gap
            if gap > STALE:
                demands = []
            elif demands:
                demands += [0] * (gap - 1)
            ask(row, period + 0.5, hits)
            demands.append(hits)
        fold(row, at(period + 1.5), INF)
        value, mass = ewma(demands)
        assert row.history == pytest.approx(float(value), rel=1e-9, abs=1e-12)
        assert row.mass == pytest.approx(float(mass), rel=1e-12)

    def test_the_period_before_is_kept_for_the_figures(self) -> None:
        """Asked 3 and 4 in period 10, the 3 admitted: folded to period 11, last_asked 7
        and last_admitted 3, the period's counts from 0; folded to 13 instead, 0 and 0."""
        next_one = ask(row_of((10.2, 3)), 10.6, 4, admitted=False)
        later = copy.copy(next_one)
        fold(next_one, at(11.1), INF)
        assert (next_one.last_asked, next_one.last_admitted) == (7.0, 3.0)
        assert (next_one.period_asked, next_one.period_admitted, next_one.period) == (0, 0, 11)
        fold(later, at(13.1), INF)
        assert (later.last_asked, later.last_admitted) == (0.0, 0.0)

    def test_a_second_fold_in_the_period_changes_nothing(self) -> None:
        """Folded already to period 11 of [10, 20): folding again later in it leaves the row
        as it was."""
        row = ask(row_of((3.0, 4)), 11.2, 2)
        before = state(row)
        fold(row, at(11.9), INF)
        assert state(row) == before


class TestWindowRoll:
    """fold moves a row to a new window: what it asked in the one before, and when."""

    def test_the_window_before_is_kept_as_previous(self) -> None:
        """Asked 4 at 3.0 and 3 at 8.5 in [0, 10): folded to 12.0, previous is 7 and
        previous_last 8.5; asked, admitted and credit start again at 0."""
        row = row_of((3.0, 4), (8.5, 3))
        fold(row, at(12.0), INF)
        assert (row.previous, row.previous_last, row.window) == (7.0, 8.5, 10)
        assert (row.asked, row.admitted, row.credit) == (0.0, 0.0, 0.0)

    def test_a_window_skipped_leaves_no_previous(self) -> None:
        """Folded to 25.0, a window later than the one after [0, 10): previous is -1 (it
        was not there), previous_last still the time of its last request."""
        row = row_of((3.0, 4), (8.5, 3))
        fold(row, at(25.0), INF)
        assert (row.previous, row.previous_last, row.window) == (-1.0, 8.5, 20)

    def test_a_window_where_it_asked_nothing_is_a_previous_of_zero(self) -> None:
        """Folded into [10, 20) without asking, then to [20, 30): previous 0 (it was there)."""
        row = row_of((3.0, 4))
        fold(row, at(12.0), INF)
        fold(row, at(21.0), INF)
        assert row.previous == 0.0


class TestCredit:
    """A window's rounding is carried to the next as a credit below one hit: the fraction
    of the client's exact max-min share of that window (λ = ``closing``) it did not get, or
    got over it (a debt)."""

    @staticmethod
    def short(asked: int, admitted: int, limit: float = INF, weight: float = 1.0) -> Row:
        """A client that asked ``asked`` in [0, 10), ``admitted`` of them admitted."""
        row = row_of((1.0, admitted), limit=limit, weight=weight)
        return ask(row, 2.0, asked - admitted, admitted=False)

    def test_the_fraction_below_the_exact_share_is_carried(self) -> None:
        """Three clients asked 5 each of a cap of 7: λ = 7/3 (maxmin.level). One admitted 2
        carries 7/3 - 2 = 1/3 into [10, 20)."""
        lam = level([5, 5, 5], [1, 1, 1], 7)
        assert lam == Fraction(7, 3)
        row = self.short(5, 2)
        fold(row, at(10.5), float(lam))
        assert row.credit == pytest.approx(1 / 3)

    def test_remainders_rotate(self) -> None:
        """A share of 7/3 a window, admitted 2, 2 then 3 (the whole part of share + credit
        each time): the credit goes 1/3, 2/3, then 0; 7 admitted in three windows."""
        lam = 7 / 3
        row = self.short(5, 2)
        credits = []
        for start, admitted in ((10, 2), (20, 3)):
            fold(row, at(start + 0.5), lam)
            credits.append(row.credit)
            ask(row, start + 1, admitted, closing=lam)
            ask(row, start + 2, 5 - admitted, admitted=False, closing=lam)
        fold(row, at(30.5), lam)
        credits.append(row.credit)
        assert credits == [pytest.approx(1 / 3), pytest.approx(2 / 3), pytest.approx(0, abs=1e-9)]

    def test_the_weight_and_the_limit_bound_the_share(self) -> None:
        """λ = 7/3 at weight 1.5 is a share of 3.5: admitted 3 carries 0.5. A limit of 2.25
        under λ·w: the share is 2.25, admitted 2 carries 0.25."""
        weighted = self.short(5, 3, weight=1.5)
        fold(weighted, at(10.5), 7 / 3)
        limited = self.short(5, 2, limit=2.25)
        fold(limited, at(10.5), 7 / 3)
        assert (weighted.credit, limited.credit) == pytest.approx((0.5, 0.25))

    def test_a_whole_hit_left_unused_is_not_owed(self) -> None:
        """Admitted 1 of a share of 7/3: 4/3 short; the whole hit is not carried (it was
        there to take), its fraction is: 1/3, as for a client admitted 2."""
        row = self.short(5, 1)
        fold(row, at(10.5), 7 / 3)
        assert row.credit == pytest.approx(1 / 3)

    def test_a_hit_above_the_share_is_carried_as_a_debt(self) -> None:
        """Admitted 3 of a share of 7/3 (its last request rounded it up): 2/3 owed into
        [10, 20), so its next share is 7/3 - 2/3 = 5/3 and the rounding rotates; admitted
        4, 5/3 over, owes the fraction alone (a whole hit over was the cap's to give)."""
        rounded_up = self.short(5, 3)
        fold(rounded_up, at(10.5), 7 / 3)
        far_over = self.short(5, 4)
        fold(far_over, at(10.5), 7 / 3)
        assert (rounded_up.credit, far_over.credit) == pytest.approx((-2 / 3, -2 / 3))

    def test_a_client_that_got_all_it_asked_is_owed_nothing(self) -> None:
        """Asked 2, admitted 2, under a share of 7/3: nothing carried."""
        row = self.short(2, 2)
        fold(row, at(10.5), 7 / 3)
        assert row.credit == 0.0

    def test_nothing_is_carried_over_a_skipped_window(self) -> None:
        """Asked 5, admitted 2 in [0, 10), next seen in [20, 30): nothing carried."""
        row = self.short(5, 2)
        fold(row, at(20.5), 7 / 3)
        assert row.credit == 0.0


class TestPredicted:
    """A row's rate in hits per period, over the last window's length."""

    def test_a_steady_client_keeps_its_rate_across_window_edges(self) -> None:
        """10 hits a second (one every 0.1 s) through three windows: from 5 s on, at every
        request, before and after each window edge, it predicts 10 a period within 1.5%."""
        row = Row(INF, 1.0)
        seen: list[float] = []
        for k in range(300):
            now = (k + 0.5) / 10
            fold(row, at(now), INF)
            if now > 5:
                seen.append(predicted(row, at(now)))
            record(row, 1, now)
            charge(row, 1)
        assert min(seen) >= 9.85
        assert max(seen) <= 10.15

    def test_a_one_shot_client_is_forgotten_a_window_after_its_request(self) -> None:
        """50 hits at 2.0 in [0, 10), nothing since, taken as spread over [0, 2.0]. At 11.0
        the last window's length starts at 1.0: half of them are inside it, 25 / 10 = 2.5 a
        period; from 12.0 on none is: 0."""
        row = row_of((2.0, 50))
        assert predicted(row, at(11.0)) == 2.5
        assert predicted(row, at(11.99)) > 0
        assert predicted(row, at(12.0)) == predicted(row, at(15.0)) == 0.0

    def test_a_client_not_seen_last_window_is_its_rate_so_far(self) -> None:
        """New in [0, 60): 41 hits by 20.5, 2 a period over the 20.5 periods gone; 3 hits by
        0.5 count over one whole period at least: 3."""
        assert predicted(row_of((20.0, 41), window=60), Clock(60, 1.0, 20.5)) == 2.0
        assert predicted(row_of((0.2, 3), window=60), Clock(60, 1.0, 0.5)) == 3.0

    def test_a_client_back_after_a_skipped_window_is_its_rate_so_far(self) -> None:
        """Asked 40 in [0, 10), then 6 at 23.5: at 24.0 it predicts 6 / 4 periods = 1.5."""
        row = row_of((5.0, 40), (23.5, 6))
        assert predicted(row, at(24.0)) == 1.5

    def test_the_rate_is_per_period(self) -> None:
        """P = 0.5 s, 9 hits by 2.25 of [0, 10): 4.5 periods gone, 2 a period."""
        row = Row(INF, 1.0)
        fold(row, Clock(10, 0.5, 2.0), INF)
        record(row, 9, 2.0)
        assert predicted(row, Clock(10, 0.5, 2.25)) == 2.0

    def test_a_client_new_in_the_window_that_has_gone_quiet_is_predicted_nothing(self) -> None:
        """A burst new in [0, 60): 10 hits at each of 20, 21, 22 and 23. Asking for 3 s, it is
        quiet once 3 s, a period and the gap its rate predicts between hits (the window gone
        over 40) have gone since its last: past 27 / (1 - 1 / 40) = 27.69..., at 27.69 its
        rate so far (40 / 27.69 a period), at 27.70 nothing; its want is then what it asked,
        and a division counts it so (open, 40 fixed, no rate). A client seen in the window
        before keeps its rate, however long it has been quiet."""
        row = row_of(*[(20.0 + i, 10) for i in range(4)], window=60)
        assert predicted(row, Clock(60, 1.0, 27.69)) == pytest.approx(40 / 27.69)
        assert predicted(row, Clock(60, 1.0, 27.70)) == 0.0
        assert want(row, Clock(60, 1.0, 27.70), 2) == (42.0, 0.0)
        assert want(row, Clock(60, 1.0, 27.69), 2) == pytest.approx((42.0, 40 / 27.69))
        division = divide([("b", row)], 1000.0, Clock(60, 1.0, 27.70))
        assert sums(division) == (0.0, 40.0, 0.0)
        division = divide([("b", row)], 1000.0, Clock(60, 1.0, 27.69))
        assert sums(division) == pytest.approx((0.0, 40.0, 40 / 27.69))
        steady = row_of((50.0, 30), (70.0, 10), window=60)  # 30 in [0, 60), 10 at 70
        assert predicted(steady, Clock(60, 1.0, 100.0)) == pytest.approx((10 + 30 * 10 / 50) / 60)

    def test_one_request_is_quiet_after_a_period_and_the_gap_its_rate_predicts(self) -> None:
        """One request of 41 at 20.0 of [0, 60): asking for no time, it is quiet once a
        period and the window gone over 41 have passed (past 21 / (1 - 1 / 41) = 21.525:
        20.5, 2 a period; 21.5, 41 / 21.5; 21.53, nothing). A period is P: at P = 0.5 (a cap
        of 10 s), 9 hits at 2.0 are quiet past 2.5 / (1 - 1 / 9) = 2.8125."""
        one = row_of((20.0, 41), window=60)
        assert predicted(one, Clock(60, 1.0, 20.5)) == 2.0
        assert predicted(one, Clock(60, 1.0, 21.5)) == pytest.approx(41 / 21.5)
        assert predicted(one, Clock(60, 1.0, 21.53)) == 0.0
        row = Row(INF, 1.0)
        fold(row, Clock(10, 0.5, 2.0), INF)
        record(row, 9, 2.0)
        assert predicted(row, Clock(10, 0.5, 2.8)) == pytest.approx(9 / 5.6)
        assert predicted(row, Clock(10, 0.5, 2.82)) == 0.0

    def test_one_hit_is_never_quiet_in_its_window(self) -> None:
        """One hit at 0.0 of [0, 60) (a sparse client seen once): it cannot have been quiet
        for longer than the window has gone, so it keeps its rate so far, one hit over the
        window gone (1 / 2.5 a period at 2.5, 1 / 59.9 at 59.9); in a division too. Taken
        as quiet after a period, it was predicted nothing from 1.0 on, and a one-shot beside
        six such clients took their minute."""
        one = row_of((0.0, 1), window=60)
        for now in (2.5, 59.9):
            assert predicted(one, Clock(60, 1.0, now)) == pytest.approx(1 / now)
        assert want(one, Clock(60, 1.0, 2.5), 1) == pytest.approx((2.0, 1 / 2.5))
        division = divide([("s", one)], 1000.0, Clock(60, 1.0, 2.5))
        assert sums(division) == pytest.approx((0.0, 1.0, 1 / 2.5))

    def test_a_row_not_folded_predicts_as_folded_and_is_not_changed(self) -> None:
        """A division reads every row as it stands: a row last touched in [0, 10) predicts at
        11.0 what it predicts once folded there, and stays as it was."""
        row = row_of((1.0, 20), (2.0, 30))
        before = state(row)
        unfolded = (predicted(row, at(11.0)), want(row, at(11.0), 2))
        assert state(row) == before
        fold(row, at(11.0), INF)
        assert (predicted(row, at(11.0)), want(row, at(11.0), 2)) == unfolded


class TestWant:
    """A want is ``fixed + rate·left``: asked this window (the request's hits included) and
    the rate for the periods left, within the client's limit."""

    def test_asked_and_the_rate_for_the_periods_left(self) -> None:
        """12 asked by 4.0 of [0, 10): 3 a period, 6 periods left, want 12 + 3 x 6 = 30; with
        this request's 2 hits, (14, 3)."""
        row = row_of((3.5, 12))
        assert want(row, at(4.0)) == (12.0, 3.0)
        assert want(row, at(4.0), 2) == (14.0, 3.0)

    def test_the_limit_caps_a_want(self) -> None:
        """Want 30 over a limit of 25: (25, 0), the limit whatever the periods left; at a
        limit of 30 the want is kept."""
        assert want(row_of((3.5, 12), limit=25), at(4.0)) == (25.0, 0.0)
        assert want(row_of((3.5, 12), limit=30), at(4.0)) == (12.0, 3.0)

    def test_demand_before_the_last_windows_length_is_no_want(self) -> None:
        """12 asked at 1.0 of [0, 10), the row not folded since: at 14.0 it asked nothing this
        window, and the last window's length starts at 4.0, after its 12: want (hits, 0)."""
        assert want(row_of((1.0, 12)), at(14.0), 3) == (3.0, 0.0)

    def test_part_in_a_division(self) -> None:
        """Want 30 at weight 2: open with (12, 3) at λ = 15 (30 <= 15 x 2), held without sums
        at λ = 14.9; a row without any want has no part."""
        row = row_of((3.5, 12), weight=2)
        assert part(row, at(4.0), 15.0) == (OPEN, 12.0, 3.0)
        assert part(row, at(4.0), 14.9) == (HELD, 0.0, 0.0)
        assert part(row, at(4.0), INF) == (OPEN, 12.0, 3.0)
        assert part(row_of((1.0, 12)), at(25.0), 1.0) == (NONE, 0.0, 0.0)


class TestWantOfAClientThatComesEveryWindow:
    """At a cap of one second's window, a client whose light requests come one window apart
    (``gap`` 1: a page load every second at its own phase) is predicted by its window before
    where its rate says less (its lump still to come) or more (during and after its lump).
    Here it asked 6 at 1.7 of [1, 2)."""

    @staticmethod
    def lump(gap: float = 1.0) -> Row:
        row = row_of((0.7, 6), (1.7, 6), window=1)
        row.gap = gap
        return row

    @staticmethod
    def second(now: float) -> Clock:
        return at(now, window=1)

    def test_before_its_point_it_wants_its_lump(self) -> None:
        """At 2.3 it has asked nothing; its rate, the 6 taken as spread over [1, 1.7), keeps
        4/7 of them in the window's length from 1.3: 3.43 a period, 2.4 for the 0.7 left.
        Its point (1.7 a window on) is still to come: it wants the 6, fixed; asking 1 now,
        the same (the 1 is part of the 6). With a gap of 2, or a window of 10 periods, its
        rate."""
        fluid = 6 * (4 / 7)
        assert want(self.lump(2.0), self.second(2.3)) == pytest.approx((0.0, fluid))
        assert want(self.lump(), self.second(2.3)) == (6.0, 0.0)
        assert want(self.lump(), self.second(2.3), 1) == (6.0, 0.0)
        ten = row_of((7.0, 6), (17.0, 6))
        ten.gap = 1.0
        assert want(ten, at(23.0)) == pytest.approx((0.0, 6 * (4 / 7) / 10))

    def test_during_its_lump_it_wants_its_lump(self) -> None:
        """At 2.7, its point, having asked 4 of its 6 and asking 1 more: the 6 (its rate, the
        4 asked as 4 a period for the 0.3 left, wanted 6.2, and held it once past the level);
        P/32 past its point still the 6; having asked 7, its rate."""
        row = ask(self.lump(), 2.7, 4, window=1)
        assert want(row, self.second(2.7), 1) == (6.0, 0.0)
        assert want(row, self.second(2.73), 1) == (6.0, 0.0)
        more = ask(self.lump(), 2.7, 7, window=1)
        assert want(more, self.second(2.7), 1) == pytest.approx((8.0, 7.0))

    def test_past_its_point_with_its_lump_asked_it_wants_no_more(self) -> None:
        """At 2.75, having asked 6 at 2.7: past its point, as much asked as then: no more
        (its rate, 6 a period, wanted 1.5 more); having asked 2, its rate; with a gap of 2,
        its rate."""
        row = ask(self.lump(), 2.7, 6, window=1)
        assert want(row, self.second(2.75)) == (6.0, 0.0)
        less = ask(self.lump(), 2.7, 2, window=1)
        assert want(less, self.second(2.75)) == pytest.approx((2.0, 2.0))
        other = ask(self.lump(2.0), 2.7, 6, window=1)
        assert want(other, self.second(2.75)) == pytest.approx((6.0, 6.0))

    def test_a_division_counts_it_as_want_does(self) -> None:
        """``divide`` works the wants out inline: the same (6, 0) in its sums."""
        division = divide([("u", self.lump())], 100.0, self.second(2.3))
        assert sums(division) == (0.0, 6.0, 0.0)
        assert part(self.lump(), self.second(2.3), division.level) == (OPEN, 6.0, 0.0)


class TestWantOfAClientInPages:
    """At a cap of one second's window, a client whose light requests come some windows
    apart (``gap`` above 1, booked for a later window by ``schedule``) is predicted by what
    it asked in its page's window, and by what it asks in the window after it."""

    lump = staticmethod(TestWantOfAClientThatComesEveryWindow.lump)
    second = staticmethod(TestWantOfAClientThatComesEveryWindow.second)

    def test_in_its_page_window_it_wants_what_it_asked(self) -> None:
        """Its page of [2, 3) its last, its gap 2 and that page booked for [2, 3): at 2.75,
        having asked 6 at 2.7, the 6 and no more (its rate, 6 a period, wanted 1.5 more);
        asking 1 more, the 7; a division counts it so. Its page not booked for this
        second (nobody expected it: a second page, or one out of its rhythm), its rate;
        before its page's request set ``page``, its rate; at a cap of ten seconds, its
        rate (the 6 over the 8 s gone)."""
        row = ask(self.lump(2.0), 2.7, 6, window=1)
        row.page = row.booked = 2
        assert want(row, self.second(2.75)) == (6.0, 0.0)
        assert want(row, self.second(2.75), 1) == (7.0, 0.0)
        assert sums(divide([("u", row)], 100.0, self.second(2.75))) == (0.0, 6.0, 0.0)
        for page, booked in ((2, -1), (2, 3), (1, 1)):
            row.page, row.booked = page, booked
            assert want(row, self.second(2.75)) == pytest.approx((6.0, 6.0))
            assert sums(divide([("u", row)], 100.0, self.second(2.75)))[2] == 6.0
        ten = row_of((7.0, 6), window=10)
        ten.gap, ten.page, ten.booked = 2.0, 0, 0
        assert want(ten, at(8.0)) == pytest.approx((6.0, 6 / 8))

    def test_a_page_across_a_seconds_edge_is_one_page(self) -> None:
        """A page of 0.97-1.02 s every 4 s: at 1.005 it goes on with the page of [0, 1)
        (asked last at 0.99, here 15 ms on): its page window stays 0 and is not booked (no
        gap yet); at 4.97 its gap is 4 and it is booked for 8 s, at 5.005 for 9 s (its
        page window still 4). Asked last at 0.96, or here at 1.07 (2·LEAD on is 1.0525),
        or coming every window, a page of its own."""
        row = Row(INF, 1.0)
        got = []
        for times in ((0.97, 0.99), (1.0, 1.005), (4.97, 4.99), (5.0, 5.005)):
            for now in times:
                clock = Clock(1, 1.0, now)
                fold(row, clock, INF)
                record(row, 1, now)
                expected_at = schedule(row, clock)
            got.append((row.page, row.gap, expected_at))
        assert got == [(0, 0.0, -1.0), (0, 0.0, -1.0), (4, 4.0, 8.0), (4, 4.0, 9.0)]
        for last, first, gap in ((0.96, 1.0, 4.0), (0.99, 1.07, 4.0), (0.99, 1.0, 1.0)):
            row = row_of((last, 1), window=1)
            row.page, row.gap = 0, gap
            clock = Clock(1, 1.0, first)
            fold(row, clock, INF)
            record(row, 1, first)
            schedule(row, clock)
            assert (row.page, row.gap) == (1, 1.0)

    def test_schedule_keeps_the_window_its_page_was_booked_for(self) -> None:
        """Pages at 1, 3 and 5 s (a gap of 2 from the second): the first two booked for no
        window of theirs (no gap before them), the third for [5, 6), and it books the
        client for [7, 8); one at 6 s was booked for 7 s, not for its own second."""
        row = Row(INF, 1.0)
        booked = []
        for now in (1.5, 3.5, 5.5, 5.9, 6.5):
            expected_at = schedule(row, Clock(1, 1.0, now))
            booked.append((row.booked, row.gap, expected_at))
        assert booked == [
            (-1.0, 0.0, -1.0), (-1.0, 2.0, 5.0), (5.0, 2.0, 7.0), (5.0, 2.0, 7.0),
            (7.0, 1.0, -1.0),
        ]  # fmt: skip

    def test_in_the_window_after_it_wants_none_of_its_page(self) -> None:
        """Its page of [1, 2) its last (``page``) and its gap 2 (``schedule`` booked it for
        [3, 4)): at 2.3 none of the 6, and asking 1 now, the 1; a division counts it so.
        With [0, 1) its last page (its gap from an older page), its rate."""
        row = self.lump(2.0)
        row.page = 1
        assert want(row, self.second(2.3)) == (0.0, 0.0)
        assert want(row, self.second(2.3), 1) == (1.0, 0.0)
        assert sums(divide([("u", row)], 100.0, self.second(2.3))) == (0.0, 0.0, 0.0)
        older = self.lump(2.0)
        older.page = 0
        assert want(older, self.second(2.3)) == pytest.approx((0.0, 6 * (4 / 7)))


# Rows at 5.0 of [0, 10) that asked a hits at 1.0 want 2a: a asked, a / 5 a period for 5 more.
HALF = at(5.0)


def halfway(asked: int, limit: float = INF, weight: float = 1.0) -> Row:
    """A client that asked ``asked`` at 4.5, still asking at HALF (not quiet: ``_quiet``)."""
    return row_of((4.5, asked), limit=limit, weight=weight)


@st.composite
def clients(draw: st.DrawFn, min_size: int = 1) -> list[tuple[int, float, int]]:
    """(asked by 4.5, limit, weight) of up to 8 clients, in whole numbers."""
    limit = st.integers(0, 120).map(float) | st.just(INF)
    one = st.tuples(st.integers(0, 60), limit, st.integers(1, 5))
    return draw(st.lists(one, min_size=min_size, max_size=8))


def halfway_wants(case: Sequence[tuple[int, float, int]]) -> list[Fraction | float]:
    """The wants of ``halfway`` rows, by hand: 2a within the limit."""
    return [min(Fraction(2 * a), Fraction(lim)) if lim != INF else Fraction(2 * a)
            for a, lim, _ in case]  # fmt: skip


class TestDivide:
    """λ over every row's want, and the sums the division keeps of the held and open parts."""

    @staticmethod
    def rows() -> dict[str, Row]:
        """a, b and c asked 3, 10 and 20 by 4.5, weights 1, 1, 2."""
        return {"a": halfway(3), "b": halfway(10), "c": halfway(20, weight=2.0)}

    def test_the_level_and_the_sums(self) -> None:
        """Asked 3, 10 and 20 by 5.0 at weights 1, 1, 2: wants 6, 20, 40; over 50, λ = 44/3
        (maxmin.level). a is open (3 asked, 0.6 a period), b (20 > 44/3) and c (40 > 88/3)
        are held: weight 3; the largest open want is a's 6. The division is the first of
        its sub-period: epoch FORCES x sub-period."""
        lam = level([6, 20, 40], [1, 1, 2], 50)
        assert lam == Fraction(44, 3)
        division = divide(self.rows().items(), 50.0, HALF)
        assert division.level == pytest.approx(float(lam))
        assert sums(division) == pytest.approx((3.0, 3.0, 0.6))
        assert division.top == pytest.approx(6.0)
        assert (division.rows, division.epoch, division.forced, division.excluded) == (
            3,
            FORCES * HALF.epoch,
            0,
            "",
        )

    def test_the_asker_counts_in_the_level_not_in_the_sums(self) -> None:
        """Forced by d, which asked 5 and asks 1 more (want 5 + 1 + 1 x 5 = 11): λ = 11, the
        level of 6, 20, 40 and 11 (maxmin.level); the sums are a, b and c's at λ = 11 (a open,
        b and c held), d excluded; 4 rows; the first remake forced in the sub-period:
        epoch FORCES x sub-period + 1."""
        lam = level([6, 20, 40, 11], [1, 1, 2, 1], 50)
        assert lam == 11
        rows = {**self.rows(), "d": halfway(5)}
        division = divide(rows.items(), 50.0, HALF, asker="d", extra=1, forced=1)
        assert division.level == pytest.approx(11.0)
        assert sums(division) == pytest.approx((3.0, 3.0, 0.6))
        assert (division.excluded, division.forced, division.rows) == ("d", 1, 4)
        assert division.epoch == FORCES * HALF.epoch + 1

    def test_uncontended(self) -> None:
        """Wants 6, 20, 40 over 66: they fit, λ infinite, every row open: 33 asked, 6.6 a
        period, the largest want per weight c's 40 / 2 = 20."""
        division = divide(self.rows().items(), 66.0, HALF)
        assert division.level == INF
        assert sums(division) == pytest.approx((0.0, 33.0, 6.6))
        assert division.top == pytest.approx(20.0)

    def test_no_want_no_level(self) -> None:
        """Only rows with nothing asked this window or the last: λ infinite, no rows."""
        division = divide([("a", row_of((1.0, 5)))], 10.0, at(25.0))
        assert (division.level, division.rows, sums(division)) == (INF, 0, (0.0, 0.0, 0.0))

    def test_rows_are_not_changed(self) -> None:
        """The division reads rows of this period, of older periods and windows, and the
        asker's, and writes none of them."""
        rows = {**self.rows(), "old": row_of((2.0, 5)), "new": Row(INF, 1.0)}
        rows["moved"] = ask(halfway(4), 14.0, 1)
        before = {c: state(r) for c, r in rows.items()}
        divide(rows.items(), 20.0, at(15.0), asker="a", extra=2)
        assert {c: state(r) for c, r in rows.items()} == before

    def test_cold_while_no_row_has_history(self) -> None:
        """Rows new in this period have no history: cold. A row that asked in the period
        before has history at the division's instant, folded or not: not cold."""
        fresh = [("a", row_of((5.0, 4))), ("b", row_of((5.2, 9)))]
        assert divide(fresh, 10.0, at(5.5)).cold == 1
        before = [*fresh, ("c", row_of((4.5, 1)))]
        assert divide(before, 10.0, at(5.5)).cold == 0

    def test_closing_is_the_level_of_last_windows_asks(self) -> None:
        """a, b and c asked 5 each in [10, 20) of a cap of 7, d 9 in [0, 10): at 22.0 closing
        is 7/3 (maxmin.level of 5, 5, 5), with a folded into [20, 30) already or not; given,
        it is taken as given; nobody asked last window: infinite."""
        lam = level([5, 5, 5], [1, 1, 1], 7)
        rows = {c: row_of((11.0 + i, 5)) for i, c in enumerate("abc")}
        rows["d"] = row_of((3.0, 9))
        assert divide(rows.items(), 7.0, at(22.0)).closing == pytest.approx(float(lam))
        fold(rows["a"], at(21.0), INF)
        assert divide(rows.items(), 7.0, at(22.0)).closing == pytest.approx(float(lam))
        assert divide(rows.items(), 7.0, at(22.0), closing=1.5).closing == 1.5
        assert divide(rows.items(), 7.0, at(35.0)).closing == INF

    @given(clients(), st.integers(0, 500))
    def test_the_level_is_the_exact_max_min_level_of_the_wants(
        self, case: list[tuple[int, float, int]], capacity: int
    ) -> None:
        """For any wants, λ is maxmin.level of them; held are the rows wanting more than
        λ·w (their weight summed), open the others (their asked and rate summed)."""
        rows = [(str(i), halfway(a, lim, w)) for i, (a, lim, w) in enumerate(case)]
        wants = halfway_wants(case)
        weights = [w for _, _, w in case]
        exact = level(wants, weights, capacity)
        division = divide(rows, float(capacity), HALF)
        assert division.level == pytest.approx(float(exact), rel=1e-9)
        if any(x == exact * w for x, w in zip(wants, weights, strict=True)):
            return  # a want exactly at λ·w: open or held as the doubles fall
        held = [w for x, w in zip(wants, weights, strict=True) if x > exact * w]
        opened = [(a, lim) for (a, lim, w), x in zip(case, wants, strict=True)
                  if 0 < x <= exact * w]  # fmt: skip
        assert division.held == sum(held)
        assert division.fixed == sum(lim if 2 * a > lim else a for a, lim in opened)
        assert division.rate == pytest.approx(
            sum(a / 5 for a, lim in opened if 2 * a <= lim), abs=1e-9
        )

    @given(clients(), st.integers(0, 500))
    def test_the_sums_are_each_rows_part(
        self, case: list[tuple[int, float, int]], capacity: int
    ) -> None:
        """The held weight and the open sums are those of ``part`` at the division's λ,
        ``top`` the largest open want per weight."""
        rows = [(str(i), halfway(a, lim, w)) for i, (a, lim, w) in enumerate(case)]
        division = divide(rows, float(capacity), HALF)
        parts = [(part(row, HALF, division.level), row.weight) for _, row in rows]
        assert division.held == sum(w for (kind, _, _), w in parts if kind == HELD)
        assert division.fixed == pytest.approx(sum(f for (k, f, _), _ in parts if k == OPEN))
        assert division.rate == pytest.approx(sum(r for (k, _, r), _ in parts if k == OPEN))
        assert division.rows == sum(1 for (k, _, _), _ in parts if k != NONE)
        opened = [(f + r * HALF.left) / w for (k, f, r), w in parts if k == OPEN]
        assert division.top == pytest.approx(max(opened, default=0.0))


@st.composite
def played(draw: st.DrawFn) -> tuple[dict[str, Row], Clock, float]:
    """Rows of up to 6 clients after random requests over [0, 30) (some refused), a clock
    at or after the last of them, and a capacity."""
    limits = draw(st.lists(st.integers(1, 100).map(float) | st.just(INF), min_size=6, max_size=6))
    weights = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=6, max_size=6))
    events = draw(
        st.lists(
            st.tuples(st.integers(0, 5), st.integers(0, 299), st.integers(1, 12), st.booleans()),
            max_size=40,
        )
    )
    rows: dict[str, Row] = {}
    last = 0.0
    for client, tenth, hits, admitted in sorted(events, key=lambda e: e[1]):
        now = tenth / 10 + 0.05
        row = rows.setdefault(f"c{client}", Row(limits[client], weights[client]))
        ask(row, now, hits, admitted)
        last = now
    now = last + draw(st.integers(0, 50)) / 10
    return rows, at(now), float(draw(st.integers(1, 300)))


class TestDivideInline:
    """``divide`` works each row's want out inline; rows after random requests (``played``)
    hold it to ``want``."""

    @given(played())
    def test_the_inline_wants_are_want(self, case: tuple[dict[str, Row], Clock, float]) -> None:
        """``divide`` works each row's want out inline (``_seen``, ``predicted`` and ``want``
        in one pass, a quiet client's rate included): for rows after random requests, its
        sums and rows are those of every row's ``part`` at its λ."""
        rows, clock, capacity = case
        division = divide(rows.items(), capacity, clock)
        parts = [(part(row, clock, division.level), row.weight) for row in rows.values()]
        assert division.held == sum(w for (kind, _, _), w in parts if kind == HELD)
        assert division.fixed == pytest.approx(sum(f for (k, f, _), _ in parts if k == OPEN))
        assert division.rate == pytest.approx(sum(r for (k, _, r), _ in parts if k == OPEN))
        assert division.rows == sum(1 for (k, _, _), _ in parts if k != NONE)


class TestLeaveEnter:
    """A request takes its row's part out of the division and puts it back as decided."""

    def division(self) -> tuple[dict[str, Row], Division]:
        """At 2.0 of [0, 10), a asked 2 at 1.95 (1 a period: want 2 + 1 x 8 = 10), b 20 (10
        a period: want 100); over 50, λ = 40: a open with (2, 1), b held, weight 1."""
        rows = {"a": row_of((1.95, 2)), "b": row_of((1.95, 20))}
        assert level([10, 100], [1, 1], 50) == 40
        division = divide(rows.items(), 50.0, at(2.0))
        assert sums(division) == (1.0, 2.0, 1.0)
        return rows, division

    def test_an_untouched_row_leaves_with_its_part_at_the_divisions_instant(self) -> None:
        """At 2.9 a's want is 2 + (2 / 2.9) x 7.1, but it leaves with the (2, 1) it had at
        2.0: the sums go to 0; b leaves its weight."""
        rows, division = self.division()
        fold(rows["a"], at(2.9), INF)
        assert want(rows["a"], at(2.9)) == pytest.approx((2.0, 2 / 2.9))
        leave(division, rows["a"], "a", W, P)
        assert sums(division) == (1.0, 0.0, 0.0)
        assert (rows["a"].epoch, rows["a"].kind) == (division.epoch, NONE)
        leave(division, rows["b"], "b", W, P)
        assert sums(division) == (0.0, 0.0, 0.0)

    def test_a_row_that_entered_leaves_with_its_live_part(self) -> None:
        """a asks 1 at 2.5 and enters open with its want then, (3, 3 / 2.5 = 1.2): the sums
        hold (3, 1.2); at 2.9 it leaves with that same (3, 1.2)."""
        rows, division = self.division()
        row = rows["a"]
        leave(division, row, "a", W, P)
        ask(row, 2.5, 1)
        enter(division, row, OPEN, at(2.5))
        assert (row.kind, row.fixed, row.rate) == (OPEN, 3.0, 1.2)
        assert sums(division) == (1.0, 3.0, 1.2)
        fold(row, at(2.9), INF)
        leave(division, row, "a", W, P)
        assert sums(division) == (1.0, 0.0, 0.0)

    def test_the_excluded_asker_leaves_nothing(self) -> None:
        """A division forced by d does not count d in its sums, so d leaves nothing."""
        rows = {"a": halfway(3), "d": halfway(5)}
        division = divide(rows.items(), 8.0, HALF, asker="d", extra=1)
        before = sums(division)
        leave(division, rows["d"], "d", W, P)
        assert sums(division) == before
        assert (rows["d"].epoch, rows["d"].kind) == (division.epoch, NONE)

    @given(played(), st.randoms(use_true_random=False))
    def test_leaving_and_entering_as_the_same_kind_restores_the_sums(
        self, case: tuple[dict[str, Row], Clock, float], order: random.Random
    ) -> None:
        """Each row in turn (any order) leaves and enters again as the kind it has at λ:
        the sums are the division's; all leaving after that, they are 0."""
        rows, clock, capacity = case
        division = divide(rows.items(), capacity, clock)
        made = sums(division)
        clients_ = list(rows)
        order.shuffle(clients_)
        for client in clients_:
            kind = part(rows[client], clock, division.level)[0]
            leave(division, rows[client], client, clock.window, clock.period_len)
            enter(division, rows[client], kind, clock)
        assert sums(division) == pytest.approx(made, abs=1e-9)
        for client in clients_:
            leave(division, rows[client], client, clock.window, clock.period_len)
        assert sums(division) == pytest.approx((0.0, 0.0, 0.0), abs=1e-9)


# The verdicts below: window [120, 180), now 135.0: 15 s gone, 45 periods left, LEAD of the
# period gone, φ = (15 + LEAD) / 60. Capacity 600; the others: weight 2 held, 42 asked by the
# open ones and 0.4 a period to come (18 requests in the 45 periods): room 600 - 42 - 18 = 540.
LONG = Clock(60, 1.0, 135.0)
PHI = (15 + LEAD) / 60


def client(
    history: float = 10.0,
    asked: float = 150.0,
    admitted: float = 44.0,
    now: Clock = LONG,
    **fields: float,
) -> Row:
    """A row folded to ``now``: its history per period; asked and admitted this window (new
    in it, so it predicts asked / periods gone: a steady 10 a period by default, want
    150 + hits + 10 x 45 = 601 > 180 at LONG); any other field as given."""
    row = Row(fields.pop("limit", INF), fields.pop("weight", 1.0))
    row.window, row.period, row.history, row.mass = now.start, now.period, history, 1.0
    row.asked, row.admitted, row.seen = asked, admitted, now.now
    for name, value in fields.items():
        setattr(row, name, value)
    return row


def others(held: float = 2.0, fixed: float = 42.0, rate: float = 0.4, cold: int = 0) -> Division:
    """The division with the asking client out of it (at LONG)."""
    division = Division(FORCES * LONG.epoch, LONG.now, 100.0, 4)
    division.held, division.fixed, division.rate, division.cold = held, fixed, rate, cold
    return division


def claim(
    hits: int = 1, sized: bool = False, nested: bool = False, limit: float = INF
) -> ShareClaim:
    return ShareClaim(hits, limit, 1.0, 600.0, 4, sized, nested)


class TestVerdictHeld:
    """A client wanting more than the level: held at room·w / (held + w), paced by history."""

    def test_the_rest_of_a_page_is_light(self) -> None:
        """Held, a client light earlier in this window (``page``) and come back two windows
        apart: its request is light all the same (counted and booked with its page); of a
        gap of one window, or light last in an earlier window, not."""
        assert verdict(client(page=LONG.start, gap=2.0), others(), claim(), LONG, 200).light
        for page, gap in ((LONG.start, 1.0), (LONG.start - 60, 2.0), (LONG.start, 0.0)):
            v = verdict(client(page=page, gap=gap), others(), claim(), LONG, 200)
            assert (v.kind, v.light) == (HELD, False)

    def test_a_steady_client_is_paced_to_its_share_of_the_window_gone(self) -> None:
        """Share 540 x 1 / 3 = 180; history 10 a period predicts 450 more, over the 180 x
        (1 - φ) still ahead: the bound is 180 x φ = 45.09375, so 44 admitted may take one more
        hit, 45 may not."""
        v = verdict(client(), others(), claim(), LONG, 200)
        assert (v.kind, v.share) == (HELD, 180.0)
        assert v.bound == pytest.approx(180 * PHI)
        assert v.bound == pytest.approx(45.09375)

    def test_a_history_below_the_share_ahead_holds_back_only_itself(self) -> None:
        """History 2 a period predicts 2 x 45 = 90 later, under 180 x (1 - φ) = 134.9: of its
        share it keeps back 90, bound 90."""
        v = verdict(client(history=2.0), others(), claim(), LONG, 200)
        assert v.bound == pytest.approx(90.0)

    def test_a_burst_above_its_history_is_not_paced(self) -> None:
        """At 135.5 (half a period and LEAD gone; the open ones' 60 all asked, so room 540
        and share 180 still), history 2 a period (120 a window, under its share): 2 asked
        this period is its history's pace (BURST x 2 x 0.53125 = 2.125), so of its share it
        keeps back 2 x 44.5 = 89 for later: 91; 3 asked is a burst: the whole share now."""
        now, division = Clock(60, 1.0, 135.5), others(fixed=60.0, rate=0.0)
        assert BURST * 2 * now.into == 2.125
        paced = client(now=now, history=2.0, period_asked=2)
        assert verdict(paced, division, claim(), now, 200).bound == pytest.approx(91.0)
        bursting = client(now=now, history=2.0, period_asked=3)
        assert verdict(bursting, division, claim(), now, 200).bound == 180.0

    def test_a_client_whose_history_passes_its_share_is_greedy_not_bursting(self) -> None:
        """History 10 a period is 600 a window, past its share of 180: asking 11 this period
        (over 2 x 10 x 0.53125) it is still paced, to 180 x φ."""
        now, division = Clock(60, 1.0, 135.5), others(fixed=60.0, rate=0.0)
        greedy = client(now=now, period_asked=11)
        bound = verdict(greedy, division, claim(), now, 200).bound
        assert bound == pytest.approx(180 * (15.5 + LEAD) / 60)

    def test_a_client_that_had_asked_all_by_this_point_is_not_paced(self) -> None:
        """In the window before ([60, 120)) it asked 150, the last of it at 75.0, this point
        of that window (15 s in): it comes in a lump, and its history predicts nothing of it
        still to come: its whole share, 180. The same with its last request P/32 later; at
        75.1, or asking through to 119.9 (a steady client), or not there in the window
        before, it is paced: 180 x φ."""
        for last in (75.0, 75.0 + LEAD):
            lump = client(previous=150.0, previous_last=last)
            assert verdict(lump, others(), claim(), LONG, 200).bound == 180.0
        for previous, last in ((150.0, 75.1), (600.0, 119.9), (-1.0, 75.0)):
            paced = client(previous=previous, previous_last=last)
            bound = verdict(paced, others(), claim(), LONG, 200).bound
            assert bound == pytest.approx(180 * PHI), (previous, last)

    def test_a_client_without_history_takes_its_share_at_once(self) -> None:
        """No history (a newcomer, a one-shot burst), at a cap where others have some: 180."""
        v = verdict(client(history=0.0), others(), claim(), LONG, 200)
        assert (v.kind, v.bound) == (HELD, 180.0)

    def test_sized_and_nested_claims_are_never_paced(self) -> None:
        """A sized cap (its clients' limits all fit) and a cap that is itself a tenant (it
        paces its own clients) give the whole share: 180."""
        assert verdict(client(), others(), claim(sized=True), LONG, 200).bound == 180.0
        assert verdict(client(), others(), claim(nested=True), LONG, 200).bound == 180.0

    def test_the_credit_adds_to_the_bound_and_the_share(self) -> None:
        """A credit of 0.25 carried from the window before joins the share, and is paced
        with it: share 180.25, bound 180.25 x φ."""
        v = verdict(client(credit=0.25), others(), claim(), LONG, 200)
        assert (v.bound, v.share) == pytest.approx((180.25 * PHI, 180.25))

    def test_a_request_of_many_hits_may_pass_the_pace_by_less_than_itself(self) -> None:
        """40 admitted, below the paced 45.09: 10 hits may end at 50; 200 hits at most at the
        share, 180. At 45 admitted (45 + 1 > 45.09) the pace holds: 45.09, for one hit as
        for ten (so a refused request's copies, sent as one, are refused alike)."""
        assert verdict(client(admitted=40), others(), claim(10), LONG, 200).bound == 50.0
        assert verdict(client(admitted=40), others(), claim(200), LONG, 200).bound == 180.0
        for hits in (1, 10):
            bound = verdict(client(admitted=45), others(), claim(hits), LONG, 200).bound
            assert bound == pytest.approx(45.09375)

    def test_a_fraction_of_a_request_to_come_is_no_request(self) -> None:
        """0.42 a period for the 45 left is 18.9 requests to come: 18 count, room 540."""
        assert verdict(client(), others(rate=0.42), claim(), LONG, 200).share == 180.0

    def test_the_weight_takes_its_part_of_the_room(self) -> None:
        """Weight 3 beside held weight 2: 540 x 3 / 5 = 324."""
        v = verdict(client(weight=3.0), others(), claim(), LONG, 200)
        assert v.share == pytest.approx(324.0)


# A cap of a second (window [135, 136)): the others held at weight 2 beside 43 asked by the
# open ones, room 600 - 43 = 557, so a held client's share is 557 / 3 = 185.67.
SECOND_SHARE = 557 / 3


def in_second(now: Clock, admitted: float, **fields: float) -> Row:
    """A client held at a cap of a second, asking 10 a period (200 asked), ``admitted`` at
    ``now``."""
    fields.setdefault("asked", 200.0)
    return client(now=now, admitted=admitted, **fields)


class TestVerdictYoungBurst:
    """At a cap of one period's window, a client one period old is not greedy by that
    period's history: a burst across the window's edge."""

    def test_a_burst_one_period_old_is_not_paced_by_that_period(self) -> None:
        """A client first seen late in the second before (mass ALPHA: one period of
        history) asked 200 there, over its share; at 135.5 it has asked 220 (over BURST x
        200 x 0.53): a burst, unpaced. A client of longer history asking so is greedy,
        paced: 185.67 - 185.67 x (1 - φ)."""
        now = Clock(1, 1.0, 135.5)
        burst = {"history": 200.0, "period_asked": 220.0, "asked": 220.0}
        young = in_second(now, 90.0, mass=ALPHA, **burst)
        old = in_second(now, 90.0, **burst)
        division = others(fixed=43.0)
        assert verdict(young, division, claim(), now, 300).bound == pytest.approx(SECOND_SHARE)
        paced = SECOND_SHARE * now.elapsed
        assert verdict(old, division, claim(), now, 300).bound == pytest.approx(paced)

    def test_its_tail_is_not_paced_in_the_periods_first_lead(self) -> None:
        """The tail of a burst across the edge, 10 ms into the second: 12 asked (1,200 a
        second) beside a history of 180 (its 0.15 s of the second before, predicted on by
        its rate: held). Against the part of the period gone without LEAD, and a hit more
        (2 x 180 x 0.01 + 1 = 4.6), it is bursting, unpaced; measured with LEAD (2 x 180 x
        0.04125 = 14.85) it was paced, its tail refused. A client of longer history asking
        so is paced."""
        now = Clock(1, 1.0, 135.01)
        tail = {"history": 180.0, "period_asked": 12.0, "asked": 12.0, "previous": 180.0}
        young = client(now=now, admitted=0.0, mass=ALPHA, previous_last=134.999, **tail)
        old = client(now=now, admitted=0.0, previous_last=134.999, **tail)
        division = others(fixed=43.0)
        assert verdict(young, division, claim(), now, 300).bound == pytest.approx(SECOND_SHARE)
        assert verdict(old, division, claim(), now, 300).bound < 10.0

    def test_at_a_longer_window_the_period_old_client_is_paced(self) -> None:
        """At a cap of a minute the same client is greedy, paced (``_arrived`` serves a
        burst there): its bound is below its share."""
        now = Clock(60, 1.0, 135.5)
        young = client(now=now, history=200.0, period_asked=220.0, asked=220.0, mass=ALPHA)
        assert verdict(young, others(), claim(), now, 300).bound < 180.0


class TestVerdictRounding:
    """At its last hits of a window a held client's share is rounded up to a whole hit,
    while the cap has that hit beside the open clients' requests still to come and the
    light reserve: whole requests never reach a fractional share."""

    def test_the_last_request_takes_the_share_rounded_up(self) -> None:
        """At 135.95 (0.05 s left: half a request to come at 10 a period) 185 admitted of
        185.67 may take the 186th."""
        now = Clock(1, 1.0, 135.95)
        v = verdict(in_second(now, 185.0), others(fixed=43.0), claim(), now, 300)
        assert v.share == pytest.approx(SECOND_SHARE)
        assert v.bound == 186.0

    def test_the_request_before_it_takes_the_hit_below(self) -> None:
        """At 135.8 (2 requests to come, this one included) the bound is 186 - 1: its last
        request takes the 186th."""
        now = Clock(1, 1.0, 135.8)
        v = verdict(in_second(now, 184.0), others(fixed=43.0), claim(), now, 300)
        assert v.bound == 185.0

    def test_earlier_in_the_window_the_pace_holds(self) -> None:
        """At 135.5 (5 requests to come) it keeps back what its history predicts it will
        ask later, as before: 185.67 - 10 x 0.5."""
        now = Clock(1, 1.0, 135.5)
        v = verdict(in_second(now, 90.0), others(fixed=43.0), claim(), now, 300)
        assert v.bound == pytest.approx(SECOND_SHARE - 5.0)

    def test_not_past_what_the_cap_has_left(self) -> None:
        """The cap at 600 of 600: nothing to round up with (the pace keeps back the half
        request its history predicts)."""
        now = Clock(1, 1.0, 135.95)
        v = verdict(in_second(now, 185.0), others(fixed=43.0), claim(), now, 600)
        assert v.bound == pytest.approx(SECOND_SHARE - 0.5)


class TestVerdictArrived:
    """At a cap whose window is longer than a period (LONG: a minute, 15 s gone), a client
    held at 180 (asked 60: want 61 + 60 / 15 x 45 = 241), history 10 a period: its history
    paces it to 180 x φ = 45.09, unless it arrived during the window (it first asked there
    after more of it had gone than it has asked since): its history is then a burst's."""

    def test_arrived_it_keeps_back_only_for_the_declared_still_to_come(self) -> None:
        """First asked at 129 (9 s gone, 6 s since). Four clients declared and four in the
        division: nobody is still to come, so it is not paced: 180. Six declared: the two to
        come, held beside it and the others' weight 2, would take 180 x 2 / 5 = 72 of its
        share: bound 108."""
        row = client(history=10.0, asked=60.0, admitted=30.0, first=129.0)
        assert verdict(row, others(), claim(), LONG, 200).bound == 180.0
        six = ShareClaim(1, INF, 1.0, 600.0, 6, False)
        assert verdict(row, others(), six, LONG, 200).bound == pytest.approx(108.0)

    def test_there_since_the_window_began_it_is_paced_by_its_history(self) -> None:
        """First asked at 121 (1 s gone, 14 s since), or at 127.5 (7.5 s each side: not
        arrived), went quiet perhaps and is back: paced to 180 x φ."""
        for first in (121.0, 127.5):
            row = client(history=10.0, asked=60.0, admitted=30.0, first=first)
            assert verdict(row, others(), claim(), LONG, 200).bound == pytest.approx(180 * PHI)

    def test_one_period_old_from_the_window_before_it_has_arrived(self) -> None:
        """Its one period of history (mass ALPHA) the last of the minute before (it asked
        400 there, the last at 119.9), asking here since the window's start: a burst across
        the edge, not paced: 180. The same client new in this window (not in the one
        before), or of a longer history, is paced to 180 x φ."""
        edge = {"first": 120.0, "previous_last": 119.9}
        burst = client(history=10.0, asked=60.0, admitted=30.0, mass=ALPHA, previous=400.0,
                       **edge)  # fmt: skip
        assert verdict(burst, others(), claim(), LONG, 200).bound == 180.0
        for mass, previous in ((ALPHA, -1.0), (1.0, 400.0)):
            row = client(history=10.0, asked=60.0, admitted=30.0, mass=mass, previous=previous,
                         **edge)  # fmt: skip
            v = verdict(row, others(), claim(), LONG, 200)
            assert (v.kind, v.bound) == (HELD, pytest.approx(180 * PHI))

    def test_arrived_it_leaves_the_open_clients_requests_still_to_come(self) -> None:
        """Arrived, with 590 of the cap's 600 admitted already (the others took more than
        the division gives them while they were open): the 10 left hold the open clients'
        18 requests to come, so its bound is 30 + 10 - 18 = 22, under what it holds (with
        500 admitted: 30 + 100 - 18 = 112)."""
        row = client(history=10.0, asked=60.0, admitted=30.0, first=129.0)
        assert verdict(row, others(), claim(), LONG, 590).bound == 22.0
        assert verdict(row, others(), claim(), LONG, 500).bound == 112.0

    def test_at_a_cap_of_one_period_its_history_paces_it(self) -> None:
        """A window of one period: the history is of windows before, so it paces as ever.
        At 7.5 of [7, 8), room 600 beside held weight 2; 150 asked this second since 7.3
        (want 151 + 150 x 0.5 = 226), history 800 a period: held at 200, greedy, paced to
        200 x 0.53125 = 106.25 (as a client that arrived during a longer window it would
        take its 200)."""
        now = Clock(1, 1.0, 7.5)
        division = Division(FORCES * now.epoch, now.now, 100.0, 4)
        division.held = 2.0
        row = client(history=800.0, asked=150.0, admitted=50.0, now=now, period_asked=150.0,
                     first=7.3)  # fmt: skip
        v = verdict(row, division, claim(), now, 200)
        assert (v.kind, v.share) == (HELD, 200.0)
        assert v.bound == pytest.approx(106.25)


class TestVerdictOpen:
    """A client wanting no more than the level with it counted: open."""

    def test_an_open_client_may_take_up_to_the_level_with_it_met(self) -> None:
        """Asked 15 by 135.0 (1 a period): want 15 + 1 + 45 = 61; 61 x 3 <= 540, so open,
        and the others held share 540 - 61 = 479: the level is 239.5, its bound."""
        v = verdict(client(asked=15.0, admitted=15.0), others(), claim(), LONG, 200)
        assert (v.kind, v.share, v.bound) == (OPEN, 239.5, 239.5)

    def test_uncontended_the_limit_is_the_bound(self) -> None:
        """Nobody held and its want fits: the client's limit, or no bound at all."""
        row = client(asked=15.0, admitted=15.0, limit=100.0)
        v = verdict(row, others(held=0), claim(limit=100.0), LONG, 200)
        assert (v.kind, v.share, v.bound) == (OPEN, 100.0, 100.0)
        assert verdict(client(asked=15.0), others(held=0), claim(), LONG, 200).bound == INF

    def test_the_limit_bounds_an_open_share(self) -> None:
        """A limit of 100 over its want of 61, under the level of 239.5: 100."""
        row = client(asked=15.0, admitted=15.0, limit=100.0)
        assert verdict(row, others(), claim(limit=100.0), LONG, 200).bound == 100.0

    def test_a_client_whose_limit_takes_all_the_cap_has_left_is_paced(self) -> None:
        """Nobody held, 550 asked by the open ones: room 50. A limit of 50 under its want of
        61: it wants 50, all the room, so it is paced by its history as a held client (a
        newcomer still finds the cap open): 50 x φ; 10 hits from 5 admitted may end at 15,
        past the pace; sized, not paced. With room 51 its limit leaves a hit: 50 at once.
        It is counted as held (issue 40): open at its limit it would leave a newcomer's
        insertion no room."""
        full = others(held=0.0, fixed=550.0, rate=0.0)
        row = client(asked=15.0, admitted=15.0, limit=50.0)
        v = verdict(row, full, claim(limit=50.0), LONG, 200)
        assert (v.kind, v.share, v.bound) == pytest.approx((HELD, 50.0, 50 * PHI))
        row.admitted = 5.0
        assert verdict(row, full, claim(10, limit=50.0), LONG, 200).bound == 15.0
        assert verdict(row, full, claim(limit=50.0, sized=True), LONG, 200).bound == 50.0
        roomy = others(held=0.0, fixed=549.0, rate=0.0)
        assert verdict(row, roomy, claim(limit=50.0), LONG, 200).bound == 50.0


class TestWorkConservation:
    def test_a_lone_client_asking_the_whole_cap_once_a_window_is_served(self) -> None:
        """A cap of 5 a second (2 clients declared: not sized), one client of limit 5 asking
        5 hits at 0.1 s into each second, decided as a store does (a division at each new
        period, fold, leave, verdict, record, charge, enter). Alone, it asks the cap and no
        more: max-min gives it all 5, so the cap admits it from its second window on (the
        first is the cold rule's: nobody has history yet). Asking 4 it is."""
        for hits, limit in ((4, 5.0), (5, 5.0)):
            row, admitted = Row(limit, 1.0), []
            for second in range(6):
                clock = Clock(1, 1.0, second + 0.1)
                division = divide([("a", row)], 5.0, clock)
                fold(row, clock, division.closing)
                leave(division, row, "a", 1, 1.0)
                v = verdict(row, division, ShareClaim(hits, limit, 1.0, 5.0, 2, False), clock, 0)
                admitted.append(row.admitted + hits <= v.bound + EPSILON)
                record(row, hits, clock.now)
                if admitted[-1]:
                    charge(row, hits)
                enter(division, row, v.kind, clock)
            assert admitted == [False, True, True, True, True, True], hits


class TestVerdictCold:
    """While no row has history, a client takes at most its equal split among the clients
    declared or seen, or the capacity elapsed beside what the others took; held clients
    are all paced."""

    def test_a_held_client_is_paced_without_history(self) -> None:
        """No history, held at 180: paced to 180 x φ = 45.09 (where others' history would
        let it take 180 at once); its split 600 / max(4, 4 + 1) = 120 is above that."""
        v = verdict(client(history=0.0), others(cold=1), claim(), LONG, 200)
        assert v.bound == pytest.approx(45.09375)

    def test_an_open_client_takes_its_split_or_the_capacity_elapsed(self) -> None:
        """Open at 239.5: nothing admitted by anyone, 600 x φ = 150.3125 elapsed; with 100
        admitted by the others, 600 x φ - 100 = 50.3 is under the split 120: 120."""
        row = client(history=0.0, asked=15.0, admitted=0.0)
        assert verdict(row, others(cold=1), claim(), LONG, 0).bound == pytest.approx(150.3125)
        assert verdict(row, others(cold=1), claim(), LONG, 100).bound == 120.0

    def test_the_split_is_among_the_clients_declared_or_seen(self) -> None:
        """8 rows seen over 4 declared: 600 / (8 + 1) each (the rows and this client), with
        the others at 100 of the 150.3 elapsed."""
        row = client(history=0.0, asked=15.0, admitted=0.0)
        division = others(cold=1)
        division.rows = 8
        assert verdict(row, division, claim(), LONG, 100).bound == pytest.approx(600 / 9)

    def test_a_sized_claim_is_not_held_to_the_cold_rule(self) -> None:
        """Sized: the open share 239.5, the held one 180, as when warm."""
        opened = client(history=0.0, asked=15.0, admitted=0.0)
        assert verdict(opened, others(cold=1), claim(sized=True), LONG, 100).bound == 239.5
        held = client(history=0.0)
        assert verdict(held, others(cold=1), claim(sized=True), LONG, 100).bound == 180.0


@st.composite
def insertions(draw: st.DrawFn) -> tuple[list[tuple[int, float, int]], int, int, float, int, int]:
    """The other clients, then the asker's asked, hits, limit and weight, and a capacity."""
    rest = draw(clients(min_size=0))
    asked, hits = draw(st.integers(0, 60)), draw(st.integers(1, 30))
    limit = draw(st.integers(1, 200).map(float) | st.just(INF))
    return rest, asked, hits, limit, draw(st.integers(1, 5)), draw(st.integers(1, 500))


class TestVerdictExact:
    """When the division is exact (made with the asker counted), the asker's share is the
    water-filling insertion of its want: λ·w with λ the exact level over every want."""

    @staticmethod
    def insert(
        rest: list[tuple[int, float, int]], mine: tuple[int, float, int], hits: int, capacity: int
    ) -> tuple[float, int]:
        rows = [(str(i), halfway(a, lim, w)) for i, (a, lim, w) in enumerate(rest)]
        asker = halfway(*mine)
        rows.append(("me", asker))
        division = divide(rows, float(capacity), HALF, asker="me", extra=hits, forced=1)
        leave(division, asker, "me", W, P)
        shared = ShareClaim(hits, mine[1], mine[2], float(capacity), 4, False)
        v = verdict(asker, division, shared, HALF, 0)
        return v.share, v.kind

    def test_open(self) -> None:
        """Wants 6, 20, 40 (weights 1, 1, 2) and d's 11 at weight 1 over 50: λ = 11, d open
        at exactly λ, its share the level with it met: 11."""
        assert level([6, 20, 40, 11], [1, 1, 2, 1], 50) == 11
        share, kind = self.insert([(3, INF, 1), (10, INF, 1), (20, INF, 2)], (5, INF, 1), 1, 50)
        assert (kind, share) == pytest.approx((OPEN, 11.0))

    def test_open_at_a_weight_of_two(self) -> None:
        """The same d at weight 2: λ = 11 still (maxmin.level), d open under 2λ, share 22."""
        assert level([6, 20, 40, 11], [1, 1, 2, 2], 50) == 11
        share, kind = self.insert([(3, INF, 1), (10, INF, 1), (20, INF, 2)], (5, INF, 2), 1, 50)
        assert (kind, share) == pytest.approx((OPEN, 22.0))

    def test_held_past_the_level(self) -> None:
        """d asked 20 and asks 5 (want 20 + 5 + 20 = 45) beside wants 6 and 20 over 50: λ =
        24 (maxmin.level: 6 and 20 met, 24 left), d held at 24."""
        lam = level([6, 20, 45], [1, 1, 1], 50)
        assert lam == 24
        share, kind = self.insert([(3, INF, 1), (10, INF, 1)], (20, INF, 1), 5, 50)
        assert (kind, share) == pytest.approx((HELD, 24.0))

    @given(insertions())
    def test_the_share_is_the_exact_insertion(
        self, case: tuple[list[tuple[int, float, int]], int, int, float, int, int]
    ) -> None:
        """For any others and asker: share = min(L, λ·w), λ = maxmin.level over the others'
        wants and the asker's (asked + hits + asked, within L); open when its want is at
        most λ·w, held when more, and held too when its want is its own limit and leaves
        less than a hit of room (paced and counted as a held client, issue 40)."""
        rest, asked, hits, limit, weight, capacity = case
        mine = 2 * asked + hits if limit == INF else min(2 * asked + hits, limit)
        wants = [*halfway_wants(rest), Fraction(mine)]
        weights = [w for _, _, w in rest] + [weight]
        exact = level(wants, weights, capacity)
        share, kind = self.insert(rest, (asked, limit, weight), hits, capacity)
        assert share == pytest.approx(float(min(limit, exact * weight)), rel=1e-9)
        if mine > exact * weight or (mine < exact * weight and mine != limit):
            assert kind == (OPEN if mine < exact * weight else HELD)


class TestVerdictBounds:
    @given(played(), st.integers(1, 12), st.booleans())
    def test_open_clients_get_their_want_and_held_ones_no_more_than_their_share(
        self, case: tuple[dict[str, Row], Clock, float], hits: int, sized: bool
    ) -> None:
        """For any rows, every client and a newcomer asking ``hits``, as a store decides it
        (fold, leave, verdict): an open client's bound admits asked + hits (but where the
        cold rule holds it, or its want is its own limit and takes all the room left: both
        pace it); a held client's share is at most room·w / (held + w) and its bound at most
        that share and its credit, rounded up to a whole hit (``_paced``, at its last
        requests of the window)."""
        rows, clock, capacity = case
        division = divide(rows.items(), capacity, clock)
        total = sum(r.admitted for r in rows.values() if r.window == clock.start)
        for client_, original in [*rows.items(), ("new", Row(50.0, 1.0))]:
            row, d = copy.copy(original), copy.copy(division)
            fold(row, clock, d.closing)
            leave(d, row, client_, clock.window, clock.period_len)
            shared = ShareClaim(hits, row.limit, row.weight, capacity, 4, sized)
            v = verdict(row, d, shared, clock, total)
            coming = math.floor(d.rate * clock.left + EPSILON)
            room = max(0.0, capacity - d.fixed - coming)
            demand = row.asked + hits + predicted(row, clock) * clock.left
            by_limit = demand >= row.limit and room - row.limit < 1
            if v.kind == OPEN and (sized or not (d.cold or by_limit)):
                assert v.bound >= min(row.limit, row.asked + hits) - 1e-6
            if v.kind == HELD:
                assert v.share - row.credit <= room * row.weight / (d.held + row.weight) + 1e-9
                assert v.bound <= math.ceil(v.share - EPSILON) + 1e-9


def opened(fixed: float, top: float, forced: int = 0, asks: int = 0) -> Division:
    """A division at LONG with nobody held: the open ones asked ``fixed`` and ask nothing
    more (rate 0), the largest of their wants ``top``; 16 rows."""
    division = Division(FORCES * LONG.epoch + forced, LONG.now, INF, 16)
    division.fixed, division.top, division.forced, division.asks = fixed, top, forced, asks
    return division


def newcomer(weight: float = 1.0) -> Row:
    row = Row(INF, weight)
    fold(row, LONG, INF)
    return row


def asking(hits: int, weight: float = 1.0) -> ShareClaim:
    return ShareClaim(hits, INF, weight, 100.0, 4, False)


class TestContended:
    """A request finds the cap newly contended when nobody is held, its want passes the room
    the open ones leave, and holding it at that room would not be exact (an open one must be
    held too): the division is then remade with it counted."""

    def test_a_want_that_fits_is_not_contended(self) -> None:
        """Open wants 20 and 40 of 100, a newcomer asking 40: it fits."""
        assert not contended(opened(60.0, 40.0), newcomer(), asking(40), LONG)

    def test_held_at_the_room_left_when_that_is_exact(self) -> None:
        """Open wants 20 and 40, a newcomer asking 41: held at the room of 40, which is the
        exact level of 20, 40, 41 over 100 (maxmin.level): not contended."""
        assert level([20, 40, 41], [1, 1, 1], 100) == 40
        assert not contended(opened(60.0, 40.0), newcomer(), asking(41), LONG)

    def test_contended_when_an_open_want_passes_the_room(self) -> None:
        """Open wants 15 and 45, a newcomer asking 41: the exact level is 44 (maxmin.level),
        so the 45 must be held and the newcomer is open: remade."""
        assert level([15, 45, 41], [1, 1, 1], 100) == 44
        assert contended(opened(60.0, 45.0), newcomer(), asking(41), LONG)

    def test_contended_when_an_open_want_passes_its_weighted_level(self) -> None:
        """An open want of 30 at weight 1, a newcomer of weight 3 asking 200: the room is 70,
        but the exact level is 25 (maxmin.level), under which the 30 must be held (the
        newcomer's share is 75, not the room): remade."""
        assert level([30, 200], [1, 3], 100) == 25
        assert contended(opened(30.0, 30.0), newcomer(3.0), asking(200, 3.0), LONG)

    def test_never_while_somebody_is_held(self) -> None:
        """Somebody held: the division counts the contention already."""
        division = opened(60.0, 45.0)
        division.held = 2.0
        assert not contended(division, newcomer(), asking(41), LONG)

    def test_a_remade_division_is_remade_again_only_after_hits_enough(self) -> None:
        """Remade once for a request: again only after 16 rows / AMORTISE = 2 hits asked
        since, and never past FORCES - 1 remakes in a sub-period."""
        assert not contended(opened(60.0, 45.0, forced=1, asks=1), newcomer(), asking(41), LONG)
        assert contended(opened(60.0, 45.0, forced=1, asks=2), newcomer(), asking(41), LONG)
        last = opened(60.0, 45.0, forced=FORCES - 1, asks=100)
        assert not contended(last, newcomer(), asking(41), LONG)


class TestStaleDivision:
    """A division is remade at each new period, at a new sub-period once requests enough
    asked since (rows / AMORTISE hits), never within its own sub-period."""

    @staticmethod
    def made(at_: float, rows: int, asks: int, forced: int = 0) -> Division:
        clock = Clock(60, 1.0, at_)
        division = Division(FORCES * clock.epoch + forced, at_, 1.0, rows)
        division.asks, division.forced = asks, forced
        return division

    def test_none_is_stale(self) -> None:
        assert stale_division(None, LONG)

    def test_a_division_holds_through_its_sub_period(self) -> None:
        """Made at 135.0 (sub-period 540), at 135.2 (540.8 -> 540) even 100 hits asked since
        change nothing."""
        assert SPLIT == 4
        assert not stale_division(self.made(135.0, 16, 100), Clock(60, 1.0, 135.2))

    def test_a_new_period_remakes_it(self) -> None:
        """At 136.0 it is remade, nothing asked since or not."""
        assert stale_division(self.made(135.0, 16, 0), Clock(60, 1.0, 136.0))

    def test_a_new_sub_period_remakes_it_after_rows_over_amortise_hits(self) -> None:
        """16 rows: at 135.3 (sub-period 541) 1 hit asked since is under 16 / AMORTISE = 2,
        2 are enough; a division of no rows is remade at once."""
        assert AMORTISE == 8
        later = Clock(60, 1.0, 135.3)
        assert not stale_division(self.made(135.0, 16, 1), later)
        assert stale_division(self.made(135.0, 16, 2), later)
        assert stale_division(self.made(135.0, 0, 0), later)

    def test_a_forced_division_is_of_the_sub_period_it_was_forced_in(self) -> None:
        """Forced twice at 135.1 (epoch FORCES x 540 + 2): it holds at 135.2, and at 135.3 is
        remade as any other once asked enough."""
        forced = self.made(135.1, 16, 0, forced=2)
        assert forced.epoch == FORCES * 540 + 2
        assert not stale_division(forced, Clock(60, 1.0, 135.2))
        forced.asks = 2
        assert stale_division(forced, Clock(60, 1.0, 135.3))


class TestCounts:
    def test_demand_and_admissions_add_up(self) -> None:
        """3 asked and admitted, then 4 asked and refused: 7 asked this window and period,
        3 admitted, last asked at 2.5."""
        row = ask(row_of((1.0, 3)), 2.5, 4, admitted=False)
        assert (row.asked, row.period_asked, row.admitted, row.period_admitted) == (7, 4, 3, 0)
        assert row.seen == 2.5


class TestLastPeriod:
    """The period before's demand and admissions, for the fairness figures."""

    def test_only_clients_that_asked_last_period_count(self) -> None:
        """At 5.2 (period 5): a row of period 4 that asked 7 (3 admitted), one folded into
        period 5 after asking 2 in period 4, count; one last seen in period 3 does not."""
        rows = [
            ask(row_of((4.1, 3), limit=30, weight=2), 4.6, 4, admitted=False),
            ask(row_of((4.5, 2)), 5.1, 1),
            row_of((3.5, 9)),
        ]
        found = last_period(rows, 600.0, at(5.2))
        assert found is not None
        assert (found.capacity, found.scale) == (600.0, 10.0)
        assert (list(found.demands), list(found.admitted)) == ([7.0, 2.0], [3.0, 2.0])
        assert (list(found.limits), list(found.weights)) == ([30.0, INF], [2.0, 1.0])

    def test_nobody_asked_last_period(self) -> None:
        assert last_period([row_of((3.5, 9))], 600.0, at(5.2)) is None


class TestWhatADivisionReads:
    """A division (``divide``, ``last_period``) reads only the row attributes of
    DIVIDED_BY: rows with the others as a new row has them divide alike (the Redis store
    reads no more of each row for a division: store/redis/division_rows.py)."""

    def test_rows_with_only_the_attributes_it_reads_divide_alike(self) -> None:
        r = random.Random(41)
        for _ in range(400):
            window = r.choice([1, 10])
            clock = at(r.uniform(100.0, 130.0), window=window)
            rows = [(f"c{i}", self._row(r, clock)) for i in range(r.randint(1, 8))]
            kept = [(client, self._only_read(row)) for client, row in rows]
            capacity = r.choice([1.0, 5.0, 20.0, 1000.0])
            asker, extra = r.choice([("", 0.0), ("c0", 1.0), ("c9", 2.0)])
            made = [divide(these, capacity, clock, asker, extra) for these in (rows, kept)]
            assert state(made[0]) == state(made[1])
            last = [last_period([row for _, row in these], capacity, clock)
                    for these in (rows, kept)]  # fmt: skip
            assert last[0] == last[1]

    @staticmethod
    def _row(r: random.Random, clock: Clock) -> Row:
        """Every attribute drawn, around ``clock``'s window and period."""
        row = Row(r.choice([2.0, 10.0, INF]), r.choice([1.0, 2.0]))
        for name in Row.__slots__:
            if name in ("limit", "weight"):
                continue
            if name == "window":
                value: float = r.choice([clock.start, clock.start - clock.window, -1])
            elif name in ("period", "epoch", "page"):
                value = r.choice([clock.period, clock.period - 1, clock.period - 5, -1])
            elif name == "kind":
                value = r.choice([NONE, OPEN, HELD])
            elif name in ("seen", "previous_last", "first"):
                value = clock.now - r.uniform(0.0, 2.5 * clock.window)
            elif name == "gap":
                value = r.choice([0.0, 1.0, 2.0])
            elif name == "previous":
                value = r.choice([-1.0, 0.0, float(r.randint(1, 12))])
            else:
                value = r.choice([0.0, r.uniform(0.0, 12.0)])
            setattr(row, name, value)
        return row

    @staticmethod
    def _only_read(row: Row) -> Row:
        kept = Row(row.limit, row.weight)
        for name in DIVIDED_BY:
            setattr(kept, name, getattr(row, name))
        return kept
