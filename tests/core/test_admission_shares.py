"""Admission at fair-share caps (core/admission), on plans of nested caps: a claim's bound
and what a status promises agree, and a refused request is demand only at the caps whose
levels below it admitted it (what store/memory.py records, and lua/admit/decide.lua mirrors)."""

import math
from pathlib import Path

import pytest

from fairlimit.core.admission import Code, Outcome, Status, admits, demand_seen, statuses
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan, plan
from fairlimit.core.rules import RateLimit
from fairlimit.core.units import Unit
from fairness_cases import NESTED, flat_config  # NESTED: route 1000/s > tenant 600/s > user 200/s
from helpers import desc, load_text, req

pytestmark = pytest.mark.unit

USER, ROUTE_TOTAL, TENANT_TOTAL = 0, 1, 2  # Plan.counters: the user's own limit, the caps
AT_ROUTE, AT_TENANT = 0, 1  # Plan.shares: tenant t at the route cap, user u at the tenant cap


def _plan(tmp_path: Path, hits: int) -> Plan:
    """``hits`` of user u of tenant t: its own limit, then the route and the tenant caps."""
    matcher = Matcher(load_text(tmp_path, NESTED).config)
    built = plan(req("fair", desc("route=api", "tenant=t", "user=u", hits=hits)), matcher)
    assert [c.key for c in built.counters] == [
        "fair/route=api/tenant=t/user=u#1",
        "fair/route=api#1",
        "fair/route=api/tenant=t#1",
    ]
    assert [(s.cap, s.client) for s in built.shares] == [
        ("fair/route=api#1", "t"),
        ("fair/route=api/tenant=t#1", "u"),
    ]
    return built


# A client's own limit per minute (600/min, 10/s) under a per-second cap.
PER_MINUTE_CLIENTS = flat_config(100, "second", 600, client_unit="minute")
# The other way round: a client's own limit per second (10/s) under a per-minute cap.
PER_SECOND_CLIENTS = flat_config(6000, "minute", 10, client_unit="second")


@pytest.fixture
def nested(tmp_path: Path) -> Plan:
    return _plan(tmp_path, 1)


def _seen(
    built: Plan,
    counts: dict[int, int] | None = None,
    shared: dict[int, int] | None = None,
    bounds: dict[int, float] | None = None,
) -> list[bool]:
    """demand_seen with every counter and claim at 0 and every bound infinite but those given."""
    c, s, b = counts or {}, shared or {}, bounds or {}
    return demand_seen(
        built,
        [c.get(i, 0) for i in range(len(built.counters))],
        [s.get(i, 0) for i in range(len(built.shares))],
        [b.get(i, math.inf) for i in range(len(built.shares))],
    )


class TestBoundTolerance:
    @pytest.mark.parametrize(
        ("bound", "room"), [(5.0, 1), (5 - 1e-9, 1), (5 - 1e-12, 1), (5.5, 1), (4.999, 0), (4.5, 0)]
    )
    def test_a_check_reports_the_room_the_next_hit_gets(
        self, tmp_path: Path, nested: Plan, bound: float, room: int
    ) -> None:
        """u has 4 hits at the tenant cap. A bound of 5 less at most the tolerance (1e-9,
        itself included) is 5: a check (0 hits) reports 1 remaining and OK, and the next
        hit is admitted; under that it is 4: 0 remaining, OVER_LIMIT, the hit refused.
        The room is floor(bound + 1e-9) - 4, by hand."""
        counts, shared, bounds = (0, 0, 0), (0, 4), (math.inf, bound)
        check = _plan(tmp_path, 0)
        status = statuses(
            check, Outcome(admits(check, counts, shared, bounds), counts, shared, bounds), 0.0
        )[0]
        assert (status.code, status.limit_remaining) == (Code.OK if room else Code.OVER_LIMIT, room)
        assert admits(nested, counts, shared, bounds) is (room == 1)


def _status(
    built: Plan, counts: tuple[int, ...], shared: tuple[int, ...], bounds: tuple[float, ...]
) -> Status:
    """The first descriptor's status, admitted or not as admits decides."""
    outcome = Outcome(admits(built, counts, shared, bounds), counts, shared, bounds)
    return statuses(built, outcome, 0.0)[0]


class TestStatusAtCaps:
    @pytest.mark.parametrize("hits", [0, 1, 3])
    def test_an_admitted_hit_leaves_the_bound_less_what_it_used(
        self, tmp_path: Path, hits: int
    ) -> None:
        """u has 4 hits of a bound of 10 at the tenant cap (every other level far from
        full): a request of ``hits`` is admitted and leaves 10 - 4 - hits, by hand."""
        status = _status(_plan(tmp_path, hits), (0, 0, 0), (0, 4), (math.inf, 10.0))
        assert (status.code, status.limit_remaining) == (Code.OK, 10 - 4 - hits)

    def test_an_own_limit_used_up_is_the_remaining_though_the_caps_have_room(
        self, nested: Plan
    ) -> None:
        """u's hit takes its own 200th: 0 remaining, the minimum over the levels, though
        the route cap has 999 and the tenant cap 599 left."""
        status = _status(nested, (199, 0, 0), (0, 0), (math.inf, math.inf))
        assert (status.code, status.limit_remaining) == (Code.OK, 0)

    @pytest.mark.parametrize("share", [600.0, 600 - 1e-12])
    def test_a_share_equal_to_the_own_limit_reports_the_own_limit(
        self, tmp_path: Path, share: float
    ) -> None:
        """A fair share of 600 in a second, or a float's rounding of it, at a cap of
        1000/s is all a 600/min client may spend in one: the status reports 600 a minute."""
        config = flat_config(1000, "second", 600, client_unit="minute")
        matcher = Matcher(load_text(tmp_path, config).config)
        built = plan(req("fair", desc("route=api", "client_id=c", hits=0)), matcher)
        status = _status(built, (0, 0), (0,), (share,))
        assert status.current_limit == RateLimit(600, Unit.MINUTE)

    def test_a_share_below_a_longer_own_limit_reports_the_share(self, tmp_path: Path) -> None:
        """A fair share of 10 a second holds a 600/min client tighter in the cap's second
        (it may spend its 600 in one), though 10/s is its average rate: the status
        reports 10 a second (issue 37)."""
        matcher = Matcher(load_text(tmp_path, PER_MINUTE_CLIENTS).config)
        built = plan(req("fair", desc("route=api", "client_id=c", hits=0)), matcher)
        status = _status(built, (0, 0), (0,), (10.0,))
        assert status.current_limit is not None
        assert (status.current_limit.requests_per_unit, status.current_limit.unit) == (
            10,
            Unit.SECOND,
        )

    @pytest.mark.parametrize(
        ("config", "windows", "used", "shared", "remaining"),
        [
            (PER_MINUTE_CLIENTS, [60, 1], 590, 0, 10),
            (PER_MINUTE_CLIENTS, [60, 1], 600, 10, 0),
            (PER_SECOND_CLIENTS, [1, 60], 0, 0, 10),
            (PER_SECOND_CLIENTS, [1, 60], 10, 10, 0),
        ],
    )
    def test_levels_tied_on_the_remaining_report_the_later_reset(
        self,
        tmp_path: Path,
        config: str,
        windows: list[int],
        used: int,
        shared: int,
        remaining: int,
    ) -> None:
        """c's own limit and its share of 10 at the cap leave the same room, one level per
        second, the other per minute: the client waits for both, so the reset reported is
        the minute's (60 s at t = 0), whichever level comes first."""
        matcher = Matcher(load_text(tmp_path, config).config)
        built = plan(req("fair", desc("route=api", "client_id=c", hits=0)), matcher)
        assert [c.window for c in built.counters] == windows
        status = _status(built, (used, 0), (shared,), (10.0,))
        assert (status.limit_remaining, status.duration_until_reset) == (remaining, 60.0)


class TestDemandSeen:
    def test_a_request_every_level_admits_is_demand_at_every_cap(self, nested: Plan) -> None:
        assert _seen(nested) == [True, True]

    def test_a_client_over_its_own_limit_is_no_demand_at_any_cap(self, nested: Plan) -> None:
        """u has used its 200: the tenant cap, and so the route cap, never see the hit."""
        assert _seen(nested, counts={USER: 200}) == [False, False]

    def test_a_user_over_its_share_is_demand_at_its_cap_only(self, nested: Plan) -> None:
        """u is at its bound at the tenant cap: the tenant cap sees u's demand, but the
        route cap sees what the tenant level admits of it, which is nothing."""
        seen = _seen(nested, shared={AT_TENANT: 50}, bounds={AT_TENANT: 50.0})
        assert seen == [False, True]

    def test_a_full_nested_cap_is_no_demand_above_it(self, nested: Plan) -> None:
        """The tenant cap has used its 600: u's hit is demand there, not at the route."""
        assert _seen(nested, counts={TENANT_TOTAL: 600}) == [False, True]

    def test_a_request_refused_at_the_top_is_demand_at_every_cap(self, nested: Plan) -> None:
        """Refused by the outermost cap (full): every level below admitted it, so both
        caps see it as demand."""
        assert not admits(nested, (0, 1000, 0), (0, 0), (math.inf, math.inf))
        assert _seen(nested, counts={ROUTE_TOTAL: 1000}) == [True, True]
