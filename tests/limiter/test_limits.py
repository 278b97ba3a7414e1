"""Several limits per rule, any interval, calendar windows, sliding and GCRA, on every
backend (memory, Redis, Redis Cluster), on the injected clock."""

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairlimit.config.loader import parse_domain
from fairlimit.core.admission import Status
from fairlimit.core.rules import Config, Loaded
from fairlimit.limiter import Decision, Limiter
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, desc, req

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

MINUTE_START = 1_700_000_040.0  # a whole minute (and 1_700_000_000 is 200 s into 5 minutes)

BURST_AND_MINUTE = """
domain: d
descriptors:
  - key: user
    rate_limits:
      - {unit: second, requests_per_unit: 3}
      - {unit: minute, requests_per_unit: 5}
"""


async def ask(limiter: Limiter, *entries: str, hits: int = 0) -> Decision:
    return await limiter.should_rate_limit(req("d", desc(*entries), hits=hits))


def shown(status: Status) -> tuple[object, ...]:
    limit = status.current_limit
    assert limit is not None
    return (status.code.name, status.limit_remaining, status.duration_until_reset,
            limit.requests_per_unit, limit.unit.name)  # fmt: skip


async def codes(limiter: Limiter, clock: FakeClock, n: int, step: float, *entries: str) -> str:
    """n requests ``step`` seconds apart: "+" admitted, "-" refused."""
    out = ""
    for _ in range(n):
        out += "+" if (await ask(limiter, *entries)).code.name == "OK" else "-"
        clock.advance(step)
    return out


class TestSeveralLimits:
    async def test_a_refusal_by_one_limit_charges_none_of_the_others(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """3/s and 5/min: the 4th and 5th of one second are refused by the second's limit and
        leave the minute's count alone, so two more pass the next second (5 in the minute)."""
        clock.t = MINUTE_START
        limiter = make_limiter(BURST_AND_MINUTE)
        assert await codes(limiter, clock, 5, 0.1, "user=a") == "+++--"
        clock.t = MINUTE_START + 1
        assert await codes(limiter, clock, 3, 0.1, "user=a") == "++-"
        clock.t = MINUTE_START + 61
        assert await codes(limiter, clock, 1, 0.1, "user=a") == "+"

    async def test_the_status_reports_the_tightest_limit(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """The limit with least remaining is the one reported, with its reset."""
        clock.t = MINUTE_START
        limiter = make_limiter(BURST_AND_MINUTE)
        first = (await ask(limiter, "user=a")).statuses[0]
        assert shown(first) == ("OK", 2, 1, 3, "SECOND")  # 2 of 3 left this second, 4 of 5
        clock.t = MINUTE_START + 1
        for _ in range(3):
            last = (await ask(limiter, "user=a")).statuses[0]
        assert shown(last) == ("OK", 0, 1, 3, "SECOND")  # 0 of 3, 1 of 5
        clock.t = MINUTE_START + 2
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 0, 58, 5, "MINUTE")
        out = (await ask(limiter, "user=a")).statuses[0]
        assert shown(out) == ("OVER_LIMIT", 0, 58, 5, "MINUTE")

    async def test_limits_out_together_report_the_longest_reset(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """1/s and 1/min after one request: both have 0 left; the client waits for both."""
        clock.t = MINUTE_START + 20
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limits:
                  - {unit: second, requests_per_unit: 1}
                  - {unit: minute, requests_per_unit: 1}
            """
        )
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 0, 40, 1, "MINUTE")

    async def test_each_limit_keeps_its_name_for_replaces(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """A descriptor whose limit replaces one of another's limits by name: that one is not
        charged, the other limits of its node are."""
        clock.t = MINUTE_START
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limits:
                  - {unit: second, requests_per_unit: 1, name: burst}
                  - {unit: minute, requests_per_unit: 3}
              - key: vip
                rate_limit: {unit: second, requests_per_unit: 100, replaces: [{name: burst}]}
            """
        )
        both = req("d", desc("user=a"), desc("vip=yes"))
        got = [(await limiter.should_rate_limit(both)).code.name for _ in range(4)]
        assert got == ["OK", "OK", "OK", "OVER_LIMIT"]  # the minute's 3, not the second's 1


class TestWindows:
    async def test_a_multiple_of_a_unit_is_one_epoch_aligned_window(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """5 minutes: 200 s into a 300 s window, the reset is 100 s, whole minutes pass
        without a new window, and the next window starts at the 300 s boundary."""
        clock.t = 1_700_000_000.0
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {unit: minute, multiplier: 5, requests_per_unit: 2}
            """
        )
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 1, 100, 2, "MINUTE")
        clock.t += 60
        assert await codes(limiter, clock, 2, 1, "user=a") == "+-"
        clock.t = 1_700_000_100.0
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 1, 300, 2, "MINUTE")

    async def test_a_duration_is_its_seconds_and_reports_a_unit_within_it(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """duration 30s: windows of 30 s from the epoch, reported as SECOND, the longest unit
        that does not overstate the window (MINUTE made Envoy say w=60; issue 37)."""
        clock.t = MINUTE_START + 25.5
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {duration: 30s, requests_per_unit: 1}
            """
        )
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 0, 5, 1, "SECOND")
        assert (await ask(limiter, "user=a")).code.name == "OVER_LIMIT"
        clock.t = MINUTE_START + 30
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 0, 30, 1, "SECOND")

    async def test_a_calendar_month_in_utc_ends_at_the_first_of_the_next(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """2023-11-30 23:59:50 UTC: 10 s to December; the count starts again then."""
        clock.t = 1_701_388_790.0  # 2023-11-30T23:59:50Z
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {unit: month, requests_per_unit: 1, calendar: UTC}
            """
        )
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 0, 10, 1, "MONTH")
        assert (await ask(limiter, "user=a")).code.name == "OVER_LIMIT"
        clock.t = 1_701_388_800.0  # 2023-12-01T00:00:00Z
        december = (await ask(limiter, "user=a")).statuses[0]
        assert shown(december) == ("OK", 0, 31 * 86400, 1, "MONTH")

    async def test_a_calendar_week_in_a_zone_follows_its_clock_change(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """Berlin's week of 2024-03-25 (Monday, CET) ends Monday 2024-04-01 00:00 CEST: the
        clocks moved on an hour on the Sunday, so it is an hour short of 7 days."""
        clock.t = 1_711_321_200.0  # 2024-03-25T00:00:00+01:00
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {unit: week, requests_per_unit: 1, calendar: Europe/Berlin}
            """
        )
        week = (await ask(limiter, "user=a")).statuses[0]
        assert shown(week) == ("OK", 0, 7 * 86400 - 3600, 1, "WEEK")
        clock.t = 1_711_922_399.0  # a second before 2024-04-01T00:00:00+02:00
        assert (await ask(limiter, "user=a")).code.name == "OVER_LIMIT"
        clock.t += 1
        assert (await ask(limiter, "user=a")).code.name == "OK"

    async def test_a_refusal_elsewhere_at_the_stroke_of_midnight_takes_nothing_of_the_day(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """At exactly Berlin's midnight a request whose other descriptor is refused leaves
        the new day's count alone (on Redis the day's charge is undone in its own slot
        group: the undo must find the window that starts at that instant)."""
        clock.t = 1_711_321_200.0  # 2024-03-25T00:00:00+01:00
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {unit: day, requests_per_unit: 2, calendar: Europe/Berlin}
              - key: shut
                rate_limit: {unit: second, requests_per_unit: 0}
            """
        )
        both = req("d", desc("user=a"), desc("shut=x"))
        assert (await limiter.should_rate_limit(both)).code.name == "OVER_LIMIT"
        assert [(await ask(limiter, "user=a")).code.name for _ in range(3)] == [
            "OK", "OK", "OVER_LIMIT",
        ]  # fmt: skip

    async def test_a_plain_month_keeps_upstreams_30_day_epoch_windows(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """Without calendar, unit month is 30 days from the epoch, as upstream counts it."""
        clock.t = 1_701_388_790.0
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {unit: month, requests_per_unit: 1}
            """
        )
        month = 30 * 86400
        left = month - int(clock.t) % month
        assert shown((await ask(limiter, "user=a")).statuses[0]) == ("OK", 0, left, 1, "MONTH")


class TestSmooth:
    async def test_gcra_admits_its_burst_then_one_hit_per_interval(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """6/min with burst 2: 3 at once, then one every 10 s; the reset is when the bucket
        is full again."""
        clock.t = MINUTE_START
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {unit: minute, requests_per_unit: 6, algorithm: gcra, burst: 2}
            """
        )
        assert await codes(limiter, clock, 4, 0, "user=a") == "+++-"
        over = (await ask(limiter, "user=a")).statuses[0]
        assert shown(over) == ("OVER_LIMIT", 0, 30, 6, "MINUTE")
        clock.t = MINUTE_START + 9.9
        assert await codes(limiter, clock, 1, 0, "user=a") == "-"
        clock.t = MINUTE_START + 10
        assert await codes(limiter, clock, 2, 0, "user=a") == "+-"
        clock.t = MINUTE_START + 40
        assert await codes(limiter, clock, 4, 0, "user=a") == "+++-"

    async def test_gcra_reset_is_the_true_time_rounded_up(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """1 per 10 s taken 0.5 s into a second: the refusal says 10 s (the bucket is full
        10 s on, not 11), and a call 10 s later is admitted (issue 37)."""
        clock.t = MINUTE_START + 0.5
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {duration: 10s, requests_per_unit: 1, algorithm: gcra}
            """
        )
        assert await codes(limiter, clock, 1, 0, "user=a") == "+"
        over = (await ask(limiter, "user=a")).statuses[0]
        assert (over.code.name, over.duration_until_reset) == ("OVER_LIMIT", 10)
        clock.t = MINUTE_START + 6.2  # 4.3 s left: 5
        assert (await ask(limiter, "user=a")).statuses[0].duration_until_reset == 5
        clock.t = MINUTE_START + 10.5
        assert await codes(limiter, clock, 1, 0, "user=a") == "+"

    async def test_sliding_reset_is_the_true_time_rounded_up(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """1 per 10 s sliding (0.5 s sub-windows), taken at 0.2 s: it leaves the count at
        10.5 s, so a refusal at 0.7 s says 10 s (not 11) and one at 10.5 s is admitted."""
        clock.t = MINUTE_START + 0.2
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: user
                rate_limit: {duration: 10s, requests_per_unit: 1, algorithm: sliding}
            """
        )
        assert await codes(limiter, clock, 1, 0, "user=a") == "+"
        clock.t = MINUTE_START + 0.7
        over = (await ask(limiter, "user=a")).statuses[0]
        assert (over.code.name, over.duration_until_reset) == ("OVER_LIMIT", 10)
        clock.t = MINUTE_START + 10.5
        assert await codes(limiter, clock, 1, 0, "user=a") == "+"

    async def test_sliding_refuses_a_second_limit_across_the_window_edge(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """10/min, 10 sent in the last seconds of a minute: fixed admits 10 more just after
        the edge, sliding none until the first have slid out of the last minute."""
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: fixed
                rate_limit: {unit: minute, requests_per_unit: 10}
              - key: sliding
                rate_limit: {unit: minute, requests_per_unit: 10, algorithm: sliding}
            """
        )
        for key in ("fixed", "sliding"):
            clock.t = MINUTE_START + 55
            assert await codes(limiter, clock, 10, 0.4, f"{key}=a") == "+" * 10
        got = {}
        for key in ("fixed", "sliding"):
            clock.t = MINUTE_START + 61
            got[key] = await codes(limiter, clock, 10, 0.1, f"{key}=a")
        assert got == {"fixed": "+" * 10, "sliding": "-" * 10}
        # counted in 3 s sub-windows: the last of them (at 58.6 s, in 57-60 s) a minute on
        clock.t = MINUTE_START + 119.9
        assert await codes(limiter, clock, 1, 0, "sliding=a") == "+"  # those of 54-57 s out
        clock.t = MINUTE_START + 120
        assert await codes(limiter, clock, 10, 0, "sliding=a") == "+" * 9 + "-"

    async def test_hits_in_the_oldest_sub_window_still_count(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """10/min sliding, counted in 3 s sub-windows: 10 admitted at 1 s are still counted
        at 62.9 s, in the 21st sub-window from theirs, the oldest the count covers (a
        minute and a little more); at 63 s they are out, and 10 more are admitted."""
        limiter = make_limiter(
            """
            domain: d
            descriptors:
              - key: sliding
                rate_limit: {unit: minute, requests_per_unit: 10, algorithm: sliding}
            """
        )
        clock.t = MINUTE_START + 1
        assert await codes(limiter, clock, 10, 0, "sliding=a") == "+" * 10
        clock.t = MINUTE_START + 60
        assert await codes(limiter, clock, 1, 0, "sliding=a") == "-"
        clock.t = MINUTE_START + 62.9
        assert await codes(limiter, clock, 1, 0, "sliding=a") == "-"
        clock.t = MINUTE_START + 63
        assert await codes(limiter, clock, 11, 0, "sliding=a") == "+" * 10 + "-"


# --- the bound: no span of one window admits more than limit + burst --------------------

GRID = 0.01  # the clock moves on this grid (a span's ends are then exact)


@st.composite
def smooth_cases(draw: st.DrawFn) -> tuple[str, int, int, int, list[tuple[int, int]]]:
    """(algorithm, limit, burst, window, [(ticks, hits)]): random traffic, bursts included."""
    algorithm = draw(st.sampled_from(["sliding", "gcra"]))
    limit = draw(st.integers(1, 15))
    burst = draw(st.integers(0, 5)) if algorithm == "gcra" else 0
    window = draw(st.sampled_from([1, 2, 5]))
    step = st.tuples(st.one_of(st.just(0), st.integers(0, 30), st.integers(0, 300)),
                     st.integers(1, 3))  # fmt: skip
    floor = draw(st.sampled_from([5, 60, 150]))
    return algorithm, limit, burst, window, draw(st.lists(step, min_size=floor, max_size=250))


def most_in_a_window(admitted: list[tuple[int, int]], window_ticks: int) -> int:
    """The most hits admitted in any half-open span of ``window_ticks`` (exact: the
    heaviest span starts at an admission)."""
    most = 0
    for i, (start, _) in enumerate(admitted):
        most = max(most, sum(h for t, h in admitted[i:] if t < start + window_ticks))
    return most


class TestTheBound:
    @settings(max_examples=min(60, settings.default.max_examples), deadline=None)
    @given(case=smooth_cases())
    async def test_no_span_of_a_window_admits_more_than_limit_and_burst(
        self, case: tuple[str, int, int, int, list[tuple[int, int]]]
    ) -> None:
        """Sliding and GCRA under random traffic on the memory store (the backends give the
        same answers: test_backend_parity), checked against an exact count of every span
        (fixed fails it: twice its limit across a window's edge)."""
        algorithm, limit, burst, window, steps = case
        extra = f", burst: {burst}" if algorithm == "gcra" else ""
        yaml = (
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {duration: "
            f"{window}s, requests_per_unit: {limit}, algorithm: {algorithm}{extra}}}\n"
        )
        clock = FakeClock(1_700_000_000.0)
        limiter = Limiter(Loaded(Config.of([parse_domain(yaml, "t.yaml")]), (), ()),
                          MemoryStore(), clock)  # fmt: skip
        admitted: list[tuple[int, int]] = []
        ticks = 0
        for dt, hits in steps:
            ticks += dt
            clock.t = 1_700_000_000.0 + ticks * GRID
            if (await ask(limiter, "user=a", hits=hits)).code.name == "OK":
                admitted.append((ticks, hits))
        assert most_in_a_window(admitted, round(window / GRID)) <= limit + burst


# --- fair sharing over each limit of a cap ----------------------------------------------

SHARED = """
domain: d
descriptors:
  - key: tenant
    rate_limits: [%s]
    fair_share: {active_clients: 2}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 100}
"""


async def shared_traffic(limiter: Limiter, clock: FakeClock, start: float, tenant: str
                         ) -> list[tuple[str, bool, float]]:  # fmt: skip
    """400 requests, user a twice as often as b, 0 to 0.3 s apart (seeded): (who, ok, t)."""
    rnd = random.Random(7)
    clock.t = start
    out = []
    for _ in range(400):
        who = rnd.choice("aab")
        decision = await ask(limiter, f"tenant={tenant}", f"user={who}")
        out.append((who, decision.code.name == "OK", clock.t - start))
        clock.advance(rnd.choice([0, 0.05, 0.3]))
    return out


class TestSharingEachLimit:
    @pytest.mark.parametrize(
        "loose, alone",
        [
            ("{unit: second, requests_per_unit: 100}", "{unit: minute, requests_per_unit: 10}"),
            ("{unit: minute, requests_per_unit: 1000}", "{unit: second, requests_per_unit: 3}"),
        ],
    )
    async def test_a_cap_shares_each_limit_as_it_would_alone(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock, loose: str, alone: str
    ) -> None:
        """A cap with a limit that never binds beside one that does answers every request as
        the cap with that one alone: the binding limit is shared fairly in its own window."""
        both = await shared_traffic(make_limiter(SHARED % f"{loose}, {alone}"), clock,
                                    MINUTE_START, "one")  # fmt: skip
        single = await shared_traffic(make_limiter(SHARED % alone), clock,
                                      MINUTE_START + 3600, "two")  # fmt: skip
        assert both == single
        assert 0 < sum(ok for _, ok, _ in both) < len(both)

    async def test_a_burst_and_a_minute_limit_are_both_kept_and_shared(
        self, make_limiter: Callable[..., Limiter], clock: FakeClock
    ) -> None:
        """3/s and 20/min at one cap, a sending twice as often as b: no second admits more
        than 3, the minute no more than 20, and a and b get the same."""
        limiter = make_limiter(SHARED % "{unit: second, requests_per_unit: 3}, "
                                         "{unit: minute, requests_per_unit: 20}")  # fmt: skip
        got = await shared_traffic(limiter, clock, MINUTE_START, "one")
        admitted = [(who, t) for who, ok, t in got if ok and t < 60]
        per_second = [sum(1 for _, t in admitted if s <= t < s + 1) for s in range(60)]
        assert max(per_second) <= 3 and len(admitted) <= 20
        a = sum(1 for who, _ in admitted if who == "a")
        assert abs(a - (len(admitted) - a)) <= 1 and len(admitted) >= 10
