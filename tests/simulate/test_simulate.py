"""`fairlimit simulate`: scenarios through the real limiter on a simulated clock."""

import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairlimit import simulate
from fairlimit.cli import main
from fairlimit.errors import ScenarioError
from fairlimit.simulate import load_scenario
from helpers import require_module
from limit_configs import FOUR_LIMITS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "descriptors" / "scenarios" / "seed-trace.yaml"
WEB = [f"web-{i}" for i in range(1, 10)]


def _cli(*argv: str) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def seed_text() -> tuple[int, str, str]:
    return _cli("simulate", str(SEED))


@pytest.fixture(scope="module")
def seed() -> dict[str, dict[str, Any]]:
    """The seed trace's JSON report, by config label."""
    code, out, _ = _cli("simulate", str(SEED), "--format", "json")
    assert code == 0
    return {c["label"]: c for c in json.loads(out)["configs"]}


def _client(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["clients"] if c["name"] == name)


class TestSeedTrace:
    def test_cli_shows_both_configs_in_one_screen(self, seed_text: tuple[int, str, str]) -> None:
        """The bundled scenario exits 0 and prints both configs in under 40 lines."""
        code, out, err = seed_text
        assert (code, err) == (0, "")
        assert "[global-bucket] global-bucket.yaml" in out
        assert "[fairlimit] fairlimit.yaml" in out
        assert len(out.splitlines()) < 40

    def test_json_report_parses_with_both_configs(self, seed: dict[str, Any]) -> None:
        """--format json prints the same report, one entry per config."""
        assert list(seed) == ["global-bucket", "fairlimit"]
        assert [c["name"] for c in seed["fairlimit"]["clients"]] == ["batch-etl", *WEB]

    def test_global_bucket_starves_the_interactive_clients(self, seed: dict[str, Any]) -> None:
        """Behind one shared bucket every interactive client succeeds less than half the time."""
        for name in WEB:
            assert _client(seed["global-bucket"], name)["success"] < 0.5

    def test_fairlimit_serves_every_interactive_client(self, seed: dict[str, Any]) -> None:
        """Under the fair cap every interactive client gets at least 99% of its requests."""
        for name in WEB:
            assert _client(seed["fairlimit"], name)["success"] >= 0.99

    def test_fairlimit_holds_the_batch_client_to_its_own_limit(self, seed: dict[str, Any]) -> None:
        """The retrying batch client gets its 100/s (within 1%), every second."""
        batch = _client(seed["fairlimit"], "batch-etl")
        assert batch["admitted_per_second"] == pytest.approx(100, rel=0.01)
        assert all(99 <= n <= 101 for n in batch["admitted_each_second"])

    def test_the_cap_is_never_exceeded(self, seed: dict[str, Any]) -> None:
        """Neither config admits more than 1000 in any 1-s window."""
        for config in seed.values():
            cap = config["cap"]
            assert (cap["limit"], cap["window_seconds"]) == (1000, 1)
            assert cap["max_admitted_in_a_window"] <= 1000
            assert not cap["exceeded"]

    def test_fairness_figures_tell_the_two_apart(self, seed: dict[str, Any]) -> None:
        """The global bucket starves nine clients; fairlimit starves none, Jain's index ~1."""
        unfair, fair = seed["global-bucket"]["fairness"], seed["fairlimit"]["fairness"]
        assert unfair["starved_clients"] == 9
        assert unfair["jain_index"] < 0.5
        assert fair["starved_clients"] == 0
        assert fair["jain_index"] >= 0.99
        assert fair["level_per_second"] is None  # all demand fits under the cap


GLOBAL_10 = """
domain: edge
descriptors:
  - {key: generic_key, value: global, rate_limit: {unit: second, requests_per_unit: 10}}
"""
WEIGHTED = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 4, weights: {batch: 2}}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 60}
"""
TEMPLATE = [
    [{"key": "generic_key", "value": "global"}],
    [{"key": "route", "value": "public"}, {"key": "client_id", "value": "{client}"}],
]


def _scenario(tmp_path: Path, clients: list[dict[str, Any]], **fields: Any) -> Path:
    (tmp_path / "global.yaml").write_text(GLOBAL_10)
    (tmp_path / "weighted.yaml").write_text(WEIGHTED)
    body: dict[str, Any] = {
        "name": "small",
        "duration": 2,
        "tick": 0.1,
        "domain": "edge",
        "descriptors": TEMPLATE,
        "configs": [{"label": "global", "path": "global.yaml"}],
        "clients": clients,
    }
    body.update(fields)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def _only(result: simulate.Result) -> list[simulate.ClientResult]:
    return list(result.configs[0].clients)


class TestTraffic:
    def test_retries_come_back_after_their_backoff(self, tmp_path: Path) -> None:
        """Ten refused requests are retried half a second later, in the next window: all pass."""
        retrying = {"name": "a", "rate": 20, "stop": 1, "retries": {"max": 5, "backoff": 0.5}}
        client = _only(simulate.run(load_scenario(_scenario(tmp_path, [retrying]))))[0]
        assert (client.offered, client.attempted, client.admitted) == (20, 30, 20)
        assert client.success == 1.0
        assert client.per_second == (10, 10)

    def test_without_retries_success_is_the_admitted_share(self, tmp_path: Path) -> None:
        """With no retries a refused request is lost: success = admitted / offered."""
        plain = {"name": "a", "rate": 20, "stop": 1}
        client = _only(simulate.run(load_scenario(_scenario(tmp_path, [plain]))))[0]
        assert (client.offered, client.attempted, client.admitted, client.rejected) == (
            20,
            20,
            10,
            10,
        )
        assert client.success == 0.5

    def test_requests_are_spread_evenly_between_start_and_stop(self, tmp_path: Path) -> None:
        """A client at 7.3/s from 0.5 s to 2 s offers ceil(1.5 x 7.3) = 11 requests."""
        clients = [{"name": "a", "rate": 7.3, "start": 0.5}]
        client = _only(simulate.run(load_scenario(_scenario(tmp_path, clients))))[0]
        assert client.offered == 11
        assert client.admitted_per_second == pytest.approx(11 / 1.5)

    def test_one_call_for_a_refused_burst_matches_one_call_each(self, tmp_path: Path) -> None:
        """Coalescing a client's refused attempts in a tick changes the calls, and the figures
        only by when in the tick the cap sees that demand: the global bucket exactly, the
        fair-share cap within 1% of each client's hits (fairness v3 counts demand at once,
        and the coalesced attempts reach it at the tick's end), and so of its busiest span
        across a window's edge (when in the window a page is noted moves what comes after)."""
        clients = [
            {"name": "batch", "rate": 400, "retries": {"max": 5, "backoff": 0}},
            {"name": "a", "rate": 30, "retries": {"max": 2, "backoff": 0.1}},
            {"name": "b", "rate": 45, "start": 1, "stop": 3.5},
            {"name": "c", "rate": 7.3, "start": 0.5},
        ]
        configs = [
            {"label": "global", "path": "global.yaml"},
            {"label": "weighted", "path": "weighted.yaml"},
        ]
        path = _scenario(tmp_path, clients, duration=4, tick=0.05, configs=configs)
        scenario = load_scenario(path)
        fast, slow = simulate.run(scenario), simulate.run(scenario, coalesce=False)
        assert fast.configs[0].clients == slow.configs[0].clients
        assert (fast.configs[0].cap, fast.configs[0].figures) == (
            slow.configs[0].cap,
            slow.configs[0].figures,
        )
        for quick, exact in zip(fast.configs[1].clients, slow.configs[1].clients, strict=True):
            assert quick.offered == exact.offered
            assert abs(quick.admitted_hits - exact.admitted_hits) <= 0.01 * exact.offered_hits
        quick_cap, exact_cap = fast.configs[1].cap, slow.configs[1].cap
        assert quick_cap is not None and exact_cap is not None
        assert abs(quick_cap.max_in_span - exact_cap.max_in_span) <= 0.01 * exact_cap.max_in_span
        assert dataclasses.replace(quick_cap, max_in_span=0) == dataclasses.replace(
            exact_cap, max_in_span=0
        )
        assert fast.configs[1].limiter_calls < slow.configs[1].limiter_calls / 5

    def test_config_flag_replaces_the_scenarios_configs(self, tmp_path: Path) -> None:
        """--config runs the scenario against the given files instead, labelled by name."""
        path = _scenario(tmp_path, [{"name": "a", "rate": 5}])
        code, out, _ = _cli("simulate", str(path), "--config", str(tmp_path / "weighted.yaml"))
        assert code == 0
        assert "[weighted] weighted.yaml: edge/route=public (weighted-fair-queue)" in out
        assert "[global]" not in out


BASE: dict[str, Any] = {
    "name": "broken",
    "duration": 5,
    "domain": "edge",
    "descriptor": [{"key": "client_id", "value": "{client}"}],
    "configs": [{"label": "one", "path": "limits.yaml"}],
    "clients": [{"name": "web-1", "rate": 10}],
}
LIMITS = """
domain: edge
descriptors:
  - {key: client_id, rate_limit: {unit: second, requests_per_unit: 5}}
"""
OTHER = """
domain: api
descriptors:
  - {key: client_id, rate_limit: {unit: second, requests_per_unit: 5}}
"""
UNLIMITED = """
domain: edge
descriptors:
  - {key: route, rate_limit: {unit: second, requests_per_unit: 5}}
"""
DROP = object()  # a field the case removes from BASE

# (case, changes to BASE, the one line expected; {file} and {dir} are filled in)
ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown-key", {"burst": 3}, "{file}: (file): unknown key 'burst'"),
    ("no-name", {"name": DROP}, "{file}: name: is required"),
    ("no-duration", {"duration": DROP}, "{file}: duration: is required"),
    (
        "negative-duration",
        {"duration": -1},
        "{file}: duration: must be a number from 0.01 to 86400, not -1",
    ),
    (
        "uneven-tick",
        {"tick": 0.03},
        "{file}: tick: must be a number that divides 1 s into whole ticks "
        "(0.01, 0.05, 0.1, 1, ...), not 0.03",
    ),
    ("no-domain", {"domain": ""}, "{file}: domain: must be text, not ''"),
    (
        "no-template",
        {"descriptor": DROP},
        "{file}: (file): give the request template as 'descriptor' or 'descriptors'",
    ),
    (
        "no-placeholder",
        {"descriptor": [{"key": "client_id", "value": "web"}]},
        "{file}: descriptor: no value holds the {client} placeholder: "
        "every client would look the same",
    ),
    (
        "entry-without-value",
        {"descriptor": [{"key": "client_id", "value": "{client}"}, {"key": "route"}]},
        "{file}: descriptor[1].value: is required",
    ),
    (
        "empty-descriptors",
        {"descriptor": DROP, "descriptors": []},
        "{file}: descriptors: must be a non-empty list of descriptors",
    ),
    (
        "config-missing",
        {"configs": [{"label": "one", "path": "nope.yaml"}]},
        "{file}: configs[0].path: no such file: {dir}/nope.yaml",
    ),
    (
        "config-label-twice",
        {"configs": [{"label": "one", "path": "limits.yaml"}] * 2},
        "{file}: configs[1].label: duplicate label 'one'",
    ),
    (
        "config-other-domain",
        {"configs": [{"label": "one", "path": "other.yaml"}]},
        "{file}: configs[0].path: {dir}/other.yaml has no domain 'edge' (it has: api)",
    ),
    (
        "config-limits-nothing",
        {"configs": [{"label": "one", "path": "unlimited.yaml"}]},
        "{file}: configs[0].path: no rule in {dir}/unlimited.yaml limits the scenario's "
        "descriptors",
    ),
    (
        "no-configs",
        {"configs": DROP},
        "{file}: configs: no configs to run: name them under 'configs' or pass --config",
    ),
    ("no-clients", {"clients": []}, "{file}: clients: must be a non-empty list of clients"),
    (
        "client-unknown-key",
        {"clients": [{"name": "a", "rate": 1, "burst": 2}]},
        "{file}: clients[0]: unknown key 'burst'",
    ),
    ("client-no-name", {"clients": [{"rate": 1}]}, "{file}: clients[0].name: is required"),
    (
        "client-twice",
        {"clients": [{"name": "a", "rate": 1}, {"name": "a", "rate": 2}]},
        "{file}: clients[1].name: duplicate client 'a'",
    ),
    (
        "client-zero-rate",
        {"clients": [{"name": "a", "rate": 0}]},
        "{file}: clients[0].rate: must be a number above 0, not 0",
    ),
    (
        "client-rate-text",
        {"clients": [{"name": "a", "rate": "fast"}]},
        "{file}: clients[0].rate: must be a number above 0, not 'fast'",
    ),
    (
        "too-much-traffic",
        {"clients": [{"name": "a", "rate": 3_000_000}]},
        "{file}: clients: offer 15000000 requests; a run simulates at most 10000000",
    ),
    (
        "client-stops-late",
        {"clients": [{"name": "a", "rate": 1, "start": 2, "stop": 6}]},
        "{file}: clients[0].stop: must be a number above start (2) up to duration (5), not 6",
    ),
    (
        "client-negative-retries",
        {"clients": [{"name": "a", "rate": 1, "retries": {"max": -1}}]},
        "{file}: clients[0].retries.max: must be an integer from 0 to 1000000, not -1",
    ),
    (
        "client-retries-list",
        {"clients": [{"name": "a", "rate": 1, "retries": [3]}]},
        "{file}: clients[0].retries: must be a mapping, not [3]",
    ),
    (
        "steady-past-the-end",
        {"steady": {"start": 1, "stop": 9}},
        "{file}: steady.stop: must be a number above steady.start (1) up to duration (5), not 9",
    ),
]


def _write_case(tmp_path: Path, changes: dict[str, Any]) -> Path:
    for name, text in (("limits", LIMITS), ("other", OTHER), ("unlimited", UNLIMITED)):
        (tmp_path / f"{name}.yaml").write_text(text)
    body = {**BASE, **changes}
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in body.items() if v is not DROP}))
    return path


class TestScenarioErrors:
    @pytest.mark.parametrize(
        ("changes", "line"), [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS]
    )
    def test_each_broken_scenario_exits_2_with_its_exact_message(
        self, tmp_path: Path, changes: dict[str, Any], line: str
    ) -> None:
        """A scenario with one mistake exits 2 and names it as FILE: PATH: message."""
        path = _write_case(tmp_path, changes)
        code, out, err = _cli("simulate", str(path))
        expected = line.replace("{file}", str(path)).replace("{dir}", str(tmp_path))
        assert (code, out, err.splitlines()) == (2, "", [expected])

    def test_an_unreadable_scenario_exits_2(self, tmp_path: Path) -> None:
        """A missing file exits 2 with a FILE: (file): line."""
        path = tmp_path / "absent.yaml"
        code, _, err = _cli("simulate", str(path))
        assert code == 2
        assert err.startswith(f"{path}: (file): cannot read: ")

    def test_a_scenario_that_is_not_yaml_exits_2(self, tmp_path: Path) -> None:
        """Broken YAML exits 2 naming the line and column."""
        path = tmp_path / "scenario.yaml"
        path.write_text("name: [unclosed\n")
        code, out, err = _cli("simulate", str(path))
        expected = (
            f"{path}: line 2 column 1: invalid YAML: expected ',' or ']', but got '<stream end>'"
        )
        assert (code, out, err.splitlines()) == (2, "", [expected])

    def test_a_scenario_with_a_control_character_is_refused_naming_its_position(
        self, tmp_path: Path
    ) -> None:
        """YAML refuses a control character before parsing: the file and PyYAML's reason, which
        gives the character's position (there is no line and column)."""
        path = tmp_path / "scenario.yaml"
        path.write_text("name: bell\x07\n")
        with pytest.raises(ScenarioError) as caught:
            load_scenario(path)
        assert caught.value.problems == [
            f"{path}: (file): invalid YAML: unacceptable character #x0007: special characters "
            'are not allowed\n  in "<unicode string>", position 10'
        ]

    def test_scenario_problems_are_scenario_errors(self, tmp_path: Path) -> None:
        """Unreadable, not YAML, or wrong: the scenario's problems raise ScenarioError."""
        broken = tmp_path / "broken.yaml"
        broken.write_text("name: [unclosed\n")
        wrong = _write_case(tmp_path, {"tick": 0.3})
        for path in (tmp_path / "absent.yaml", broken, wrong):
            with pytest.raises(ScenarioError):
                load_scenario(path)

    @pytest.mark.parametrize(
        "config", ["descriptors/edge.yaml", "descriptors/scenarios/configs/fairlimit.yaml"]
    )
    def test_a_config_given_as_the_scenario_says_what_a_scenario_needs(self, config: str) -> None:
        """A rate-limit config given where the scenario goes exits 2 with one line naming
        the file, what it is and what a scenario needs (not the template's errors)."""
        code, out, err = _cli("simulate", str(ROOT / config))
        assert (code, out, err.splitlines()) == (2, "", [
            f"{ROOT / config}: (file): a rate-limit config, not a scenario: a scenario needs"
            " name, duration, clients, a request template (descriptor or descriptors, each a"
            " list of {key, value}) and configs (each {label, path}, naming a config like this"
            " one); see 'Writing a scenario' in docs/fair-sharing.md"
        ])  # fmt: skip

    def test_a_scenario_with_a_mistaken_template_is_not_taken_for_a_config(
        self, tmp_path: Path
    ) -> None:
        """A scenario (it has a name, clients, ...) whose descriptors are rules rather than
        lists of {key, value} gets the template's own error."""
        rules = [{"key": "route", "value": "{client}"}]
        path = _write_case(tmp_path, {"descriptor": DROP, "descriptors": rules})
        code, _, err = _cli("simulate", str(path))
        assert code == 2
        assert err.splitlines()[0] == (
            f"{path}: descriptors[0]: must be a non-empty list of {{key, value}}"
        )

    def test_every_file_of_the_scenarios_folder_is_a_scenario(self) -> None:
        """descriptors/scenarios/ holds scenarios only; their configs are in configs/."""
        folder = ROOT / "descriptors" / "scenarios"
        for path in sorted(folder.glob("*.yaml")):
            assert load_scenario(path).configs, path

    def test_a_broken_config_exits_2_with_the_loaders_message(self, tmp_path: Path) -> None:
        """A config the loader rejects exits 2 with the loader's own FILE: PATH: message."""
        path = _write_case(tmp_path, {})
        (tmp_path / "limits.yaml").write_text("domain: edge\ndescriptors: [{key: a, colour: 1}]\n")
        code, _, err = _cli("simulate", str(path))
        assert code == 2
        assert err.splitlines() == [f"{tmp_path}/limits.yaml: edge/a: unknown key 'colour'"]


class TestPlot:
    def test_plot_writes_a_png(self, tmp_path: Path) -> None:
        """--plot OUT.png draws admitted hits per group (needs matplotlib)."""
        require_module("matplotlib", "the plot extra: pip install 'fairlimit[plot]'")
        path = _scenario(tmp_path, [{"name": "a", "rate": 20}, {"name": "b", "rate": 5}])
        out = tmp_path / "out.png"
        code, _, _ = _cli("simulate", str(path), "--plot", str(out))
        assert code == 0
        assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    def test_without_matplotlib_plot_exits_2_naming_the_extra(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without matplotlib, --plot exits 2 before running and says what to install."""
        monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
        path = _scenario(tmp_path, [{"name": "a", "rate": 20}])
        code, out, err = _cli("simulate", str(path), "--plot", str(tmp_path / "out.png"))
        assert (code, out) == (2, "")
        assert "pip install 'fairlimit[plot]'" in err


class TestTotalRow:
    @pytest.mark.parametrize("name", ["on-off", "join-leave", "burst-at-zero"])
    def test_admitted_per_second_is_the_runs_not_a_sum_of_rates(self, name: str) -> None:
        """Clients on for part of the run (on/off cycles, joining, leaving, bursts): the
        total's admitted/s is all admitted over the scenario's duration, within every
        config's cap of 100/s, not the sum of each client's rate over its own active time
        (280/s on on-off's 100/s cap)."""
        code, out, _ = _cli("simulate", str(ROOT / "descriptors" / "scenarios" / f"{name}.yaml"))
        assert code == 0
        scenario = load_scenario(ROOT / "descriptors" / "scenarios" / f"{name}.yaml")
        totals = [line.split() for line in out.splitlines() if line.startswith("total ")]
        assert len(totals) == 2  # one per config
        for cells in totals:
            admitted, per_second = int(cells[3]), float(cells[6])
            assert per_second == pytest.approx(admitted / scenario.duration, abs=0.05)
            assert per_second <= 100.05


# A burst per second, a sliding 5 minutes, a gcra with a burst, a calendar month in a zone.
SEVERAL = (
    """
domain: edge
descriptors:
  - key: generic_key
    value: global
"""
    + FOUR_LIMITS
)


@pytest.fixture(scope="module")
def several(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One minute at 45/s offered: the gcra limit (10/s after its burst) is the binding one."""
    where = tmp_path_factory.mktemp("several")
    (where / "several.yaml").write_text(SEVERAL)
    path = _scenario(where, [{"name": "c", "count": 3, "rate": 15}], duration=60,
                     configs=[{"label": "several", "path": "several.yaml"}])  # fmt: skip
    code, out, err = _cli("simulate", str(path), "--format", "json")
    assert (code, err) == (0, "")
    text = _cli("simulate", str(path))[1]
    return json.loads(out)["configs"][0], text


class TestSeveralLimits:
    """A rule with several limits: each limit is a level of its own, checked against its
    own bound and window, and the report says how each counts."""

    def test_one_level_per_limit_with_its_window_and_algorithm(
        self, several: tuple[dict[str, Any], str]
    ) -> None:
        config, _ = several
        shown = [
            {
                k: c[k]
                for k in ("limit", "window_seconds", "algorithm", "burst", "calendar")
                if k in c
            }
            for c in config["levels"]
        ]
        assert shown == [
            {"limit": 20, "window_seconds": 1, "algorithm": "fixed"},
            {"limit": 3000, "window_seconds": 300, "algorithm": "sliding"},
            {"limit": 600, "window_seconds": 60, "algorithm": "gcra", "burst": 30},
            {"limit": 1000000, "window_seconds": 2592000, "algorithm": "fixed",
             "calendar": "Europe/Berlin"},
        ]  # fmt: skip
        assert config["cap"] == config["levels"][0]

    def test_each_limit_is_checked_against_its_own_bound(
        self, several: tuple[dict[str, Any], str]
    ) -> None:
        """The second's cap is not judged by the minute's count, and gcra may pass its
        burst on top of the limit in one window (docs/semantics.md): neither is exceeded."""
        config, _ = several
        second, _, gcra, _ = config["levels"]
        assert second["max_admitted_in_a_window"] <= 20
        assert 600 < gcra["max_admitted_in_a_window"] <= 630
        assert not any(c["exceeded"] for c in config["levels"])

    def test_the_text_says_how_each_level_counts(self, several: tuple[dict[str, Any], str]) -> None:
        _, text = several
        assert "cap 20 per 1-s window: at most " in text
        assert (
            "  level edge/generic_key=global rate_limits[1]: 3000 per 300-s (sliding), at most "
            in text
        )
        assert (
            "  level edge/generic_key=global rate_limits[2]: 600 per 1-min (gcra, burst 30), "
            "at most " in text
        )
        assert (
            "  level edge/generic_key=global rate_limits[3]: 1000000 per calendar month in "
            "Europe/Berlin, "
            "at most " in text
        )
        assert "EXCEEDED" not in text


# Every request also carries a descriptor whose limit is 0: the cap owes each client its
# share, and nothing is admitted.
BLOCKED = """
domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 10}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: maintenance
    value: "on"
    rate_limit: {unit: second, requests_per_unit: 0}
"""

BLOCKED_SCENARIO = """
name: all-starved
domain: edge
descriptors:
  - [{key: route, value: api}, {key: client_id, value: "{client}"}]
  - [{key: maintenance, value: "on"}]
configs:
  - {label: blocked, path: blocked.yaml}
duration: 10
tick: 0.1
clients:
  - {name: c, count: 3, rate: 5}
"""


class TestEveryClientStarved:
    """Jain's index of all-zero allocations is 0/0: undefined, not 1.00 (issue 37)."""

    @pytest.fixture
    def scenario(self, tmp_path: Path) -> Path:
        (tmp_path / "blocked.yaml").write_text(BLOCKED)
        path = tmp_path / "scenario.yaml"
        path.write_text(BLOCKED_SCENARIO)
        return path

    def test_text_says_undefined(self, scenario: Path) -> None:
        code, out, err = _cli("simulate", str(scenario))
        assert (code, err) == (0, "")
        assert out.splitlines()[-1] == (
            "fairness 1-10 s: Jain undefined (nothing admitted), top client 0%, starved 3/3, "
            "level inf (fits)"
        )

    def test_json_has_no_index(self, scenario: Path) -> None:
        code, out, _ = _cli("simulate", str(scenario), "--format", "json")
        assert code == 0
        fairness = json.loads(out)["configs"][0]["fairness"]
        assert (fairness["jain_index"], fairness["starved_clients"]) == (None, 3)


class TestFairSharingQuotesTheRun:
    """docs/fair-sharing.md's token-budget figures are what `simulate` prints (they had
    drifted from it; issue 37)."""

    def test_the_most_in_a_minute_of_each_config(self) -> None:
        path = ROOT / "descriptors" / "scenarios" / "token-budget.yaml"
        code, out, _ = _cli("simulate", str(path), "--format", "json")
        assert code == 0
        most = {
            c["label"]: c["cap"]["max_admitted_in_a_window"] for c in json.loads(out)["configs"]
        }
        shown = {label: f"{n:,}".replace(",", " ") for label, n in most.items()}
        text = " ".join((ROOT / "docs" / "fair-sharing.md").read_text().split())
        row = (
            f"| token budget, most in a minute | 60 000 | {shown['global-bucket']} | "
            f"{shown['fairlimit']}; {shown['charged-when-over']} with `charge_when_over_limit` |"
        )
        assert row in text
        paragraph = (
            f"({shown['global-bucket']} of 60 000 in a minute behind the global bucket, "
            f"{shown['fairlimit']} behind the cap)"
        )
        assert paragraph in text
        assert f"({shown['charged-when-over']} of 60 000 here)" in text
