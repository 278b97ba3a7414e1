"""`fairlimit simulate` for issue 11: phases, costs, nested levels, windows, bundled scenarios."""

import contextlib
import io
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairlimit import simulate
from fairlimit.cli import main
from fairlimit.simulate import load_scenario
from fairlimit.simulate.levels import Tree
from fairlimit.simulate.plot import bands
from fairlimit.simulate.report import ClientResult, ConfigResult
from fairlimit.simulate.traffic import Cost, Phase
from helpers import require_module

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "descriptors" / "scenarios"
BUNDLED = [
    "burst-at-zero",
    "late-greedy",
    "burst-after-idle",
    "nested-caps",
    "on-off",
    "join-leave",
    "fractional",
    "token-budget",
]

PER_SECOND_100 = """
domain: edge
descriptors:
  - {key: generic_key, value: global, rate_limit: {unit: second, requests_per_unit: 100}}
"""
NESTED = """
domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 60}
        fair_share: {active_clients: 2}
        descriptors:
          - key: user
            rate_limit: {unit: second, requests_per_unit: 20}
"""


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _entry(key: str, value: str) -> dict[str, str]:
    return {"key": key, "value": value}


def _write(tmp_path: Path, clients: list[dict[str, Any]], **fields: Any) -> Path:
    (tmp_path / "global.yaml").write_text(PER_SECOND_100)
    (tmp_path / "nested.yaml").write_text(NESTED)
    body: dict[str, Any] = {
        "name": "small",
        "duration": 4,
        "tick": 0.1,
        "domain": "edge",
        "descriptors": [[_entry("generic_key", "global")], [_entry("client_id", "{client}")]],
        "configs": [{"label": "global", "path": "global.yaml"}],
        "clients": clients,
    }
    body.update(fields)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def _run(path: Path) -> simulate.Result:
    return simulate.run(load_scenario(path))


class TestTraffic:
    def test_an_on_off_phase_sends_only_while_on(self, tmp_path: Path) -> None:
        """10/s for 0.5 s of every 2 s: five requests in seconds 0 and 2, none in 1 and 3."""
        phases = [{"start": 0, "stop": 4, "rate": 10, "every": 2, "for": 0.5}]
        (client,) = _run(_write(tmp_path, [{"name": "a", "phases": phases}])).configs[0].clients
        assert client.offered == 10
        assert client.per_second == (5, 0, 5, 0)

    def test_a_burst_goes_at_once_at_its_start(self, tmp_path: Path) -> None:
        """A burst of 7 at 1 s next to a phase of 2/s: the burst lands in second 1 whole."""
        phases = [{"start": 0, "stop": 4, "rate": 2}, {"start": 1, "stop": 2, "burst": 7}]
        (client,) = _run(_write(tmp_path, [{"name": "a", "phases": phases}])).configs[0].clients
        assert client.per_second == (2, 9, 2, 2)

    def test_count_makes_identical_clients_of_one_group(self, tmp_path: Path) -> None:
        """count: 3 makes web-1..web-3, grouped as web, each with the entry's traffic."""
        result = _run(_write(tmp_path, [{"name": "web", "count": 3, "rate": 5}]))
        clients = result.configs[0].clients
        assert [(c.name, c.group, c.offered) for c in clients] == [
            ("web-1", "web", 20),
            ("web-2", "web", 20),
            ("web-3", "web", 20),
        ]

    def test_costs_are_drawn_the_same_for_one_seed(self, tmp_path: Path) -> None:
        """Uniform costs stay within bounds; one seed gives the same hits, another differs."""
        cost = {"uniform": [2, 9]}
        path = _write(tmp_path, [{"name": "a", "rate": 5, "cost": cost}], seed=1)
        first, again = _run(path).configs[0].clients[0], _run(path).configs[0].clients[0]
        assert first == again
        assert 2 * 20 <= first.offered_hits <= 9 * 20
        other = _run(_write(tmp_path, [{"name": "a", "rate": 5, "cost": cost}], seed=2))
        assert other.configs[0].clients[0].offered_hits != first.offered_hits

    def test_weighted_values_draw_only_those_values(self) -> None:
        """A cost of values with weights draws nothing else; a fixed cost is fixed."""
        rng = random.Random(0)
        cost = Cost((200, 2000), (3.0, 1.0))
        draws = {cost.draw(rng) for _ in range(200)}
        assert draws == {200, 2000}
        assert (Cost((5,)).fixed, cost.fixed, Cost(uniform=(3, 3)).fixed) == (5, None, 3)

    def test_a_fixed_cost_is_charged_as_hits(self, tmp_path: Path) -> None:
        """Cost 10 at 20/s under 100 hits/s: 10 requests (100 hits) admitted each second."""
        result = _run(_write(tmp_path, [{"name": "a", "rate": 20, "cost": 10}]))
        client = result.configs[0].clients[0]
        assert client.per_second == (100, 100, 100, 100)
        assert (client.admitted, client.admitted_hits) == (40, 400)
        assert not result.configs[0].cap.exceeded  # type: ignore[union-attr]

    def test_charge_after_the_response_checks_then_charges(self, tmp_path: Path) -> None:
        """charge: response makes two calls per admitted request: a 0-hit check, the cost."""
        clients = [{"name": "a", "rate": 2, "cost": 5, "charge": "response"}]
        config = _run(_write(tmp_path, clients)).configs[0]
        assert (config.clients[0].admitted_hits, config.limiter_calls) == (40, 16)

    def test_phase_times_are_evenly_spread(self) -> None:
        """A phase's times: its burst first, then n / rate from each on-span's start."""
        phase = Phase(1.0, 2.0, rate=4.0, burst=2)
        assert list(phase.times()) == [1.0, 1.0, 1.0, 1.25, 1.5, 1.75]


class TestLevels:
    def test_achievable_is_bottom_up_max_min(self) -> None:
        """route 100 > tenants 60 > users 20: A's users ask 30 each, B's 5: 60 + 10 = 70."""
        chains = [("r", "A", f"a{i}") for i in range(4)] + [("r", "B", f"b{i}") for i in range(2)]
        limits = {"r": 100.0, "A": 60.0, "B": 60.0} | {c[2]: 20.0 for c in chains}
        tree = Tree("r", (), tuple(chains), limits)
        assert tree.achievable([30, 30, 30, 30, 5, 5]) == 70
        assert tree.achievable([30, 30, 30, 30, 50, 50]) == 100
        assert tree.achievable([0] * 6) == 0

    def test_every_level_is_checked_and_windows_report_utilisation(self, tmp_path: Path) -> None:
        """Nested caps: the route, tenants and users each have a check; windows give figures."""
        template = [
            [_entry("route", "api"), _entry("tenant", "{tenant}"), _entry("user", "{client}")]
        ]
        clients = [
            {"name": "a", "count": 3, "tenant": "A", "rate": 30},
            {"name": "b", "tenant": "B", "rate": 5},
        ]
        path = _write(
            tmp_path,
            clients,
            descriptors=template,
            configs=[{"label": "nested", "path": "nested.yaml"}],
        )
        code, out, err = _cli("simulate", str(path), "--format", "json")
        assert (code, err) == (0, "")
        (config,) = json.loads(out)["configs"]
        levels = {c["path"]: c for c in config["levels"]}
        route = "edge/route=api"
        assert list(levels) == [route, f"{route}/tenant", f"{route}/tenant/user"]
        assert [levels[p]["counters"] for p in levels] == [1, 2, 4]
        assert all(not c["exceeded"] for c in config["levels"])
        windows = config["windows"]
        assert [w["achievable"] for w in windows] == [65, 65, 65, 65]  # A: 60, B: 5
        assert all(w["admitted"] <= 100 for w in windows)
        later = [w["utilisation"] for w in windows[1:]]
        assert min(later) >= 0.9
        assert windows[1]["clients"][3] == {"name": "b", "offered_hits": 5, "admitted_hits": 5}


class TestPlotData:
    def test_bands_sum_a_group_and_climb_within_a_window(self) -> None:
        """Identical clients are one band; with a 2-s window the band climbs, then restarts."""
        result = ClientResult
        a = result("w-1", 0, 0, 0, 0, 1.0, 0.0, (1, 2, 3, 4), "w")
        b = result("w-2", 0, 0, 0, 0, 1.0, 0.0, (1, 1, 1, 1), "w")
        c = result("solo", 0, 0, 0, 0, 1.0, 0.0, (5, 0, 0, 5), "solo")
        config = ConfigResult("x", "x.yaml", (a, b, c), None, None, 0)
        assert bands(config, 2) == {"w": [2, 5, 4, 9], "solo": [5, 5, 0, 5]}
        assert bands(config, 1) == {"w": [2, 3, 4, 5], "solo": [5, 0, 0, 5]}


@pytest.fixture(scope="module")
def bundled() -> dict[str, dict[str, Any]]:
    """Each bundled scenario's JSON report."""
    out = {}
    for name in BUNDLED:
        code, text, err = _cli("simulate", str(SCENARIOS / f"{name}.yaml"), "--format", "json")
        assert (code, err) == (0, ""), name
        out[name] = json.loads(text)
    return out


class TestBundledScenarios:
    @pytest.mark.parametrize("name", BUNDLED)
    def test_each_runs_side_by_side_with_a_global_bucket(
        self, bundled: dict[str, dict[str, Any]], name: str
    ) -> None:
        """Every situation of issue 11 runs against a global bucket and a fair-share config."""
        labels = [c["label"] for c in bundled[name]["configs"]]
        assert labels[0] == "global-bucket" and "fairlimit" in labels
        for config in bundled[name]["configs"]:
            assert config["windows"] and config["levels"]

    @pytest.mark.parametrize("name", [n for n in BUNDLED if n != "token-budget"])
    def test_no_cap_at_any_level_is_exceeded(
        self, bundled: dict[str, dict[str, Any]], name: str
    ) -> None:
        """Requests charged up front: no counter at any level admits more than its limit."""
        for config in bundled[name]["configs"]:
            assert not any(c["exceeded"] for c in config["levels"]), config["label"]

    def test_the_token_budget_global_bucket_lets_tokens_past_the_cap(
        self, bundled: dict[str, dict[str, Any]]
    ) -> None:
        """Costs known after the response: a charge that does not fit is refused, not recorded,
        so behind a global bucket the tokens spent in a minute pass the provider's cap."""
        config = bundled["token-budget"]["configs"][0]
        assert config["cap"]["exceeded"]
        assert config["cap"]["max_admitted_over_limit"] > 2

    def test_charged_when_over_the_limit_tokens_stop_at_the_budget(
        self, bundled: dict[str, dict[str, Any]]
    ) -> None:
        """With charge_when_over_limit every charge counts: no tenant passes its 30 000 a
        minute, and the provider's cap is passed by at most one response's cost (2000)."""
        config = bundled["token-budget"]["configs"][2]
        assert config["label"] == "charged-when-over"
        cap, tenants = config["levels"]
        assert tenants["path"] == "edge/provider=llm/tenant" and not tenants["exceeded"]
        assert cap["max_admitted_in_a_window"] <= 60000 + 2000

    def test_nested_achievable_counts_what_each_tenant_can_use(
        self, bundled: dict[str, dict[str, Any]]
    ) -> None:
        """Route 1000 > tenant 600 > users 200: A can use 600, B 450, so the route all 1000."""
        for config in bundled["nested-caps"]["configs"]:
            assert all(math.isclose(w["achievable"], 1000) for w in config["windows"])

    def test_the_plot_of_a_bundled_scenario_is_a_png(self, tmp_path: Path) -> None:
        """--plot draws the bundled token-budget scenario (needs matplotlib)."""
        require_module("matplotlib", "the plot extra: pip install 'fairlimit[plot]'")
        out = tmp_path / "tokens.png"
        code, _, _ = _cli("simulate", str(SCENARIOS / "token-budget.yaml"), "--plot", str(out))
        assert code == 0
        assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


BASE: dict[str, Any] = {
    "name": "broken",
    "duration": 5,
    "domain": "edge",
    "descriptor": [{"key": "client_id", "value": "{client}"}],
    "configs": [{"label": "one", "path": "global.yaml"}],
}
# (case, the client entry, the one line expected after "{file}: ")
CLIENT_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    (
        "phases-and-rate",
        {"name": "a", "rate": 1, "phases": [{"rate": 2}]},
        "clients[0]: give 'rate', 'start' and 'stop' or 'phases', not both",
    ),
    (
        "phases-empty",
        {"name": "a", "phases": []},
        "clients[0].phases: must be a non-empty list of phases",
    ),
    (
        "phase-sends-nothing",
        {"name": "a", "phases": [{"start": 1}]},
        "clients[0].phases[0]: sends nothing: give a rate above 0 or a burst",
    ),
    (
        "phase-on-as-yaml-bool",
        {"name": "a", "phases": [{"rate": 2, "every": 2, "on": 0.5}]},
        "clients[0].phases[0]: write 'for' for the seconds on (YAML reads a key 'on' as true)",
    ),
    (
        "cycle-without-for",
        {"name": "a", "phases": [{"rate": 2, "every": 2}]},
        "clients[0].phases[0].for: must be above 0 when 'every' is given",
    ),
    (
        "phase-stops-late",
        {"name": "a", "phases": [{"rate": 2, "start": 1, "stop": 9}]},
        "clients[0].phases[0].stop: must be a number above start (1) up to duration (5), not 9",
    ),
    (
        "cost-zero",
        {"name": "a", "rate": 1, "cost": 0},
        "clients[0].cost: must be an integer from 1 to 1000000000, not 0",
    ),
    (
        "cost-both-forms",
        {"name": "a", "rate": 1, "cost": {"uniform": [1, 2], "values": [3]}},
        "clients[0].cost: give a number, {uniform: [low, high]} or {values: [...], weights: [...]}",
    ),
    (
        "cost-uniform-backwards",
        {"name": "a", "rate": 1, "cost": {"uniform": [9, 2]}},
        "clients[0].cost.uniform: must go from low to high, not [9, 2]",
    ),
    (
        "cost-weights-short",
        {"name": "a", "rate": 1, "cost": {"values": [1, 2], "weights": [1]}},
        "clients[0].cost.weights: must be 2 numbers above 0, one per value",
    ),
    (
        "retries-with-varying-cost",
        {"name": "a", "rate": 1, "cost": {"uniform": [1, 2]}, "retries": {"max": 1}},
        "clients[0].retries: a client whose cost varies cannot retry",
    ),
    (
        "charge-unknown",
        {"name": "a", "rate": 1, "charge": "later"},
        "clients[0].charge: must be one of request, response, not 'later'",
    ),
    ("count-zero", {"name": "a", "rate": 1, "count": 0}, "clients[0].count: must be at least 1"),
]


class TestClientErrors:
    @pytest.mark.parametrize(
        ("client", "line"), [c[1:] for c in CLIENT_ERRORS], ids=[c[0] for c in CLIENT_ERRORS]
    )
    def test_each_broken_client_exits_2_with_its_exact_message(
        self, tmp_path: Path, client: dict[str, Any], line: str
    ) -> None:
        """A client entry with one mistake exits 2 and names it as FILE: PATH: message."""
        (tmp_path / "global.yaml").write_text(PER_SECOND_100)
        path = tmp_path / "scenario.yaml"
        path.write_text(yaml.safe_dump({**BASE, "clients": [client]}))
        code, out, err = _cli("simulate", str(path))
        assert (code, out, err.splitlines()) == (2, "", [f"{path}: {line}"])

    def test_a_tenant_placeholder_needs_every_clients_tenant(self, tmp_path: Path) -> None:
        """{tenant} in the template and a client without one: the client is named."""
        (tmp_path / "global.yaml").write_text(PER_SECOND_100)
        template = [_entry("tenant", "{tenant}"), _entry("user", "{client}")]
        clients = [{"name": "a", "tenant": "A", "rate": 1}, {"name": "b", "rate": 1}]
        path = tmp_path / "scenario.yaml"
        path.write_text(yaml.safe_dump({**BASE, "descriptor": template, "clients": clients}))
        code, _, err = _cli("simulate", str(path))
        expected = f"{path}: clients: client 'b' has no tenant for the {{tenant}} placeholder"
        assert (code, err.splitlines()) == (2, [expected])


@pytest.fixture(scope="module")
def drawn() -> dict[str, tuple[Any, Any]]:
    """The bundled scenarios whose plots were cut: (result, its Figure drawn by Agg)."""
    require_module("matplotlib", "the plot extra: pip install 'fairlimit[plot]'")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from fairlimit.simulate import plot

    out = {}
    for name in ("rlqs", "page-loads", "token-budget"):
        result = simulate.run(load_scenario(str(SCENARIOS / f"{name}.yaml")))
        figure = plot.figure(result)
        FigureCanvasAgg(figure).draw()
        out[name] = (result, figure)
    return out


class TestPlotsAreReadable:
    """What the PNGs showed cut or crowded (issue 37), measured on the drawn figures."""

    @pytest.mark.parametrize("name", ["rlqs", "page-loads", "token-budget"])
    def test_no_text_runs_off_the_figure(self, drawn: dict[str, Any], name: str) -> None:
        """Titles (a long rule path and its figures) stay inside the image."""
        from matplotlib.text import Text

        _, figure = drawn[name]
        renderer, width = figure.canvas.get_renderer(), figure.bbox.width
        # tick labels past the axis limits are kept but not drawn
        ticks = {id(t) for ax in figure.axes for t in ax.get_xticklabels() + ax.get_yticklabels()}
        for text in figure.findobj(Text):
            if text.get_visible() and text.get_text() and id(text) not in ticks:
                box = text.get_window_extent(renderer)
                assert box.x0 >= 0 and box.x1 <= width + 0.5, text.get_text()

    def test_every_panel_shows_its_highest_bar(self, drawn: dict[str, Any]) -> None:
        """RLQS's 112 a second fits on the axis the panels share (it was cut at 105)."""
        from fairlimit.simulate.plot import bands

        result, figure = drawn["rlqs"]
        for ax, config in zip(figure.axes, result.configs, strict=True):
            stacked = [sum(column) for column in zip(*bands(config, 1).values(), strict=True)]
            assert max(stacked) <= ax.get_ylim()[1]
        assert max(max(c.per_second) for c in result.configs[1].clients) > 0

    def test_the_legend_names_a_few_bands(self, drawn: dict[str, Any]) -> None:
        """page-loads' 41 clients: the most admitted apart, the rest as one band."""
        from fairlimit.simulate.plot import MAX_BANDS

        _, figure = drawn["page-loads"]
        (legend,) = figure.legends
        names = [t.get_text() for t in legend.get_texts()]
        assert len(names) <= MAX_BANDS + 2  # and the cap and λ
        assert "batch" in names and "34 other clients" in names
