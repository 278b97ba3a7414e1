"""How the operator views write a limit (core/describe.py): every limit of a rule, with its
window, algorithm, burst and calendar zone; a plain limit as upstream writes it."""

import json
from pathlib import Path

import pytest

from fairlimit.core.describe import (
    debug_text,
    duration_text,
    has_plain_limits,
    limit_fields,
    limit_words,
    limits_words,
    words,
)
from fairlimit.core.rules import Rule
from helpers import load_text
from limit_configs import FOUR_LIMITS

pytestmark = pytest.mark.unit

# A burst per second, a sliding 5 minutes, a gcra with a burst, a calendar month in a zone.
FOUR = (
    """
domain: api
descriptors:
  - key: user
"""
    + FOUR_LIMITS
    + """  - key: plain
    rate_limit: {unit: hour, requests_per_unit: 7}
  - key: five_minutes
    rate_limit: {unit: minute, multiplier: 5, requests_per_unit: 50}
  - key: open
    rate_limit: {unlimited: true}
"""
)


def _rules(tmp_path: Path) -> dict[str, Rule]:
    domain = load_text(tmp_path, FOUR).config.domains["api"]
    return {rule.key: rule for rule in domain.rules}


class TestEveryLimit:
    def test_fields_name_window_algorithm_burst_and_zone(self, tmp_path: Path) -> None:
        user = _rules(tmp_path)["user"]
        assert [limit_fields(limit) for limit in user.limits] == [
            {"unit": "second", "requests_per_unit": 20, "window_seconds": 1,
             "algorithm": "fixed"},
            {"unit": "minute", "requests_per_unit": 3000, "window_seconds": 300,
             "algorithm": "sliding"},
            {"unit": "minute", "requests_per_unit": 600, "window_seconds": 60,
             "algorithm": "gcra", "burst": 30},
            {"unit": "month", "requests_per_unit": 1000000, "window_seconds": 2592000,
             "algorithm": "fixed", "calendar": "Europe/Berlin"},
        ]  # fmt: skip

    def test_words(self, tmp_path: Path) -> None:
        user = _rules(tmp_path)["user"]
        assert [limit_words(limit) for limit in user.limits] == [
            "20 per second",
            "3000 per 5m, sliding",
            "600 per minute, gcra, burst 30",
            "1000000 per calendar month in Europe/Berlin",
        ]
        assert limits_words(user) == "; ".join(limit_words(limit) for limit in user.limits)

    def test_words_read_the_fields_as_json_carries_them(self, tmp_path: Path) -> None:
        """``fairlimit top`` writes what ``GET /top`` sent: the same words."""
        for limit in _rules(tmp_path)["user"].limits:
            assert words(json.loads(json.dumps(limit_fields(limit)))) == limit_words(limit)

    def test_upstreams_debug_line_then_what_it_cannot_say(self, tmp_path: Path) -> None:
        user = _rules(tmp_path)["user"]
        assert [debug_text(limit) for limit in user.limits] == [
            "unit=SECOND requests_per_unit=20",
            "unit=MINUTE requests_per_unit=3000 window=5m algorithm=sliding",
            "unit=MINUTE requests_per_unit=600 algorithm=gcra burst=30",
            "unit=MONTH requests_per_unit=1000000 calendar=Europe/Berlin",
        ]


class TestPlain:
    def test_one_fixed_unit_window_is_written_as_upstream(self, tmp_path: Path) -> None:
        rules = _rules(tmp_path)
        assert has_plain_limits(rules["plain"]) and has_plain_limits(rules["open"])
        assert debug_text(rules["plain"].limits[0]) == "unit=HOUR requests_per_unit=7"
        assert limit_fields(rules["plain"].limits[0]) == {
            "unit": "hour", "requests_per_unit": 7, "window_seconds": 3600, "algorithm": "fixed"
        }  # fmt: skip
        assert (debug_text(rules["open"].limits[0]), limits_words(rules["open"])) == (
            "unlimited", "unlimited")  # fmt: skip
        assert limit_fields(rules["open"].limits[0]) == {"unlimited": True}

    def test_several_limits_or_a_multiplied_window_are_not(self, tmp_path: Path) -> None:
        rules = _rules(tmp_path)
        assert not has_plain_limits(rules["user"])
        assert not has_plain_limits(rules["five_minutes"])
        assert debug_text(rules["five_minutes"].limits[0]) == (
            "unit=MINUTE requests_per_unit=50 window=5m"
        )
        assert limit_words(rules["five_minutes"].limits[0]) == "50 per 5m"

    @pytest.mark.parametrize(
        ("seconds", "text"),
        [(1, "1s"), (90, "90s"), (300, "5m"), (7200, "2h"), (5400, "90m"), (604800, "7d")],
    )
    def test_a_window_is_written_as_the_duration_key_takes_it(
        self, seconds: int, text: str
    ) -> None:
        assert duration_text(seconds) == text
