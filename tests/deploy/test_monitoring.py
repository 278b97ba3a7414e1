"""examples/monitoring: the alert rules (promtool) and the dashboard, against real /metrics.

promtool comes from Debian's `prometheus` package (tests/run.sh takes it out into .tools/bin
without installing the package, which would start a Prometheus server).
"""

import json
import re
import subprocess
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from helpers import STARTUP_SECONDS, require
from servers import ServerProcess, fairlimit_server, free_port

from .helpers import CHART, ROOT, Helm, one
from .processes import ready_status

pytestmark = pytest.mark.process

MONITORING = ROOT / "examples" / "monitoring"
ALERTS = MONITORING / "alerts.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERT_TESTS = Path(__file__).parent / "promtool" / "alerts_test.yaml"
METRIC = re.compile(r"\b(?:fairlimit|ratelimit)_[a-z_]+\b")
# Traffic that makes every per-rule counter and every cap figure appear: a contended
# fair-share cap (batch takes all it can), and a shadow rule that goes over its limit.
CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 20}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: route
    value: dry-run
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"""


def promtool() -> str:
    return require("promtool", "from Debian's prometheus package; bash tests/run.sh extracts it")


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, check=False
    )


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_exprs() -> list[str]:
    return [
        target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])
    ]


class TestAlertRules:
    def test_run_sh_takes_promtool_without_installing_prometheus(self) -> None:
        """tests/run.sh never apt-get installs `prometheus` (on a systemd machine that also
        starts a Prometheus server): promtool is taken out of the downloaded package."""
        text = (ROOT / "tests" / "run.sh").read_text()
        assert "missing+=(prometheus)" not in text
        assert not re.search(r"apt-get install[^\n]*prometheus", text)
        assert "apt-get download -q prometheus" in text
        assert "dpkg-deb -x" in text and "cp .tools/deb/root/usr/bin/promtool .tools/bin/" in text

    def test_promtool_checks_the_rules(self) -> None:
        """`promtool check rules` accepts alerts.yaml and the chart's copy."""
        for path in (ALERTS, CHART / "files" / "alerts.yaml"):
            result = run_promtool("check", "rules", str(path))
            assert result.returncode == 0, result.stdout + result.stderr

    def test_promtool_unit_tests_pass(self) -> None:
        """`promtool test rules`: each alert fires on its case and not on the near miss."""
        result = run_promtool("test", "rules", str(ALERT_TESTS))
        assert result.returncode == 0, result.stdout + result.stderr

    def test_every_alert_is_unit_tested(self) -> None:
        """Each alert of alerts.yaml is the subject of a promtool test case."""
        cases = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        tested = {c["alertname"] for case in cases for c in case.get("alert_rule_test", [])}
        assert {rule["alert"] for rule in alert_rules()} == tested

    def test_the_alerts_the_issue_asks_for(self) -> None:
        """Starving cap, fail-open answers, backend down, reload failed, p99 near the timeout."""
        names = {rule["alert"] for rule in alert_rules()}
        assert {
            "FairlimitCapStarvingClients",
            "FairlimitFailingOpen",
            "FairlimitBackendDown",
            "FairlimitConfigReloadFailed",
            "FairlimitLatencyNearEnvoyTimeout",
        } <= names

    def test_chart_ships_the_same_rules(self, helm: Helm) -> None:
        """prometheusRule.enabled renders a PrometheusRule with exactly alerts.yaml's groups."""
        assert (CHART / "files" / "alerts.yaml").read_text() == ALERTS.read_text()
        rule = one(helm.template({"prometheusRule": {"enabled": True}}), "PrometheusRule")
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        assert rule["spec"] == yaml.safe_load(ALERTS.read_text())


class TestDashboard:
    def test_is_a_grafana_dashboard_with_prometheus_targets(self) -> None:
        """Panels, a datasource variable, and a PromQL expression behind every chart."""
        board = dashboard()
        assert board["title"] == "fairlimit" and board["uid"] == "fairlimit"
        names = [v["name"] for v in board["templating"]["list"]]
        assert names == ["datasource", "domain", "rule"]
        charts = [p for p in board["panels"] if p["type"] != "row"]
        assert charts and all(p["targets"] for p in charts)

    def test_shows_what_the_issue_asks_for(self) -> None:
        """Jain, starved, top share, λ, utilisation, decisions, latency, errors, fail-open."""
        text = " ".join(dashboard_exprs())
        for metric in (
            "fairlimit_cap_jain_index_ratio",
            "fairlimit_cap_starved_clients",
            "fairlimit_cap_top_client_share_ratio",
            "fairlimit_cap_fair_share_level_per_second",
            "fairlimit_cap_utilization_ratio",
            "ratelimit_over_limit_total",
            "fairlimit_rpc_duration_seconds_bucket",
            "fairlimit_backend_errors_total",
        ):
            assert metric in text, metric
        titles = [p["title"] for p in dashboard()["panels"]]
        assert any("Fail-open" in title for title in titles)

    def test_every_expression_is_valid_promql(self, tmp_path: Path) -> None:
        """Each panel's query parses: promtool checks them as recording rules."""
        rules = [
            {"record": f"dashboard:panel_{i}", "expr": expr.replace("$__rate_interval", "5m")}
            for i, expr in enumerate(dashboard_exprs())
        ]
        path = tmp_path / "dashboard-rules.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        result = run_promtool("check", "rules", str(path))
        assert result.returncode == 0, result.stdout + result.stderr


def exported(port: int) -> set[str]:
    """The sample names of the admin /metrics, once the admin server answers /healthz."""
    assert (
        ready_status(f"http://127.0.0.1:{port}/healthz", time.monotonic() + STARTUP_SECONDS) == 200
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def send(target: str, route: str, client: str, count: int) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for _ in range(count):
            request = rls_pb2.RateLimitRequest(domain="edge")
            descriptor = request.descriptors.add()
            descriptor.entries.add(key="route", value=route)
            if client:
                descriptor.entries.add(key="client_id", value=client)
            stub.ShouldRateLimit(request, timeout=5)


def names_after_traffic(server: ServerProcess, port: int, wanted: set[str]) -> set[str]:
    """Send contended traffic until /metrics shows every wanted name (or 20 s pass).

    The cap figures appear after a full fairness period (1 s) has been seen, so this
    waits on the figures themselves, not on a clock.
    """
    names: set[str] = set()
    deadline = time.monotonic() + 20
    while not wanted <= names and time.monotonic() < deadline:
        send(server.target, "public", "batch", 30)
        send(server.target, "public", "alice", 3)
        send(server.target, "dry-run", "", 2)
        names |= exported(port)
    return names


@pytest.fixture(scope="module")
def used_metrics() -> set[str]:
    exprs = [rule["expr"] for rule in alert_rules()] + dashboard_exprs()
    return {name for expr in exprs for name in METRIC.findall(expr)}


class TestEveryMetricIsExported:
    def test_dashboard_and_alerts_name_only_exported_metrics(
        self, used_metrics: set[str], tmp_path: Path
    ) -> None:
        """A real server, after traffic (and one with its Redis gone), exports every name used."""
        config = tmp_path / "edge.yaml"
        config.write_text(textwrap.dedent(CONFIG))
        wanted = used_metrics - {"fairlimit_backend_errors_total"}
        port = free_port()  # the admin address is given, not read from the log
        with fairlimit_server(
            "--config", str(config), "--admin-addr", f"127.0.0.1:{port}"
        ) as server:
            names = names_after_traffic(server, port, wanted)
        dead_redis = f"redis://127.0.0.1:{free_port()}/0"
        port = free_port()
        args = [
            "--config",
            str(config),
            "--backend",
            dead_redis,
            "--admin-addr",
            f"127.0.0.1:{port}",
        ]
        with fairlimit_server(*args) as server:
            send(server.target, "public", "alice", 1)
            names |= exported(port)
        assert sorted(used_metrics - names) == []
