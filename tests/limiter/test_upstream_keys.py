"""Each envoyproxy/ratelimit key with its meaning, through the limiter on every backend."""

from pathlib import Path

import pytest

from fairlimit.core.admission import Code
from fairlimit.limiter import Decision
from helpers import FakeClock, LimiterFactory, desc, req

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

KEYS = Path(__file__).parents[1] / "fixtures" / "upstream" / "keys"


def _config(name: str) -> str:
    return (KEYS / name).read_text()


def _codes(decision: Decision) -> list[Code]:
    return [s.code for s in decision.statuses]


class TestShareThreshold:
    async def test_every_matching_value_shares_one_counter(
        self, make_limiter: LimiterFactory
    ) -> None:
        """3 a minute under /static/*: the fourth path is over, whichever path it is."""
        limiter = make_limiter(_config("share_threshold.yaml"))
        for path in ("/static/a.css", "/static/b.js", "/static/c.png"):
            assert (await limiter.should_rate_limit(req("files", desc(f"path={path}")))).code \
                is Code.OK  # fmt: skip
        over = await limiter.should_rate_limit(req("files", desc("path=/static/d.svg")))
        assert over.code is Code.OVER_LIMIT

    async def test_without_it_each_value_has_its_own_counter(
        self, make_limiter: LimiterFactory
    ) -> None:
        limiter = make_limiter(_config("share_threshold.yaml"))
        for path in ("/img/a", "/img/b", "/img/c", "/img/d"):
            decision = await limiter.should_rate_limit(req("files", desc(f"path={path}")))
            assert decision.code is Code.OK

    async def test_the_shared_level_may_sit_above_the_limit(
        self, make_limiter: LimiterFactory
    ) -> None:
        """b-*-eu shares, op does not: two per op across every matching bucket."""
        limiter = make_limiter(_config("share_threshold.yaml"))
        for bucket in ("b-1-eu", "b-2-eu"):
            decision = await limiter.should_rate_limit(
                req("files", desc(f"bucket={bucket}", "op=get"))
            )
            assert decision.code is Code.OK
        third = await limiter.should_rate_limit(req("files", desc("bucket=b-3-eu", "op=get")))
        other_op = await limiter.should_rate_limit(req("files", desc("bucket=b-3-eu", "op=put")))
        assert (third.code, other_op.code) == (Code.OVER_LIMIT, Code.OK)

    async def test_a_request_value_spelling_the_pattern_has_its_own_counter(
        self, make_limiter: LimiterFactory
    ) -> None:
        """The literal value '/static/*' is one more value, not the shared counter."""
        limiter = make_limiter(_config("share_threshold.yaml"))
        for _ in range(3):
            await limiter.should_rate_limit(req("files", desc("path=/img/*")))
        shared = await limiter.should_rate_limit(req("files", desc("path=/static/x")))
        assert shared.statuses[0].limit_remaining == 2


class TestQuotaMode:
    async def test_one_quota_over_does_not_fail_the_request(
        self, make_limiter: LimiterFactory
    ) -> None:
        """daily (1) is spent, weekly (2) is not: OK, with daily still saying OVER_LIMIT."""
        limiter = make_limiter(_config("quota_mode.yaml"))
        both = (desc("quota=daily"), desc("quota=weekly"))
        first = await limiter.should_rate_limit(req("quotas", *both))
        second = await limiter.should_rate_limit(req("quotas", *both))
        assert (first.code, _codes(first)) == (Code.OK, [Code.OK, Code.OK])
        assert (second.code, _codes(second)) == (Code.OK, [Code.OVER_LIMIT, Code.OK])
        assert second.statuses[1].limit_remaining == 0  # the weekly quota was charged

    async def test_every_quota_over_fails_it_and_charges_nothing(
        self, make_limiter: LimiterFactory
    ) -> None:
        limiter = make_limiter(_config("quota_mode.yaml"))
        both = (desc("quota=daily"), desc("quota=weekly"), desc("api=x"))
        for _ in range(2):
            await limiter.should_rate_limit(req("quotas", *both))
        third = await limiter.should_rate_limit(req("quotas", *both))
        assert third.code is Code.OVER_LIMIT
        assert _codes(third) == [Code.OVER_LIMIT, Code.OVER_LIMIT, Code.OK]
        assert third.statuses[2].limit_remaining == 98  # a rejected request consumes nothing

    async def test_an_ordinary_descriptor_over_still_fails_the_request(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        limiter = make_limiter(
            _config("quota_mode.yaml")
            + "  - key: tight\n    rate_limit: {unit: hour, requests_per_unit: 0}\n"
        )
        decision = await limiter.should_rate_limit(req("quotas", desc("quota=weekly"),
                                                       desc("tight=x")))  # fmt: skip
        assert decision.code is Code.OVER_LIMIT

    async def test_global_quota_mode_makes_every_rule_a_quota(
        self, make_limiter: LimiterFactory
    ) -> None:
        """QUOTA_MODE: a request fails only when all its limited descriptors are over."""
        limiter = make_limiter(_config("modes.yaml"), quota_mode=True)
        decision = await limiter.should_rate_limit(req("modes", desc("closed=x"),
                                                       desc("user=u")))  # fmt: skip
        assert decision.code is Code.OK
        assert _codes(decision) == [Code.OVER_LIMIT, Code.OK]


class TestModes:
    async def test_replaces_drops_the_named_limit(self, make_limiter: LimiterFactory) -> None:
        """user (1/min) is replaced when vip matches in the same request."""
        limiter = make_limiter(_config("modes.yaml"))
        for _ in range(3):
            decision = await limiter.should_rate_limit(req("modes", desc("user=u"),
                                                           desc("vip=yes")))  # fmt: skip
            assert decision.code is Code.OK
        alone = await limiter.should_rate_limit(req("modes", desc("user=u")))
        assert alone.code is Code.OK  # never charged while replaced

    async def test_unlimited_and_shadow(self, make_limiter: LimiterFactory) -> None:
        limiter = make_limiter(_config("modes.yaml"))
        probe = await limiter.should_rate_limit(req("modes", desc("user_agent=probe")))
        assert (probe.code, probe.statuses[0].limit_remaining) == (Code.OK, 4294967295)
        for _ in range(3):
            shadowed = await limiter.should_rate_limit(req("modes", desc("experiment=e")))
            assert shadowed.code is Code.OK
        assert shadowed.statuses[0].shadowed

    async def test_values_match_as_written(self, make_limiter: LimiterFactory) -> None:
        """value: 010 matches the request value 010 (not 8); 1.50 matches 1.50."""
        limiter = make_limiter(_config("scalars.yaml"))
        for value in ("code=010", "version=1.50", "flag=true"):
            decision = await limiter.should_rate_limit(req("scalars", desc(value)))
            assert decision.statuses[0].current_limit is not None, value
        for value in ("code=8", "version=1.5", "flag=True"):
            decision = await limiter.should_rate_limit(req("scalars", desc(value)))
            assert decision.statuses[0].current_limit is None, value
