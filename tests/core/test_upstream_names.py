"""envoyproxy/ratelimit's stat keys and labels (core/upstream.py), level by level."""

from pathlib import Path

import pytest

from fairlimit.core.matching import Matcher
from fairlimit.core.upstream import labels, override_key, sanitize, stat_key
from helpers import load_text

pytestmark = pytest.mark.unit

TREE = """
domain: d
descriptors:
  - key: k
    value: v
    descriptors:
      - key: sub
        rate_limit: {unit: minute, requests_per_unit: 1}
  - key: route
    value: "api/*"
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: plan
    value: gold
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"""


def _stat_key(tmp_path: Path, *entries: tuple[str, str]) -> str:
    found = Matcher(load_text(tmp_path, TREE).config).match("d", entries)
    assert found is not None
    return stat_key("d", entries, found.trail)


class TestStatKeyLevels:
    def test_an_exact_level_is_its_key_and_value(self, tmp_path: Path) -> None:
        """k=v then a value-less sub: ``d.k_v.sub``."""
        assert _stat_key(tmp_path, ("k", "v"), ("sub", "x")) == "d.k_v.sub"

    def test_a_wildcard_level_without_value_to_metric_is_its_pattern(self, tmp_path: Path) -> None:
        """The request's value stays out of the key: every api/* route counts as one."""
        assert _stat_key(tmp_path, ("route", "api/v2")) == "d.route_api/*"

    def test_value_to_metric_on_an_exact_level_changes_nothing(self, tmp_path: Path) -> None:
        """An exact level's value is the request's value."""
        assert _stat_key(tmp_path, ("plan", "gold")) == "d.plan_gold"


class TestOverrideKey:
    def test_a_request_limit_is_named_by_the_request_path(self) -> None:
        """Every entry as key_value, sanitised like any stat key."""
        assert override_key("d", [("k", "v"), ("ip", "10.1.2.3")]) == "d.k_v.ip_10_1_2_3"

    def test_an_empty_value_is_the_key_alone(self) -> None:
        assert override_key("d", [("k", "")]) == "d.k"


class TestSanitize:
    def test_colons_and_pipes_become_underscores(self) -> None:
        """Upstream's statsd clean-up: ':' and '|' are field separators there."""
        assert sanitize("d.k_a:b|c") == "d.k_a_b_c"


class TestLabels:
    def test_three_levels_have_a_key2(self) -> None:
        """domain, key1 and key2 for a key of three parts."""
        assert labels("d.k_v.sub") == {"domain": "d", "key1": "k_v", "key2": "sub"}

    def test_a_domain_alone_has_an_empty_key1(self) -> None:
        assert labels("d") == {"domain": "d", "key1": ""}
