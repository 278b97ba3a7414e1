"""The ``reservation`` key of a descriptor node (token budgets): defaults and each
validation message, exactly as docs/configuration.md states them."""

from pathlib import Path

import pytest

from fairlimit.errors import ConfigError
from helpers import load_text

pytestmark = pytest.mark.unit


def _rule(block: str) -> str:
    return f"""
domain: edge
descriptors:
  - key: client_id
    rate_limit: {{unit: minute, requests_per_unit: 10}}
    reservation: {block}
"""


class TestConfig:
    def test_the_defaults(self, tmp_path: Path) -> None:
        (rule,) = load_text(tmp_path, _rule("{}")).config.domains["edge"].rules
        assert rule.reservation is not None
        assert (rule.reservation.default, rule.reservation.max_duration) == (None, 300.0)

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            (_rule("{default: 0}"),
             "reservation.default must be an integer from 1 to 4294967295, not 0"),
            (_rule("{default: 4294967296}"),
             "reservation.default must be an integer from 1 to 4294967295, not 4294967296"),
            (_rule("{max_duration: 0}"),
             "reservation.max_duration must be seconds in (0, 604800], not 0"),
            (_rule("{max_duration: 604801}"),
             "reservation.max_duration must be seconds in (0, 604800], not 604801"),
            (_rule("[1]"), "reservation must be a mapping"),
            (_rule("{}").replace("    rate_limit: {unit: minute, requests_per_unit: 10}\n", ""),
             "reservation needs a limited rate_limit on the same node: the budget"),
            (_rule("{}").replace("10}", "10}\n    concurrency: {max_in_flight: 2}"),
             "reservation and concurrency cannot share a node: both pair by request id (put "
             "them on two descriptors)"),
        ],
        ids=["default_0", "default_too_big", "no_time", "a_week_and_a_second", "not_a_mapping",
             "no_limit", "with_concurrency"],
    )  # fmt: skip
    def test_each_problem_is_named(self, tmp_path: Path, text: str, message: str) -> None:
        with pytest.raises(ConfigError) as caught:
            load_text(tmp_path, text)
        assert caught.value.problems == [f"{tmp_path / 'test.yaml'}: edge/client_id: {message}"]

    def test_not_on_a_cap(self, tmp_path: Path) -> None:
        text = """
domain: edge
descriptors:
  - key: route
    value: x
    rate_limit: {unit: minute, requests_per_unit: 10}
    fair_share: {active_clients: 1}
    reservation: {}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 10}
"""
        with pytest.raises(ConfigError) as caught:
            load_text(tmp_path, text)
        assert caught.value.problems == [
            f"{tmp_path / 'test.yaml'}: edge/route=x: reservation belongs on the per-client "
            "descriptors below a fair_share cap, not on the cap"
        ]

    @pytest.mark.parametrize(
        "limits",
        [
            "rate_limits: [{unit: minute, requests_per_unit: 100},"
            " {unit: day, requests_per_unit: 900}]",
            "rate_limit: {unit: minute, requests_per_unit: 100, algorithm: gcra}",
            "rate_limit: {unit: day, requests_per_unit: 100, calendar: UTC}",
        ],
        ids=["two_limits", "gcra", "calendar"],
    )
    def test_only_one_fixed_window_is_settled(self, tmp_path: Path, limits: str) -> None:
        """A settlement moves one fixed-window counter: several limits, sliding, gcra and
        calendar windows are refused beside a reservation, naming the rule."""
        text = f"domain: edge\ndescriptors:\n  - key: client_id\n    {limits}\n"
        with pytest.raises(ConfigError) as caught:
            load_text(tmp_path, text + "    reservation: {}\n")
        assert caught.value.problems == [
            f"{tmp_path / 'test.yaml'}: edge/client_id: reservation settles one fixed-window "
            "rate_limit: not rate_limits, sliding, gcra or calendar windows"
        ]

    def test_an_unknown_key(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError) as caught:
            load_text(tmp_path, _rule("{estimate: 3}"))
        (problem,) = caught.value.problems
        assert problem.startswith(f"{tmp_path / 'test.yaml'}: edge/client_id: ")
        assert "estimate" in problem


class TestReleasedBy:
    def test_negative_hits_loads(self, tmp_path: Path) -> None:
        text = "domain: edge\ndescriptors:\n  - key: client_id\n    concurrency: "
        block = "{max_in_flight: 2, released_by: negative_hits}\n"
        (rule,) = load_text(tmp_path, text + block).config.domains["edge"].rules
        assert rule.concurrency is not None
        assert rule.concurrency.released_by == "negative_hits"

    def test_anything_else_is_named(self, tmp_path: Path) -> None:
        text = "domain: edge\ndescriptors:\n  - key: client_id\n    concurrency: "
        with pytest.raises(ConfigError) as caught:
            load_text(tmp_path, text + "{max_in_flight: 2, released_by: refunds}\n")
        assert caught.value.problems == [
            f"{tmp_path / 'test.yaml'}: edge/client_id: concurrency.released_by must be "
            "request_id or negative_hits, not refunds"
        ]
