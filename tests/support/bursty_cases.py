"""The bursty and new clients' cases: the four bundled scenarios (page-loads, one-shot-burst,
late-one-shot, burst-at-minute-start in descriptors/scenarios/) and variants of the same kinds
with other numbers. tests/simulate/test_fairness_cases.py measures them;
tests/support/fairness_cases_report.py prints their table.
"""

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from fairlimit.simulate import load_scenario
from fairlimit.simulate.report import ConfigResult, Result
from fairlimit.simulate.scenario import Scenario
from fairlimit.simulate.traffic import Phase

SCENARIOS = Path(__file__).resolve().parents[2] / "descriptors" / "scenarios"


@dataclass(frozen=True)
class Case:
    """A scenario, its fair-share config and the clients that burst in it."""

    name: str
    scenario: Scenario
    config: Path | str  # a config file, or YAML text written to a temporary file
    bursty: tuple[str, ...]
    late_first_window: bool = False  # utilisation >= 0.95 (not 0.99) in window 0


def _bundled(name: str, late: bool = False) -> Case:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    config = next(c.path for c in scenario.configs if c.label == "fairlimit")
    groups = ("user", "burst", "late")
    bursty = tuple(c.name for c in scenario.clients if c.name.startswith(groups))
    return Case(name, scenario, config, bursty, late)


PAGE_LOADS = _bundled("page-loads")
ONE_SHOT = _bundled("one-shot-burst")
LATE_ONE_SHOT = _bundled("late-one-shot", late=True)
MINUTE_START = _bundled("burst-at-minute-start")
BUNDLED = (PAGE_LOADS, ONE_SHOT, LATE_ONE_SHOT, MINUTE_START)


# --- variants: the same kinds of traffic with other numbers --------------------------------


def _with_phase(case: Case, client: str, phase: Phase, name: str) -> Case:
    """``case`` with the one phase of ``client`` replaced."""
    clients = tuple(
        dataclasses.replace(c, phases=(phase,)) if c.name == client else c
        for c in case.scenario.clients
    )
    scenario = dataclasses.replace(case.scenario, name=name, clients=clients)
    return dataclasses.replace(case, name=name, scenario=scenario)


def _page_loads(users: int, capacity: int) -> Case:
    """page-loads with ``users`` users, four pages starting a second (0.13 s + 0.25 s k),
    under a cap of ``capacity``/s over per-client limits of as much."""
    base = PAGE_LOADS.scenario
    batch, template = base.clients[0], base.clients[1]
    users_ = tuple(
        dataclasses.replace(
            template,
            name=f"user{k:02d}",
            group=f"user{k:02d}",
            phases=(dataclasses.replace(template.phases[0], start=round(0.13 + 0.25 * k, 2)),),
        )
        for k in range(users)
    )
    name = f"page-loads, {users} users, {capacity}/s"
    scenario = dataclasses.replace(base, name=name, clients=(batch, *users_))
    text = f"""
domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {{unit: second, requests_per_unit: {capacity}}}
    fair_share: {{active_clients: 8}}
    descriptors:
      - key: client_id
        rate_limit: {{unit: second, requests_per_unit: {capacity}}}
"""
    return Case(name, scenario, text, tuple(c.name for c in users_))


def _steady_clients(case: Case, count: int, name: str) -> Case:
    """``case`` keeping only the first ``count`` of its steady clients."""
    steady = [c for c in case.scenario.clients if c.group == "steady"][:count]
    others = [c for c in case.scenario.clients if c.group != "steady"]
    scenario = dataclasses.replace(case.scenario, name=name, clients=(*steady, *others))
    return dataclasses.replace(case, name=name, scenario=scenario)


VARIANTS = (
    # window 6: thirteen clients over 1200/13 = 92 each, the burst at the window's end
    _with_phase(ONE_SHOT, "burst", Phase(6.8, 7.0, 1200), "one-shot-burst at 6.8 s"),
    # window 6: 400 hits in 0.2 s, still 92 each
    _with_phase(ONE_SHOT, "burst", Phase(6.4, 6.6, 2000), "one-shot-burst of 400"),
    # windows 6 and 7: 120 asked in each, 92 each in both (paced by the history of its
    # tenth of a second in window 6, it got 11 of them in window 7)
    _with_phase(ONE_SHOT, "burst", Phase(6.9, 7.1, 1200), "one-shot-burst across a second"),
    # windows 6 and 7: 180 and 60 asked, 92 and 60 (its tail, paced by its history in its
    # first 13 ms of window 7, got 45 of its 60)
    _with_phase(ONE_SHOT, "burst", Phase(6.85, 7.05, 1200), "one-shot-burst, a tail of 50 ms"),
    # users 32/s (16/s in seconds 7, 15, ...), all admitted; the batch job the rest of 150
    _page_loads(30, 150),
    # minute 0: the sparse clients 15 each, the late client the other 810
    _with_phase(LATE_ONE_SHOT, "late", Phase(5.5, 5.6, 15000), "late-one-shot at 5.5 s"),
    # minute 0: the same 1500 sent over 3 s, 500 a second: still 810 (paced as if it kept
    # 500 a second to the minute's end, it got 316)
    _with_phase(LATE_ONE_SHOT, "late", Phase(20.5, 23.5, 500), "late-one-shot over 3 s"),
    # six steady clients (720/min each, 4320 in all: no contention), then 4800/7 = 686 each
    _steady_clients(MINUTE_START, 6, "burst-at-minute-start, 6 steady clients"),
)


# --- running and checking ------------------------------------------------------------------


def _config_path(case: Case, where: Path) -> Path:
    if isinstance(case.config, Path):
        return case.config
    path = where / (re.sub(r"[^a-z0-9]+", "-", case.name.lower()) + ".yaml")
    path.write_text(case.config)
    return path


def _fair(result: Result, config: Path) -> ConfigResult:
    """The result of the run on ``config`` (its label, or its stem when run alone)."""
    return next(c for c in result.configs if Path(c.path) == config)
