"""Admission semantics of docs/semantics.md, on every backend with an injected clock."""

import pytest

from fairlimit.core.admission import UNLIMITED_REMAINING, Code
from fairlimit.core.rules import RateLimit
from fairlimit.core.units import Unit
from fairlimit.errors import RequestError
from helpers import FakeClock, LimiterFactory, desc, req

CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: route
    value: slow
    rate_limit: {unit: minute, requests_per_unit: 2, name: route-slow}
  - key: route
    value: fast
    rate_limit: {unit: second, requests_per_unit: 100, replaces: [{name: route-slow}]}
  - key: health
    rate_limit: {unlimited: true}
  - key: audit
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
"""

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]


class TestFixedWindows:
    async def test_exactly_the_limit_passes_per_window(self, make_limiter: LimiterFactory) -> None:
        """N hits pass in a window, the next is over, nothing more passes until it ends."""
        limiter = make_limiter(CONFIG)
        codes = [
            (await limiter.should_rate_limit(req("edge", desc("client_id=a")))).code
            for _ in range(5)
        ]
        assert codes == [Code.OK] * 3 + [Code.OVER_LIMIT] * 2

    async def test_windows_are_aligned_to_the_epoch(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A minute window resets on the minute boundary, not a minute after first use."""
        clock.t = 60 * 28_333_334 + 59.5  # 59.5 s into a minute-aligned window
        limiter = make_limiter(CONFIG)
        for _ in range(2):
            assert (
                await limiter.should_rate_limit(req("edge", desc("route=slow")))
            ).code is Code.OK
        over = await limiter.should_rate_limit(req("edge", desc("route=slow")))
        assert over.code is Code.OVER_LIMIT
        assert over.statuses[0].duration_until_reset == 1  # 0.5 s, in whole seconds rounded up
        clock.advance(0.5)
        assert (await limiter.should_rate_limit(req("edge", desc("route=slow")))).code is Code.OK

    async def test_statuses_fill_envoy_headers(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """current_limit, limit_remaining and duration_until_reset describe the window."""
        clock.t = 1_700_000_000.25
        limiter = make_limiter(CONFIG)
        status = (await limiter.should_rate_limit(req("edge", desc("client_id=a")))).statuses[0]
        assert status.current_limit == RateLimit(3, Unit.SECOND)
        assert status.limit_remaining == 2
        assert status.duration_until_reset == 1  # 0.75 s, in whole seconds rounded up

    async def test_clients_have_separate_buckets(self, make_limiter: LimiterFactory) -> None:
        """A value-less key keeps one bucket per distinct value."""
        limiter = make_limiter(CONFIG)
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("client_id=a")))
        assert (await limiter.should_rate_limit(req("edge", desc("client_id=b")))).code is Code.OK


class TestHits:
    async def test_request_hits_addend_charges_that_many(
        self, make_limiter: LimiterFactory
    ) -> None:
        """Request-level hits_addend charges every descriptor that many hits."""
        limiter = make_limiter(CONFIG)
        first = await limiter.should_rate_limit(req("edge", desc("client_id=a"), hits=2))
        assert first.statuses[0].limit_remaining == 1
        assert (
            await limiter.should_rate_limit(req("edge", desc("client_id=a"), hits=2))
        ).code is Code.OVER_LIMIT

    async def test_descriptor_hits_addend_wins(self, make_limiter: LimiterFactory) -> None:
        """A per-descriptor hits_addend overrides the request-level one."""
        limiter = make_limiter(CONFIG)
        out = await limiter.should_rate_limit(req("edge", desc("client_id=a", hits=3), hits=1))
        assert out.statuses[0].limit_remaining == 0

    async def test_zero_hits_checks_without_consuming(self, make_limiter: LimiterFactory) -> None:
        """hits_addend 0 reports the bucket and charges nothing."""
        limiter = make_limiter(CONFIG)
        for _ in range(3):
            out = await limiter.should_rate_limit(req("edge", desc("client_id=a", hits=0)))
            assert out.code is Code.OK and out.statuses[0].limit_remaining == 3
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("client_id=a")))
        assert (
            await limiter.should_rate_limit(req("edge", desc("client_id=a", hits=0)))
        ).code is Code.OVER_LIMIT


class TestAllOrNothing:
    async def test_a_rejected_request_consumes_nothing(self, make_limiter: LimiterFactory) -> None:
        """When one descriptor is over, no other descriptor's counter moves (I3)."""
        limiter = make_limiter(CONFIG)
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("client_id=a")))
        for _ in range(5):
            out = await limiter.should_rate_limit(
                req("edge", desc("client_id=a"), desc("client_id=b"))
            )
            assert out.code is Code.OVER_LIMIT
            assert [s.code for s in out.statuses] == [Code.OVER_LIMIT, Code.OK]
            assert out.statuses[1].limit_remaining == 3
        alone = await limiter.should_rate_limit(req("edge", desc("client_id=b")))
        assert alone.statuses[0].limit_remaining == 2

    async def test_repeated_descriptor_is_charged_once_per_occurrence(
        self, make_limiter: LimiterFactory
    ) -> None:
        """Two descriptors on one counter are checked together: 2 + 2 hits exceed 3."""
        limiter = make_limiter(CONFIG)
        out = await limiter.should_rate_limit(
            req("edge", desc("client_id=a"), desc("client_id=a"), hits=2)
        )
        assert out.code is Code.OVER_LIMIT
        after = await limiter.should_rate_limit(req("edge", desc("client_id=a"), hits=3))
        assert after.code is Code.OK


class TestRuleKinds:
    async def test_unlimited_is_never_counted(self, make_limiter: LimiterFactory) -> None:
        """unlimited: OK, remaining 4294967295, no current_limit, no reset (as upstream)."""
        limiter = make_limiter(CONFIG)
        for _ in range(10):
            out = await limiter.should_rate_limit(req("edge", desc("health=x")))
        status = out.statuses[0]
        assert (
            out.code,
            status.limit_remaining,
            status.current_limit,
            status.duration_until_reset,
        ) == (Code.OK, UNLIMITED_REMAINING, None, 0)

    async def test_shadow_rules_never_reject_and_are_counted(
        self, make_limiter: LimiterFactory
    ) -> None:
        """A shadow-mode rule answers OK over its limit and says it was over (I7)."""
        limiter = make_limiter(CONFIG)
        first = await limiter.should_rate_limit(req("edge", desc("audit=a")))
        assert first.code is Code.OK and not first.statuses[0].shadowed
        second = await limiter.should_rate_limit(req("edge", desc("audit=a")))
        assert second.code is Code.OK and second.statuses[0].shadowed

    async def test_replaces_drops_the_named_limit(self, make_limiter: LimiterFactory) -> None:
        """A limit that replaces 'route-slow' removes it from the same request."""
        limiter = make_limiter(CONFIG)
        for _ in range(5):
            out = await limiter.should_rate_limit(
                req("edge", desc("route=slow"), desc("route=fast"))
            )
            assert out.code is Code.OK
            assert out.statuses[0].current_limit is None
        assert (await limiter.should_rate_limit(req("edge", desc("route=slow")))).statuses[
            0
        ].limit_remaining == 1

    async def test_request_override_is_honoured(self, make_limiter: LimiterFactory) -> None:
        """A descriptor's own limit replaces the configured one."""
        limiter = make_limiter(CONFIG)
        override = RateLimit(1, Unit.MINUTE)
        first = await limiter.should_rate_limit(req("edge", desc("client_id=a", limit=override)))
        assert first.statuses[0].current_limit == override
        again = await limiter.should_rate_limit(req("edge", desc("client_id=a", limit=override)))
        assert again.code is Code.OVER_LIMIT

    async def test_the_tighter_of_two_limits_on_one_key_holds(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """Two descriptors of one key, limits 10 and 1 a minute (an override beside
        another, or beside the rule's 3 a second's key when the units agree): one counter,
        refused past the tighter; each status names its own limit and reports what the
        counter has left under the tighter (in degraded mode the counter holds this
        process's part of it, tests/policy/test_degraded.py).
        Found by fuzzing accepted configs (issue 41): the counter kept the first limit, so
        the 1 a minute admitted 5 requests of 2 hits, and said 8 left of 1."""
        clock.t = 1_700_000_040.0  # a minute boundary
        limiter = make_limiter(CONFIG)
        loose, tight = RateLimit(10, Unit.MINUTE), RateLimit(1, Unit.MINUTE)
        both = req("edge", desc("client_id=a", limit=loose), desc("client_id=a", limit=tight))
        out = await limiter.should_rate_limit(both)
        assert out.code is Code.OVER_LIMIT
        assert [(s.code, s.current_limit, s.limit_remaining) for s in out.statuses] == [
            (Code.OVER_LIMIT, loose, 1), (Code.OVER_LIMIT, tight, 1)  # nothing charged
        ]
        alone = await limiter.should_rate_limit(req("edge", desc("client_id=a", limit=tight)))
        assert (alone.code, alone.statuses[0].limit_remaining) == (Code.OK, 0)
        rule = RateLimit(1, Unit.SECOND)  # the rule's key: client_id=a per second
        out = await limiter.should_rate_limit(
            req("edge", desc("client_id=b"), desc("client_id=b", limit=rule))
        )
        assert [s.code for s in out.statuses] == [Code.OVER_LIMIT, Code.OVER_LIMIT]
        assert [s.current_limit for s in out.statuses][1] == rule

    @pytest.mark.parametrize("shadow_first", [True, False])
    async def test_a_shadow_rule_beside_an_override_on_one_key(
        self, make_limiter: LimiterFactory, clock: FakeClock, shadow_first: bool
    ) -> None:
        """A shadow-mode rule (10 a second) and an override of its key (4 a second, the same
        unit: one counter): the override is enforced whichever descriptor comes first, and
        the shadow rule's status says OK over it. Found by fuzzing accepted configs (issue
        41): the counter took the first descriptor's shadow mode, so after the shadow rule
        the override admitted every request, and before it the shadow rule's status said
        OVER_LIMIT."""
        clock.t = 1_700_000_040.0
        limiter = make_limiter(
            "domain: edge\ndescriptors:\n  - key: audit\n    shadow_mode: true\n"
            "    rate_limit: {unit: second, requests_per_unit: 10}\n"
        )
        override = RateLimit(4, Unit.SECOND)
        pair = [desc("audit=x"), desc("audit=x", limit=override)]
        if not shadow_first:
            pair.reverse()
        codes = []
        for _ in range(3):  # 2 hits on the counter each
            out = await limiter.should_rate_limit(req("edge", *pair))
            codes.append((out.code, [s.code for s in out.statuses]))
        over = [Code.OK, Code.OVER_LIMIT] if shadow_first else [Code.OVER_LIMIT, Code.OK]
        assert codes == [(Code.OK, [Code.OK] * 2)] * 2 + [(Code.OVER_LIMIT, over)]

    async def test_unknown_domain_and_unmatched_descriptor_are_ok(
        self, make_limiter: LimiterFactory
    ) -> None:
        """No rule applies: OK with no limit, 0 remaining and no reset (as upstream)."""
        limiter = make_limiter(CONFIG)
        for request in (req("other", desc("client_id=a")), req("edge", desc("nope=1"))):
            out = await limiter.should_rate_limit(request)
            status = out.statuses[0]
            assert out.code is Code.OK
            assert (
                status.code,
                status.current_limit,
                status.limit_remaining,
                status.duration_until_reset,
            ) == (Code.OK, None, 0, 0)

    async def test_global_shadow_forces_ok_and_keeps_the_truth(
        self, make_limiter: LimiterFactory
    ) -> None:
        """--shadow answers OK overall while statuses still say OVER_LIMIT."""
        limiter = make_limiter(CONFIG, shadow=True)
        for _ in range(4):
            out = await limiter.should_rate_limit(req("edge", desc("client_id=a")))
        assert out.code is Code.OK and out.statuses[0].code is Code.OVER_LIMIT


class TestBadRequests:
    @pytest.mark.parametrize(
        "request_",
        [
            req("", desc("client_id=a")),
            req("edge"),
            req("edge", desc()),
            req("edge", *[desc("client_id=a")] * 65),
            req("edge", desc(*[f"k{i}=v" for i in range(17)])),
            req("edge", desc("client_id=" + "x" * 1025)),
            req("edge", desc("=value")),
            req("edge", desc("client_id=a", hits=2**40)),
        ],
        ids=[
            "empty-domain",
            "no-descriptors",
            "no-entries",
            "too-many-descriptors",
            "too-deep",
            "huge-value",
            "empty-key",
            "huge-hits",
        ],
    )
    async def test_malformed_requests_are_invalid_argument(
        self, make_limiter: LimiterFactory, request_: object
    ) -> None:
        """Requests no Envoy would send are refused with RequestError before any counter."""
        limiter = make_limiter(CONFIG)
        with pytest.raises(RequestError):
            await limiter.should_rate_limit(request_)  # type: ignore[arg-type]
