"""`fairlimit simulate --phase F` (issue 40): the pages' phase as a parameter."""

import contextlib
import io
from pathlib import Path

import pytest

from fairlimit.cli import main
from fairlimit.errors import ScenarioError
from fairlimit.simulate import load_scenario
from fairlimit.simulate.scenario import at_phase
from fairlimit.simulate.traffic import Phase

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LATE = ROOT / "descriptors" / "scenarios" / "late-arrivals.yaml"
SMALL = """name: pages
domain: edge
descriptor: [{key: route, value: api}, {key: client_id, value: "{client}"}]
configs: [{label: fairlimit, path: fair.yaml}]
duration: 3
tick: 0.01
clients:
  - {name: batch, rate: 200}
  - {name: user, phases: [{start: 1.3, stop: 3, every: 1, for: 0.01, rate: 500}]}
"""
FAIR = """domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 5}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 100}
"""


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


class TestAtPhase:
    def test_it_moves_every_repeating_phase_to_the_phase_of_its_second(self) -> None:
        """Each phase with ``every`` starts at F of the second it started in; the others
        stay; the scenario's name says so."""
        scenario = load_scenario(LATE)
        moved = at_phase(scenario, 0.96)
        assert moved.clients[0].phases == scenario.clients[0].phases  # the batch job
        starts = [c.phases[0].start for c in moved.clients[1:]]
        assert starts == [k // 5 + 0.96 for k in range(30)]
        assert all(c.phases[0].every == 6 for c in moved.clients[1:])
        assert moved.name == "late-arrivals, repeating phases at 0.96 of their second"

    def test_a_phase_outside_a_second_is_refused(self) -> None:
        """F must be from 0 to below 1."""
        scenario = load_scenario(LATE)
        with pytest.raises(ScenarioError) as caught:
            at_phase(scenario, 1.0)
        assert caught.value.problems == [
            "--phase: must be from 0 to below 1 (of a second), not 1.0"
        ]

    def test_the_bundled_scenario_has_its_pages_at_random_phases(self) -> None:
        """late-arrivals.yaml: 30 users, five a second, each at its own phase up to 0.97."""
        users = load_scenario(LATE).clients[1:]
        phases = [round(c.phases[0].start % 1, 3) for c in users]
        assert len(users) == 30 and len(set(phases)) >= 25  # drawn: a few may coincide
        assert all(0 <= p <= 0.97 for p in phases)
        assert [int(c.phases[0].start) for c in users] == [k // 5 for k in range(30)]
        assert all(c.phases[0] == Phase(c.phases[0].start, 30, 500, 6, 0.01) for c in users)


class TestCommand:
    def test_simulate_runs_the_case_at_the_phase_given(self, tmp_path: Path) -> None:
        """The report names the phase, and the user's pages start there: at 0.5 of a
        second the one page of each second is admitted whole (5 of 5)."""
        (tmp_path / "fair.yaml").write_text(FAIR)
        path = tmp_path / "pages.yaml"
        path.write_text(SMALL)
        code, out, err = _cli("simulate", str(path), "--phase", "0.5")
        assert (code, err) == (0, "")
        assert "repeating phases at 0.5 of their second" in out
        user = next(line for line in out.splitlines() if line.startswith("user "))
        assert user.split()[1:4] == ["10", "10", "10"]

    def test_a_bad_phase_is_a_clear_error(self, tmp_path: Path) -> None:
        """--phase 1.5: exit 2 and the message, no traceback."""
        (tmp_path / "fair.yaml").write_text(FAIR)
        path = tmp_path / "pages.yaml"
        path.write_text(SMALL)
        code, out, err = _cli("simulate", str(path), "--phase", "1.5")
        assert (code, out) == (2, "")
        assert err == "--phase: must be from 0 to below 1 (of a second), not 1.5\n"
