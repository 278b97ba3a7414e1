"""`fairlimit simulate` with request durations: concurrency caps on the simulated clock."""

from pathlib import Path

import pytest

from fairlimit import simulate
from fairlimit.errors import ScenarioError
from fairlimit.simulate import load_scenario

pytestmark = pytest.mark.unit

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: export
    concurrency: {max_in_flight: 4}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 2}
"""
SCENARIO = """
name: long requests
duration: 5
tick: 0.1
domain: edge
descriptor: [{key: route, value: export}, {key: client_id, value: "{client}"}]
configs:
  - {label: capped, path: capped.yaml}
clients:
  - {name: slow, rate: 10, request_duration: 1}
  - {name: quick, rate: 2, request_duration: 0.1}
"""


class TestRequestDurations:
    def test_each_client_is_held_to_its_slots(self, tmp_path: Path) -> None:
        """2 slots, each held 1 s: the client sending 10/s gets 2 per second (10 in 5 s);
        the one whose requests end within a tick gets all of its 2/s."""
        (tmp_path / "capped.yaml").write_text(CONFIG)
        scenario_path = tmp_path / "scenario.yaml"
        scenario_path.write_text(SCENARIO)
        scenario = load_scenario(scenario_path)
        assert [c.request_duration for c in scenario.clients] == [1.0, 0.1]
        (result,) = simulate.run(scenario).configs
        slow, quick = result.clients
        assert (slow.offered, slow.admitted) == (50, 10)
        assert slow.per_second == (2, 2, 2, 2, 2)
        assert (quick.offered, quick.admitted) == (10, 10)

    def test_a_negative_duration_is_a_scenario_error(self, tmp_path: Path) -> None:
        """request_duration is checked like every scenario number (FILE: PATH: message)."""
        (tmp_path / "capped.yaml").write_text(CONFIG)
        path = tmp_path / "scenario.yaml"
        path.write_text(SCENARIO.replace("request_duration: 1}", "request_duration: -1}"))
        with pytest.raises(ScenarioError) as caught:
            load_scenario(path)
        assert caught.value.problems == [
            f"{path}: clients[0].request_duration: must be a number from 0 to 86400, not -1"
        ]
