"""`fairlimit simulate` with RLQS clients: each config again behind simulated RLQS Envoys."""

from pathlib import Path

import pytest

from fairlimit.errors import ScenarioError
from fairlimit.simulate import engine, load_scenario
from fairlimit.simulate.report import ConfigResult
from fairlimit.simulate.scenario import RlqsModel, parse_scenario

pytestmark = pytest.mark.unit

SCENARIO = Path(__file__).resolve().parents[2] / "descriptors" / "scenarios" / "rlqs.yaml"
MODEST = [f"modest-{i}" for i in range(1, 5)]


@pytest.fixture(scope="module")
def results() -> dict[str, ConfigResult]:
    result = engine.run(load_scenario(SCENARIO))
    return {c.label: c for c in result.configs}


def admitted_per_second(config: ConfigResult, name: str, start: int = 10) -> float:
    client = next(c for c in config.clients if c.name == name)
    steady = client.per_second[start:]
    return sum(steady) / len(steady)


class TestRlqsScenario:
    def test_each_config_runs_over_rls_and_over_rlqs(
        self, results: dict[str, ConfigResult]
    ) -> None:
        """The bundled scenario reports the config twice; RLQS counts reports, not calls."""
        assert list(results) == ["fairlimit", "fairlimit over RLQS"]
        over = results["fairlimit over RLQS"]
        # 2 Envoys x (reports at 5, 10, 15 s + 5 subscriptions) in 20 s; RLS: 4200 calls.
        assert over.limiter_calls == 2 * (3 + 5)
        assert results["fairlimit"].limiter_calls >= 4200

    def test_rlqs_serves_the_modest_clients_and_holds_the_greedy_one(
        self, results: dict[str, ConfigResult]
    ) -> None:
        """Over RLQS the modest clients get all of their 15/s and, from two intervals on,
        the greedy one is within 10% of its max-min 40/s, as over RLS."""
        over = results["fairlimit over RLQS"]
        for client in over.clients:
            if client.name in MODEST:
                assert client.success == 1.0
        assert admitted_per_second(over, "greedy") == pytest.approx(40, rel=0.1)
        assert admitted_per_second(results["fairlimit"], "greedy") == pytest.approx(40, rel=0.05)

    def test_rlqs_keeps_the_cap_within_the_stated_bound(
        self, results: dict[str, ConfigResult]
    ) -> None:
        """Token buckets start full, so a window may pass the cap, within C + H + D (221)."""
        cap = results["fairlimit over RLQS"].cap
        assert cap is not None and cap.limit == 100
        assert cap.max_admitted <= 221


class TestRlqsKey:
    def test_defaults_and_values(self, tmp_path: Path) -> None:
        """rlqs: {} means two Envoys reporting every 5 s (Envoy 1.40's interval)."""
        text = SCENARIO.read_text().replace("rlqs: {envoys: 2, interval: 5}", "rlqs: {}")
        scenario = parse_scenario(text, "s.yaml", SCENARIO.parent)
        assert scenario.rlqs == RlqsModel(2, 5.0)

    @pytest.mark.parametrize(
        ("value", "message"),
        [
            ("{envoys: 0}", "s.yaml: rlqs.envoys: must be a whole number from 1 to 100, not 0"),
            ("{envoys: 2.5}", "s.yaml: rlqs.envoys: must be a whole number from 1 to 100, not 2.5"),
            ("{interval: 0}", "s.yaml: rlqs.interval: must be a number from 0.1 to 3600, not 0"),
            ("{every: 5}", "s.yaml: rlqs: unknown key 'every'"),
        ],
    )
    def test_bad_values_are_scenario_errors(self, value: str, message: str) -> None:
        """Each mistake is named as FILE: PATH: message."""
        text = SCENARIO.read_text().replace("{envoys: 2, interval: 5}", value)
        with pytest.raises(ScenarioError) as caught:
            parse_scenario(text, "s.yaml", SCENARIO.parent)
        assert caught.value.problems == [message]
