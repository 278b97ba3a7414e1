"""Envoy and Istio examples: every config is loaded by a real Envoy (`envoy --mode validate`).

Istio EnvoyFilters cannot be validated by Envoy as they stand, so their patches are applied
to a minimal gateway bootstrap (the way istiod would) and the result is validated.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from envoy_proxy import envoy_in_front, http_get

from .processes import StubRateLimitService

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
# *-descriptors.yaml beside them are fairlimit descriptor files (checked by fairlimit's loader)
ENVOY_EXAMPLES = sorted(
    p for p in (ROOT / "examples" / "envoy").glob("*.yaml") if not p.stem.endswith("-descriptors")
)
ENVOY_EXAMPLE = ROOT / "examples" / "envoy" / "envoy.yaml"
ISTIO_EXAMPLES = sorted((ROOT / "examples" / "istio").glob("ratelimit-*.yaml"))
CHART_VALUES = ROOT / "helm" / "fairlimit" / "values.yaml"
BUNDLED_DESCRIPTORS = ROOT / "descriptors" / "edge.yaml"

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
ROUTER_FILTER = "envoy.filters.http.router"
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
HTTP2_OPTIONS = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}
# The descriptor every example sends: (route=public),(client_id=<x-client-id>), or
# (route=public),(client_id=anonymous) when the header is missing.
ROUTE = {"generic_key": {"descriptor_key": "route", "descriptor_value": "public"}}
EXPECTED_ACTIONS = [
    ROUTE,
    {"request_headers": {"header_name": "x-client-id", "descriptor_key": "client_id"}},
]
ANONYMOUS_ACTIONS = [
    ROUTE,
    {
        "header_value_match": {
            "descriptor_key": "client_id",
            "descriptor_value": "anonymous",
            "expect_match": False,
            "headers": [{"name": "x-client-id", "present_match": True}],
        }
    },
]
EXPECTED_RATE_LIMITS = [{"actions": EXPECTED_ACTIONS}, {"actions": ANONYMOUS_ACTIONS}]
# Placeholder certificate directory of examples/envoy/identity-mtls.yaml.
EXAMPLE_CERTS = "/etc/fairlimit-example/"
# The literal ports of examples/envoy/envoy.yaml that end-to-end tests replace textually.
LISTENER_PORT, RLS_PORT, ADMIN_PORT = 10000, 8081, 9901

RulePath = tuple[tuple[str, str | None], ...]


def with_test_certs(config: Path, tls_files: dict[str, Path], tmp_path: Path) -> Path:
    """The config with the placeholder certificate paths pointing at test certificates."""
    text = config.read_text()
    if EXAMPLE_CERTS not in text:
        return config
    certs = tmp_path / "certs"
    certs.mkdir(exist_ok=True)
    for name in ("server.crt", "server.key", "ca.crt"):
        (certs / name).write_bytes(tls_files[name].read_bytes())
    patched = tmp_path / config.name
    patched.write_text(text.replace(EXAMPLE_CERTS, f"{certs}/"))
    return patched


def validate(envoy: str, config: Path | dict[str, Any], tmp_path: Path) -> None:
    """Fail with Envoy's own message unless `envoy --mode validate` accepts the config."""
    if isinstance(config, dict):
        path = tmp_path / "bootstrap.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    else:
        path = config
    command = [envoy, "--mode", "validate", "--disable-hot-restart", "--log-level", "warn"]
    result = subprocess.run(
        [*command, "-c", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"{path}:\n{result.stdout[-4000:]}{result.stderr[-4000:]}"


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def http_filters(listener: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = listener["filter_chains"][0]["filters"][0]
    assert hcm["name"] == HCM
    filters: list[dict[str, Any]] = hcm["typed_config"]["http_filters"]
    return filters


def virtual_hosts(listener: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hosts: list[dict[str, Any]] = hcm["route_config"]["virtual_hosts"]
    return hosts


def by_name(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(item for item in items if item["name"] == name)


def descriptor_paths(nodes: list[dict[str, Any]], prefix: RulePath = ()) -> set[RulePath]:
    """Every rule path in a descriptor tree, as (key, value-or-None) pairs."""
    paths: set[RulePath] = set()
    for node in nodes:
        path = (*prefix, (node["key"], node.get("value")))
        paths.add(path)
        paths |= descriptor_paths(node.get("descriptors", []), path)
    return paths


def action_path(actions: list[dict[str, Any]]) -> RulePath:
    """The rule path a rate_limits entry reaches: fixed values kept, per-request ones None."""
    path: list[tuple[str, str | None]] = []
    for action in actions:
        if "generic_key" in action:
            generic = action["generic_key"]
            path.append((generic["descriptor_key"], generic["descriptor_value"]))
        elif "header_value_match" in action:
            match = action["header_value_match"]
            path.append((match.get("descriptor_key", "header_match"), match["descriptor_value"]))
        elif "remote_address" in action:
            path.append(("remote_address", None))
        else:
            (kind,) = action
            path.append((action[kind]["descriptor_key"], None))
    return tuple(path)


def reaches(path: RulePath, rules: set[RulePath]) -> bool:
    """Whether a request path hits a rule: a fixed value also matches a value-less rule."""
    return any(
        len(rule) == len(path)
        and all(
            key == rule_key and rule_value in (None, value)
            for (key, value), (rule_key, rule_value) in zip(path, rule, strict=True)
        )
        for rule in rules
    )


class TestEnvoyExample:
    """examples/envoy/: the edge bootstrap that the end-to-end tests put in front of fairlimit."""

    @pytest.mark.parametrize("config", ENVOY_EXAMPLES, ids=lambda p: p.name)
    def test_envoy_accepts_every_example(
        self, envoy: str, config: Path, tmp_path: Path, tls_files: dict[str, Path]
    ) -> None:
        """Each examples/envoy/*.yaml loads in a real Envoy (test certificates for mTLS)."""
        validate(envoy, with_test_certs(config, tls_files, tmp_path), tmp_path)

    def test_ratelimit_filter_runs_before_the_router(self) -> None:
        """The ratelimit filter calls domain edge, fails open, adds X-RateLimit headers."""
        listener = yaml.safe_load(ENVOY_EXAMPLE.read_text())["static_resources"]["listeners"][0]
        names = [f["name"] for f in http_filters(listener)]
        assert names == [RATELIMIT_FILTER, ROUTER_FILTER]
        config = http_filters(listener)[0]["typed_config"]
        assert config["domain"] == "edge"
        assert config["failure_mode_deny"] is False
        assert config["enable_x_ratelimit_headers"] == "DRAFT_VERSION_03"
        assert config["timeout"] == "0.25s"
        service = config["rate_limit_service"]
        assert service["transport_api_version"] == "V3"
        assert service["grpc_service"]["envoy_grpc"]["cluster_name"] == "fairlimit"

    def test_rate_limit_service_cluster_speaks_http2(self) -> None:
        """Cluster fairlimit exists (validate mode does not check it) and uses HTTP/2, with
        Envoy's own stream limit: past 8 calls on a connection Envoy opens another, which
        the kernel may give to another of fairlimit's --workers (bench/workers_envoy.py)."""
        clusters = yaml.safe_load(ENVOY_EXAMPLE.read_text())["static_resources"]["clusters"]
        cluster = by_name(clusters, "fairlimit")
        expected = copy.deepcopy(HTTP2_OPTIONS)
        options = expected["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        options["explicit_http_config"]["http2_protocol_options"] = {"max_concurrent_streams": 8}
        assert cluster["typed_extension_protocol_options"] == expected

    @pytest.mark.parametrize(
        "config", [p for p in ENVOY_EXAMPLES if p.stem != "rlqs"], ids=lambda p: p.name
    )
    def test_a_burst_is_not_failed_by_envoys_circuit_breaker(self, config: Path) -> None:
        """Envoy's default circuit breaker fails calls past 1,024 in flight on a cluster;
        on the rate-limit service's each lets its request through unlimited. Every example
        that sends ShouldRateLimit calls (not RLQS: one stream) raises it far past that
        (tests/e2e/test_e2e_fresh_envoy.py sends 2,000 at once)."""
        clusters = yaml.safe_load(config.read_text())["static_resources"]["clusters"]
        (thresholds,) = by_name(clusters, "fairlimit")["circuit_breakers"]["thresholds"]
        assert thresholds.get("priority", "DEFAULT") == "DEFAULT"
        assert thresholds["max_requests"] >= 100_000
        assert thresholds["max_pending_requests"] >= 100_000

    def test_limited_route_forwards_to_a_cluster(self) -> None:
        """Envoy skips the ratelimit filter on direct_response routes, so the route forwards."""
        listener = yaml.safe_load(ENVOY_EXAMPLE.read_text())["static_resources"]["listeners"][0]
        for host in virtual_hosts(listener):
            for route in host["routes"]:
                assert "route" in route and "direct_response" not in route

    def test_actions_build_a_descriptor_of_the_bundled_config(self) -> None:
        """(route=public),(client_id) is a rule path of descriptors/edge.yaml, domain edge."""
        listener = yaml.safe_load(ENVOY_EXAMPLE.read_text())["static_resources"]["listeners"][0]
        (host,) = virtual_hosts(listener)
        assert host["rate_limits"] == EXPECTED_RATE_LIMITS
        bundled = yaml.safe_load(BUNDLED_DESCRIPTORS.read_text())
        assert bundled["domain"] == "edge"
        for actions in (EXPECTED_ACTIONS, ANONYMOUS_ACTIONS):
            assert reaches(action_path(actions), descriptor_paths(bundled["descriptors"]))

    def test_ports_are_plain_literals(self, envoy: str, tmp_path: Path) -> None:
        """Replacing 10000, 8081 and 9901 textually moves the listener, cluster and admin."""
        config = substituted_example(20000, 28081, 29901)
        validate(envoy, config, tmp_path)
        resources = config["static_resources"]
        assert config["admin"]["address"]["socket_address"]["port_value"] == 29901
        listener = by_name(resources["listeners"], "edge")
        assert listener["address"]["socket_address"]["port_value"] == 20000
        endpoint = by_name(resources["clusters"], "fairlimit")["load_assignment"]["endpoints"][0]
        address = endpoint["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        assert address["port_value"] == 28081


def substituted_example(listener: int, rls: int, admin: int) -> dict[str, Any]:
    text = ENVOY_EXAMPLE.read_text()
    for old, new in ((LISTENER_PORT, listener), (RLS_PORT, rls), (ADMIN_PORT, admin)):
        text = text.replace(str(old), str(new))
    config: dict[str, Any] = yaml.safe_load(text)
    return config


class TestEnvoyExampleOnTheWire:
    """The example, running, in front of a stub rate-limit service."""

    def test_requests_become_edge_descriptors_and_429s(
        self, envoy: str, stub_rls: tuple[StubRateLimitService, int], tmp_path: Path
    ) -> None:
        """x-client-id becomes (route=public),(client_id); none is client "anonymous"; 429s."""
        service, rls_port = stub_rls
        with envoy_in_front(rls_port, tmp_path) as proxy:
            ok = http_get(proxy.url, {"x-client-id": "alice"})
            over = http_get(proxy.url, {"x-client-id": "over"})
            anonymous = http_get(proxy.url, {})
        assert (ok[0], ok[2]) == (200, b"ok\n")
        assert ok[1]["x-ratelimit-limit"].startswith("100")
        assert over[0] == 429
        assert over[1]["x-envoy-ratelimited"] == "true"
        assert (anonymous[0], anonymous[2]) == (200, b"ok\n")
        assert service.calls == [
            ("edge", [[("route", "public"), ("client_id", "alice")]]),
            ("edge", [[("route", "public"), ("client_id", "over")]]),
            ("edge", [[("route", "public"), ("client_id", "anonymous")]]),
        ]


# What istiod gives an ingress gateway before any EnvoyFilter, reduced to what the patches touch.
GATEWAY_BOOTSTRAP = f"""
static_resources:
  listeners:
    - name: 0.0.0.0_8080
      address: {{socket_address: {{address: 127.0.0.1, port_value: 8080}}}}
      filter_chains:
        - filters:
            - name: {HCM}
              typed_config:
                "@type": {HCM_TYPE}
                stat_prefix: outbound_0.0.0.0_8080
                route_config:
                  name: http.8080
                  virtual_hosts:
                    - name: "*:80"
                      domains: ["*"]
                      routes:
                        - match: {{prefix: /}}
                          route: {{cluster: backend}}
                http_filters:
                  - name: {ROUTER_FILTER}
                    typed_config: {{"@type": {ROUTER_TYPE}}}
  clusters: []
"""


def gateway_bootstrap() -> dict[str, Any]:
    bootstrap: dict[str, Any] = yaml.safe_load(GATEWAY_BOOTSTRAP)
    bootstrap["static_resources"]["clusters"].append(static_cluster("backend", 9080))
    return bootstrap


def static_cluster(name: str, port: int, http2: bool = False) -> dict[str, Any]:
    endpoint = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": endpoint}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = copy.deepcopy(HTTP2_OPTIONS)
    return cluster


def apply_envoy_filter(bootstrap: dict[str, Any], envoy_filter: dict[str, Any]) -> None:
    """Apply an EnvoyFilter's patches as istiod would; fail on a patch this cannot model."""
    listener = bootstrap["static_resources"]["listeners"][0]
    for patch in envoy_filter["spec"]["configPatches"]:
        assert patch["match"]["context"] in ("GATEWAY", "SIDECAR_INBOUND")
        kind, operation = patch["applyTo"], patch["patch"]["operation"]
        value = copy.deepcopy(patch["patch"]["value"])
        if (kind, operation) == ("HTTP_FILTER", "INSERT_BEFORE"):
            chain = patch["match"]["listener"]["filterChain"]["filter"]
            assert chain["name"] == HCM
            filters = http_filters(listener)
            anchor = [f["name"] for f in filters].index(chain["subFilter"]["name"])
            filters.insert(anchor, value)
        elif (kind, operation) == ("VIRTUAL_HOST", "MERGE"):
            wanted = patch["match"]["routeConfiguration"]["vhost"].get("name")
            for host in virtual_hosts(listener):
                if wanted in (None, host["name"]):
                    for key, item in value.items():
                        host[key] = [*host.get(key, []), *item] if isinstance(item, list) else item
        else:
            raise AssertionError(f"unmodelled EnvoyFilter patch {kind}/{operation}")


def add_rate_limit_clusters(bootstrap: dict[str, Any]) -> list[str]:
    """Add the clusters the ratelimit filters call, as Istio builds them from the Service."""
    listener = bootstrap["static_resources"]["listeners"][0]
    names = [
        f["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        for f in http_filters(listener)
        if f["name"] == RATELIMIT_FILTER
    ]
    for name in names:
        bootstrap["static_resources"]["clusters"].append(static_cluster(name, 8081, http2=True))
    return names


def istio_examples() -> list[dict[str, Any]]:
    return [doc for path in ISTIO_EXAMPLES for doc in load_yaml_docs(path)]


def patched_gateway(envoy_filters: list[dict[str, Any]]) -> dict[str, Any]:
    bootstrap = gateway_bootstrap()
    for envoy_filter in envoy_filters:
        apply_envoy_filter(bootstrap, envoy_filter)
    add_rate_limit_clusters(bootstrap)
    return bootstrap


class TestIstioExamples:
    """examples/istio/: EnvoyFilters for the ingress gateway, checked through a real Envoy."""

    def test_examples_are_envoy_filters_for_the_ingress_gateway(self) -> None:
        """Both resources are EnvoyFilters selecting istio=ingressgateway in istio-system."""
        docs = istio_examples()
        assert sorted(d["metadata"]["name"] for d in docs) == [
            "fairlimit-ratelimit-actions",
            "fairlimit-ratelimit-filter",
        ]
        for doc in docs:
            assert (doc["apiVersion"], doc["kind"]) == (
                "networking.istio.io/v1alpha3",
                "EnvoyFilter",
            )
            assert doc["metadata"]["namespace"] == "istio-system"
            assert doc["spec"]["workloadSelector"]["labels"] == {"istio": "ingressgateway"}

    def test_patched_gateway_is_valid_envoy_config(self, envoy: str, tmp_path: Path) -> None:
        """The filter inserted before the router and the merged rate_limits load in Envoy."""
        bootstrap = patched_gateway(istio_examples())
        listener = bootstrap["static_resources"]["listeners"][0]
        assert [f["name"] for f in http_filters(listener)] == [RATELIMIT_FILTER, ROUTER_FILTER]
        assert virtual_hosts(listener)[0]["rate_limits"] == EXPECTED_RATE_LIMITS
        validate(envoy, bootstrap, tmp_path)

    def test_a_broken_patch_is_caught(self, envoy: str, tmp_path: Path) -> None:
        """Control: a misspelt action in the merged rate_limits fails validation."""
        filters = istio_examples()
        actions = next(d for d in filters if d["metadata"]["name"].endswith("-actions"))
        value = actions["spec"]["configPatches"][0]["patch"]["value"]
        value["rate_limits"][0]["actions"][1]["request_headers"]["descriptor_keyy"] = "x"
        with pytest.raises(AssertionError, match="descriptor_keyy"):
            validate(envoy, patched_gateway(filters), tmp_path)

    def test_filter_calls_the_chart_service(self) -> None:
        """The cluster is Istio's name for Service fairlimit/fairlimit, port grpc-rls 8081."""
        bootstrap = gateway_bootstrap()
        for envoy_filter in istio_examples():
            apply_envoy_filter(bootstrap, envoy_filter)
        assert add_rate_limit_clusters(bootstrap) == [
            "outbound|8081||fairlimit.fairlimit.svc.cluster.local"
        ]

    def test_filter_matches_the_envoy_example(self) -> None:
        """Same domain, failure mode, timeout and headers as examples/envoy/envoy.yaml."""
        bootstrap = patched_gateway(istio_examples())
        istio = http_filters(bootstrap["static_resources"]["listeners"][0])[0]["typed_config"]
        example = yaml.safe_load(ENVOY_EXAMPLE.read_text())["static_resources"]["listeners"][0]
        plain = http_filters(example)[0]["typed_config"]
        shared = ("@type", "domain", "failure_mode_deny", "timeout", "enable_x_ratelimit_headers")
        for key in shared:
            assert istio[key] == plain[key], key


class TestChartIstioValues:
    """The chart's istio values: the rate_limits it renders are valid Envoy route config.

    test_chart_render.py renders the chart and checks its EnvoyFilters equal examples/istio.
    """

    def test_chart_rate_limits_are_valid_envoy_config(self, envoy: str, tmp_path: Path) -> None:
        """istio.rateLimits from values.yaml, merged into a gateway vhost, loads in Envoy."""
        values = yaml.safe_load(CHART_VALUES.read_text())["istio"]
        filters = istio_examples()
        actions = next(d for d in filters if d["metadata"]["name"].endswith("-actions"))
        patch = actions["spec"]["configPatches"][0]["patch"]
        patch["value"]["rate_limits"] = values["rateLimits"]
        validate(envoy, patched_gateway(filters), tmp_path)

    def test_chart_actions_fit_the_chart_descriptors(self) -> None:
        """Every istio.rateLimits entry reaches a rule of the chart's default descriptors."""
        values = yaml.safe_load(CHART_VALUES.read_text())
        files = values["config"]["descriptors"].values()
        paths = {
            p
            for f in files
            if f["domain"] == values["istio"]["domain"]
            for p in descriptor_paths(f["descriptors"])
        }
        for entry in values["istio"]["rateLimits"]:
            assert reaches(action_path(entry["actions"]), paths)
