"""The limit a status reports at a contended cap: the client's fair share when it is the
tighter of the two, else the client's own limit (Envoy's X-RateLimit-Limit)."""

import math

import pytest

from fairlimit.core.admission import _effective_limit
from fairlimit.core.plan import Charge
from fairlimit.core.rules import RateLimit
from fairlimit.core.units import Unit

pytestmark = pytest.mark.unit

LEAF = RateLimit(10, Unit.SECOND, name="per-client")  # the client's own limit: 10/s


def _at_cap(unit: Unit) -> Charge:
    """A claim at a cap whose window is ``unit``."""
    return Charge(counter=1, share=0, limit=RateLimit(6000, unit), rule=None, shadow=False)


class TestEffectiveLimit:
    def test_an_uncontended_cap_reports_the_clients_own_limit(self) -> None:
        """λ infinite: the client's own limit, as configured."""
        assert _effective_limit(LEAF, _at_cap(Unit.SECOND), math.inf) is LEAF

    def test_a_fair_share_above_the_own_limit_reports_the_own_limit(self) -> None:
        """A share of 25/s does not raise a 10/s client: its own limit, name and all."""
        assert _effective_limit(LEAF, _at_cap(Unit.SECOND), 25.0) is LEAF

    def test_a_share_equal_to_the_own_limit_reports_the_own_limit(self) -> None:
        """600 a minute is 10/s: the own limit (in its own unit), not the cap's unit."""
        assert _effective_limit(LEAF, _at_cap(Unit.MINUTE), 600.0) is LEAF

    def test_a_tighter_share_reports_the_share_in_the_caps_unit(self) -> None:
        """A fair share of 300 a minute (5/s) is the limit reported, per minute."""
        reported = _effective_limit(LEAF, _at_cap(Unit.MINUTE), 300.0)
        assert (reported.requests_per_unit, reported.unit) == (300, Unit.MINUTE)

    def test_a_share_per_long_window_is_compared_per_second(self) -> None:
        """Per second, not per window squared: 540 a minute (9/s) is below 10/s."""
        reported = _effective_limit(LEAF, _at_cap(Unit.MINUTE), 540.0)
        assert (reported.requests_per_unit, reported.unit) == (540, Unit.MINUTE)

    def test_a_share_below_a_longer_limit_reports_the_share(self) -> None:
        """1000 an hour may all be spent in one second: a share of 6 a second is the
        tighter in the cap's window, though above the hour's average 0.278/s (issue 37)."""
        hourly = RateLimit(1000, Unit.HOUR)
        reported = _effective_limit(hourly, _at_cap(Unit.SECOND), 6.0)
        assert (reported.requests_per_unit, reported.unit) == (6, Unit.SECOND)
        assert _effective_limit(hourly, _at_cap(Unit.SECOND), 1000.0) is hourly

    def test_the_reported_share_keeps_the_rules_name(self) -> None:
        """The share stands in for the named limit: its name goes with it."""
        assert _effective_limit(LEAF, _at_cap(Unit.SECOND), 4.0).name == "per-client"

    def test_a_fractional_share_is_reported_whole(self) -> None:
        """7.9999999999 (a float's rounding of 8) reports 8, 7.5 reports 7."""
        assert _effective_limit(LEAF, _at_cap(Unit.SECOND), 8 - 1e-12).requests_per_unit == 8
        assert _effective_limit(LEAF, _at_cap(Unit.SECOND), 7.5).requests_per_unit == 7

    def test_a_bound_below_zero_reports_none_left_not_a_negative_limit(self) -> None:
        """A held client's bound goes below zero once the reserve for light clients is
        held back from it (issue 40): the limit reported is 0 a second. It was -1, which
        no uint32 field takes: the server answered UNKNOWN, which Envoy lets through."""
        reported = _effective_limit(LEAF, _at_cap(Unit.SECOND), -1.0)
        assert (reported.requests_per_unit, reported.unit) == (0, Unit.SECOND)
        assert _effective_limit(LEAF, _at_cap(Unit.SECOND), -0.5).requests_per_unit == 0
