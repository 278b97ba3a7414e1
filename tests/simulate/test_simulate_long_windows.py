"""`fairlimit simulate` on client limits of a longer window than their cap's (issue 37):
what docs/configuration.md quotes from descriptors/scenarios/long-windows.yaml."""

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from fairlimit.cli import main

pytestmark = pytest.mark.unit

SCENARIO = Path(__file__).resolve().parents[2] / "descriptors" / "scenarios" / "long-windows.yaml"


@pytest.fixture(scope="module")
def report() -> dict[str, dict[str, Any]]:
    """The scenario's JSON report, by config label."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["simulate", str(SCENARIO), "--format", "json"])
    assert (code, err.getvalue()) == (0, "")
    return {c["label"]: c for c in json.loads(out.getvalue())["configs"]}


def _admitted(config: dict[str, Any], name: str) -> list[int]:
    client = next(c for c in config["clients"] if c["name"] == name)
    return list(client["admitted_each_second"])


class TestLongWindowsUnderACap:
    @pytest.mark.parametrize(
        ("label", "greedy"), [("hourly", 1000), ("daily", 3600), ("second-and-minute", 1000)]
    )
    def test_each_limit_holds_in_its_own_window_and_the_cap_in_its_own(
        self, report: dict[str, dict[str, Any]], label: str, greedy: int
    ) -> None:
        """The web clients get their 10/s under every config; the greedy one the cap's 60/s
        left (30/s under its own 30/s) until its hour's or minute's quota is spent; no
        level passes its limit."""
        config = report[label]
        assert sum(_admitted(config, "greedy")) == greedy
        for web in ("web-1", "web-2", "web-3", "web-4"):
            assert _admitted(config, web) == [10] * 60, web
        assert not any(level["exceeded"] for level in config["levels"])

    def test_a_quota_is_spent_at_the_caps_pace_then_refused(
        self, report: dict[str, dict[str, Any]]
    ) -> None:
        """1000/hour: 60 a second for 16 s, 40, then nothing; 30/s + 1000/minute: 30 a
        second for 33 s, 10, then nothing (the minute's quota is not divided by 60)."""
        assert _admitted(report["hourly"], "greedy")[:18] == [60] * 16 + [40, 0]
        assert _admitted(report["second-and-minute"], "greedy")[:35] == [30] * 33 + [10, 0]

    @pytest.mark.parametrize("label", ["hourly", "daily", "second-and-minute"])
    def test_a_client_held_by_its_own_quota_is_not_starved(
        self, report: dict[str, dict[str, Any]], label: str
    ) -> None:
        """The fairness line counts a client's own limits over the span measured: the
        greedy client that spent its 1000 an hour got all its quota allowed."""
        fairness = report[label]["fairness"]
        assert fairness["starved_clients"] == 0
        assert fairness["jain_index"] >= 0.99
