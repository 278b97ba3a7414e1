"""quota_group: the quota descriptors (quota_mode) of one group pass when any of them
passes, and every group must pass; quota descriptors without a group are one group, as
envoyproxy/ratelimit decides (docs/semantics.md, "Quota groups"). Every backend, an
injected clock; the config errors exactly."""

from pathlib import Path

import pytest

from fairlimit.admin import config_report
from fairlimit.errors import ConfigError
from helpers import LimiterFactory, desc, load_text, req

# A tenant's quota and the model's: each must pass. Two models' quotas in one group, where
# either will do (a request that names both can go to whichever has budget).
GROUPS = """
domain: ai
descriptors:
  - key: tenant
    quota_mode: true
    quota_group: tenant
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: model
    quota_mode: true
    quota_group: model
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: ungrouped
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
"""


async def _codes(limiter: object, *parts: object, n: int = 1) -> list[tuple[str, ...]]:
    out = []
    for _ in range(n):
        decision = await limiter.should_rate_limit(req("ai", *parts))  # type: ignore[attr-defined]
        out.append((decision.code.name, *(s.code.name for s in decision.statuses)))
    return out


@pytest.mark.behaviour
@pytest.mark.asyncio
class TestGroups:
    async def test_a_tenant_over_fails_the_request_though_the_model_has_room(
        self, make_limiter: LimiterFactory
    ) -> None:
        """The tenant's 2 are used, the model has 3 left: the third request is refused (in
        one implicit group, upstream's quota_mode let it through on the model's room)."""
        limiter = make_limiter(GROUPS)
        parts = (desc("tenant=t"), desc("model=m"))
        assert await _codes(limiter, *parts, n=3) == [
            ("OK", "OK", "OK"),
            ("OK", "OK", "OK"),
            ("OVER_LIMIT", "OVER_LIMIT", "OK"),
        ]

    async def test_in_a_group_any_member_passing_is_enough(
        self, make_limiter: LimiterFactory
    ) -> None:
        """Two models in the model group, the tenant's own group: m1 is used up by its 5,
        m2 still passes, so the request does, charging the tenant and m2 alone."""
        limiter = make_limiter(GROUPS.replace("requests_per_unit: 2}", "requests_per_unit: 9}"))
        await _codes(limiter, desc("model=m1"), n=5)
        both = (desc("tenant=t"), desc("model=m1"), desc("model=m2"))
        assert await _codes(limiter, *both) == [("OK", "OK", "OVER_LIMIT", "OK")]
        left = await limiter.should_rate_limit(req("ai", desc("tenant=t"), desc("model=m2")))
        assert [s.limit_remaining for s in left.statuses] == [7, 3]

    async def test_quotas_without_a_group_keep_upstreams_any_passes(
        self, make_limiter: LimiterFactory
    ) -> None:
        """The ungrouped quota over beside the grouped ones: it is a group of its own
        (the implicit one), so its refusal fails the request."""
        limiter = make_limiter(GROUPS)
        parts = (desc("ungrouped=u"), desc("model=m"))
        assert await _codes(limiter, *parts, n=2) == [
            ("OK", "OK", "OK"),
            ("OVER_LIMIT", "OVER_LIMIT", "OK"),
        ]


BAD = """
domain: ai
descriptors:
  - key: tenant
    quota_group: tenant
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: model
    quota_mode: true
    quota_group: ""
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: region
    quota_mode: true
    quota_group: [a, b]
    rate_limit: {unit: hour, requests_per_unit: 5}
"""


@pytest.mark.unit
class TestValidation:
    def test_a_group_needs_quota_mode_and_a_name(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError) as raised:
            load_text(tmp_path, BAD)
        source = tmp_path / "test.yaml"
        assert raised.value.problems == [
            f"{source}: ai/tenant: quota_group needs quota_mode: true on the same descriptor",
            f"{source}: ai/model: quota_group must be a non-empty string, not ''",
            f"{source}: ai/region: quota_group must be a non-empty string, not ['a', 'b']",
        ]

    def test_a_group_is_read_onto_the_rule_and_shown(self, tmp_path: Path) -> None:
        """On the rule, and in the admin's JSON view of the config (/rlconfig)."""
        loaded = load_text(tmp_path, GROUPS)
        rules = loaded.config.domains["ai"].rules
        assert [r.quota_group for r in rules] == ["tenant", "model", None]
        shown = config_report(loaded, ())["domains"][0]["descriptors"]
        assert [d.get("quota_group") for d in shown] == ["tenant", "model", None]
