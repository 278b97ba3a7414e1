"""Deployment: the chart's values and schema, the rendered chart, and the container recipe.

The chart is rendered by the `helm` binary where it is on PATH, else by Helm's Go SDK through
the `helm-python-sdk` package; with neither, the rendering tests skip. Nothing here talks to
a Docker engine or a Kubernetes cluster.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import free_port

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "fairlimit"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
CHART_README = CHART / "README.md"
EXAMPLE_VALUES = sorted((ROOT / "examples" / "kubernetes").glob("values-*.yaml"))
ISTIO_EXAMPLES = sorted((ROOT / "examples" / "istio").glob("*.yaml"))
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
README = ROOT / "README.md"

RELEASE, NAMESPACE = "fairlimit", "fairlimit"
CONFIG_DIR = "/etc/fairlimit/descriptors"

Values = dict[str, Any]
Manifest = dict[str, Any]


def load_values(path: Path = VALUES) -> Values:
    values: Values = yaml.safe_load(path.read_text()) or {}
    return values


def coalesce(defaults: Values, overrides: Values) -> Values:
    """Helm's merge of user values over chart defaults: maps merge, null deletes a key."""
    merged = copy.deepcopy(defaults)
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = coalesce(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def schema_errors(values: Values) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    return [
        f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(values)
    ]


def schema_leaves(node: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of every value the schema describes, down to free-form maps and lists."""
    if "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[-1]]
    if node.get("additionalProperties") is False and "properties" in node:
        for key, child in node["properties"].items():
            yield from schema_leaves(child, schema, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


def lookup(values: Values, dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"{dotted} has no default in values.yaml"
        node = node[part]
    return node


BAD_VALUES = {
    "negative replicas": ({"replicaCount": -1}, "/replicaCount"),
    "unknown backend scheme": ({"backend": {"url": "mongodb://x"}}, "/backend/url"),
    "unknown top-level key": ({"replicas": 3}, "'replicas' was unexpected"),
    "unknown nested key": ({"server": {"stric": True}}, "'stric' was unexpected"),
    "memory with 3 replicas": ({"replicaCount": 3}, "/replicaCount"),
    "memory with autoscaling": ({"autoscaling": {"enabled": True}}, "/autoscaling/enabled"),
    "memory with 2 workers": ({"server": {"workers": 2}}, "/server/workers"),
    "unknown failure mode": ({"server": {"failureMode": "maybe"}}, "/server/failureMode"),
    "root user": ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    "descriptor without domain": (
        {"config": {"descriptors": {"x.yaml": {"descriptors": []}}}},
        "'domain' is a required property",
    ),
}


class TestValuesSchema:
    """values.schema.json: every value described, bad values rejected before Helm renders."""

    def test_schema_is_valid_draft_07(self) -> None:
        """The schema itself is a valid JSON Schema draft-07 document."""
        schema = json.loads(SCHEMA.read_text())
        assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
        jsonschema.Draft7Validator.check_schema(schema)

    def test_default_values_validate(self) -> None:
        """values.yaml as shipped is valid."""
        assert schema_errors(load_values()) == []

    @pytest.mark.parametrize("path", EXAMPLE_VALUES, ids=lambda p: p.name)
    def test_example_values_validate(self, path: Path) -> None:
        """Each examples/kubernetes values file, merged over the defaults, is valid."""
        assert schema_errors(coalesce(load_values(), load_values(path))) == []

    @pytest.mark.parametrize("case", BAD_VALUES, ids=str)
    def test_bad_values_are_rejected(self, case: str) -> None:
        """Negative replicas, unknown schemes and keys, memory:// beyond one process fail."""
        override, expected = BAD_VALUES[case]
        errors = schema_errors(coalesce(load_values(), override))
        assert any(expected in error for error in errors), errors

    @pytest.mark.parametrize(
        "url",
        [
            "redis://r:6379/0",
            "rediss://:pw@r:6380",
            "redis+sentinel://s:26379/mymaster",
            "redis+cluster://c:6379",
        ],
    )
    def test_redis_backends_allow_many_replicas(self, url: str) -> None:
        """Every Redis scheme is accepted, with several replicas, workers and autoscaling."""
        override = {
            "backend": {"url": url},
            "replicaCount": 3,
            "server": {"workers": 2},
            "autoscaling": {"enabled": True},
        }
        assert schema_errors(coalesce(load_values(), override)) == []

    def test_existing_secret_skips_the_memory_rule(self) -> None:
        """With the URL in an existing Secret the chart cannot see its scheme."""
        override = {"backend": {"existingSecret": "redis-url"}, "replicaCount": 3}
        assert schema_errors(coalesce(load_values(), override)) == []

    def test_every_schema_value_has_a_default(self) -> None:
        """values.yaml sets every value the schema describes (and the schema allows no other)."""
        schema = json.loads(SCHEMA.read_text())
        values = load_values()
        for dotted in schema_leaves(schema, schema):
            lookup(values, dotted)

    def test_readme_documents_every_value(self) -> None:
        """The chart README's values table has a row for every value."""
        schema = json.loads(SCHEMA.read_text())
        readme = CHART_README.read_text()
        missing = [v for v in schema_leaves(schema, schema) if f"| `{v}` |" not in readme]
        assert missing == []


def fairlimit_check(path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "server"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "fairlimit", "check", "--strict", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


class TestChartDescriptors:
    """The descriptors embedded in the chart's default values."""

    def test_default_descriptors_pass_fairlimit_check_strict(self, tmp_path: Path) -> None:
        """Each file in config.descriptors passes `fairlimit check --strict`."""
        files = load_values()["config"]["descriptors"]
        assert files, "the chart ships no descriptors"
        for name, content in files.items():
            path = tmp_path / name
            path.write_text(yaml.safe_dump(content, sort_keys=False))
            result = fairlimit_check(path)
            assert result.returncode == 0, f"{name}:\n{result.stdout}{result.stderr}"

    def test_default_descriptor_is_the_design_example(self) -> None:
        """edge.yaml: route=public capped at 1000/s for 10 clients of 100/s each."""
        (route,) = load_values()["config"]["descriptors"]["edge.yaml"]["descriptors"]
        assert (route["key"], route["value"]) == ("route", "public")
        assert route["rate_limit"] == {"unit": "second", "requests_per_unit": 1000}
        assert route["fair_share"] == {"active_clients": 10}
        (client,) = route["descriptors"]
        assert client == {
            "key": "client_id",
            "rate_limit": {"unit": "second", "requests_per_unit": 100},
        }


class HelmError(Exception):
    """Helm refused the chart or its values."""


class Helm(Protocol):
    def template(
        self, values: Values, release: str = ..., namespace: str = ...
    ) -> list[Manifest]: ...

    def lint(self, values: Values) -> list[str]: ...


class HelmBinary:
    """The helm CLI."""

    def __init__(self, path: str, workdir: Path) -> None:
        self.path, self.workdir = path, workdir

    def _run(self, *args: str, values: Values) -> str:
        values_file = self.workdir / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        result = subprocess.run(
            [self.path, *args, "-f", str(values_file)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            raise HelmError(result.stdout + result.stderr)
        return result.stdout

    def template(
        self, values: Values, release: str = RELEASE, namespace: str = NAMESPACE
    ) -> list[Manifest]:
        out = self._run("template", release, str(CHART), "--namespace", namespace, values=values)
        return [doc for doc in yaml.safe_load_all(out) if doc]

    def lint(self, values: Values) -> list[str]:
        try:
            self._run("lint", "--strict", str(CHART), values=values)
        except HelmError as error:
            return [str(error)]
        return []


class HelmSdk:
    """Helm's Go SDK through helm-python-sdk: the same engine, without the CLI."""

    def __init__(self) -> None:
        from helm_python import chart  # optional; the fixture checked it is installed

        self.chart_module = chart
        self.chart = chart.Chart.load(str(CHART))

    def template(
        self, values: Values, release: str = RELEASE, namespace: str = NAMESPACE
    ) -> list[Manifest]:
        try:
            rendered = self.chart.render(values, name=release, namespace=namespace, is_install=True)
        except Exception as error:  # the SDK raises its own error types for values/templates
            raise HelmError(str(error)) from error
        return [
            doc
            for template, text in sorted(rendered.items())
            if not template.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text)
            if doc
        ]

    def lint(self, values: Values) -> list[str]:
        report = self.chart_module.lint(str(CHART), values, strict=True)
        warnings = [m["error"] for m in report["messages"] if m["severity"] >= 2]
        return [*warnings, *report["errors"]]


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    path = shutil.which("helm")
    if path is not None:
        return HelmBinary(path, tmp_path_factory.mktemp("helm"))
    if importlib.util.find_spec("helm_python") is not None:
        return HelmSdk()
    pytest.skip("helm binary not on PATH (and helm-python-sdk not installed): chart not rendered")


def find(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[Manifest], kind: str) -> Manifest:
    (doc,) = find(docs, kind)
    return doc


def container(docs: list[Manifest]) -> dict[str, Any]:
    (main,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(main)


def flag_values(args: list[str]) -> dict[str, str]:
    """--flag value pairs of a command line (flags without a value are left out)."""
    return {
        flag: value
        for flag, value in itertools.pairwise(args)
        if flag.startswith("--") and not value.startswith("--")
    }


def env_var(docs: list[Manifest], name: str) -> dict[str, Any]:
    return next(dict(e) for e in container(docs)["env"] if e["name"] == name)


class TestChartLint:
    """helm lint --strict."""

    def test_default_values_lint_clean(self, helm: Helm) -> None:
        """The chart with its defaults lints without warnings."""
        assert helm.lint({}) == []

    @pytest.mark.parametrize("path", EXAMPLE_VALUES, ids=lambda p: p.name)
    def test_example_values_lint_clean(self, helm: Helm, path: Path) -> None:
        """The chart with each examples/kubernetes values file lints without warnings."""
        assert helm.lint(load_values(path)) == []

    @pytest.mark.parametrize(
        "case", ["negative replicas", "unknown backend scheme", "unknown top-level key"]
    )
    def test_helm_itself_rejects_bad_values(self, helm: Helm, case: str) -> None:
        """Helm applies values.schema.json: bad values fail before anything is rendered."""
        override, _ = BAD_VALUES[case]
        with pytest.raises(HelmError):
            helm.template(override)


class TestRenderedWorkload:
    """The Deployment and Service that `helm template` produces with default values."""

    @pytest.fixture(scope="class")
    def docs(self, helm: Helm) -> list[Manifest]:
        return helm.template({})

    def test_default_resources(self, docs: list[Manifest]) -> None:
        """Defaults render the workload and nothing optional."""
        assert sorted(doc["kind"] for doc in docs) == [
            "ConfigMap",
            "Deployment",
            "PodDisruptionBudget",
            "Service",
            "ServiceAccount",
        ]
        assert {doc["metadata"]["name"] for doc in docs} == {"fairlimit"}
        assert {doc["metadata"]["namespace"] for doc in docs} == {NAMESPACE}

    def test_service_names_the_grpc_port_for_istio(self, docs: list[Manifest]) -> None:
        """Port grpc-rls 8081 with appProtocol grpc, and http-admin 8080."""
        ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
        assert set(ports) == {"grpc-rls", "http-admin"}
        assert (ports["grpc-rls"]["port"], ports["grpc-rls"]["appProtocol"]) == (8081, "grpc")
        assert ports["http-admin"]["port"] == 8080
        container_ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
        assert container_ports == {"grpc-rls": 8081, "http-admin": 8080}

    def test_serve_arguments(self, docs: list[Manifest]) -> None:
        """fairlimit serves the mounted descriptors, gRPC and admin on all interfaces."""
        args = container(docs)["args"]
        pairs = flag_values(args)
        assert args[0] == "serve"
        assert pairs["--config"] == CONFIG_DIR
        assert pairs["--grpc-addr"] == "0.0.0.0:8081"
        assert pairs["--admin-addr"] == "0.0.0.0:8080"
        assert (pairs["--failure-mode"], pairs["--workers"]) == ("open", "1")
        assert env_var(docs, "FAIRLIMIT_BACKEND") == {
            "name": "FAIRLIMIT_BACKEND",
            "value": "memory://",
        }

    def test_probes(self, docs: list[Manifest]) -> None:
        """Liveness asks gRPC health (service ""), readiness /readyz, startup /healthz."""
        main = container(docs)
        assert main["livenessProbe"]["grpc"] == {"port": 8081, "service": ""}
        assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http-admin"}
        assert main["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http-admin"}

    def test_http_liveness_is_an_option(self, helm: Helm) -> None:
        """probes.liveness.type=http switches liveness to GET /healthz."""
        docs = helm.template({"probes": {"liveness": {"type": "http"}}})
        probe = container(docs)["livenessProbe"]
        assert "grpc" not in probe
        assert probe["httpGet"] == {"path": "/healthz", "port": "http-admin"}

    def test_runs_non_root_on_a_read_only_root(self, docs: list[Manifest]) -> None:
        """uid 10001, read-only root, no privilege escalation, no capabilities, seccomp."""
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        context = container(docs)["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]

    def test_topology_spread(self, docs: list[Manifest]) -> None:
        """Pods spread over zones and nodes, selected by the chart's own labels."""
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
        constraints = pod["topologySpreadConstraints"]
        assert [c["topologyKey"] for c in constraints] == [
            "topology.kubernetes.io/zone",
            "kubernetes.io/hostname",
        ]
        assert all(c["labelSelector"]["matchLabels"] == selector for c in constraints)


class TestRenderedDescriptors:
    """The ConfigMap of descriptors, its mount, and the checksum that rolls pods."""

    def test_configmap_holds_the_descriptors(self, helm: Helm) -> None:
        """Each config.descriptors entry is one ConfigMap key, equal after a YAML round trip."""
        docs = helm.template({})
        data = one(docs, "ConfigMap")["data"]
        expected = load_values()["config"]["descriptors"]
        assert {name: yaml.safe_load(text) for name, text in data.items()} == expected

    def test_configmap_is_mounted_where_serve_reads(self, helm: Helm) -> None:
        """The ConfigMap is mounted as a directory (no subPath) at the --config path."""
        docs = helm.template({})
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        (mount,) = [m for m in container(docs)["volumeMounts"] if m["mountPath"] == CONFIG_DIR]
        assert "subPath" not in mount
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]

    def test_checksum_follows_the_descriptors(self, helm: Helm) -> None:
        """checksum/config changes with the descriptors and is absent with rollOnChange off."""

        def checksum(values: Values) -> str | None:
            template = one(helm.template(values), "Deployment")["spec"]["template"]
            annotations: dict[str, str] = template["metadata"].get("annotations") or {}
            return annotations.get("checksum/config")

        changed = copy.deepcopy(load_values()["config"]["descriptors"])
        changed["edge.yaml"]["descriptors"][0]["rate_limit"]["requests_per_unit"] = 2000
        before = checksum({})
        assert before is not None
        assert checksum({"config": {"descriptors": changed}}) not in (None, before)
        assert checksum({"config": {"rollOnChange": False}}) is None

    def test_existing_configmap_replaces_the_chart_one(self, helm: Helm) -> None:
        """config.existingConfigMap: no ConfigMap rendered, the named one mounted."""
        docs = helm.template({"config": {"existingConfigMap": "my-descriptors"}})
        assert find(docs, "ConfigMap") == []
        volumes = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
        assert {"name": "descriptors", "configMap": {"name": "my-descriptors"}} in volumes


class TestRenderedScaling:
    """replicaCount, the HPA, the PDB, and the backend URL they depend on."""

    def test_replica_count_without_autoscaling(self, helm: Helm) -> None:
        """replicaCount lands on the Deployment; no HPA is rendered."""
        docs = helm.template({"backend": {"url": "redis://r:6379"}, "replicaCount": 4})
        assert one(docs, "Deployment")["spec"]["replicas"] == 4
        assert find(docs, "HorizontalPodAutoscaler") == []

    def test_autoscaling_owns_the_replica_count(self, helm: Helm) -> None:
        """Autoscaling on: an autoscaling/v2 HPA targets the Deployment, which has no replicas."""
        values = {"backend": {"url": "redis://r:6379"}, "autoscaling": {"enabled": True}}
        docs = helm.template(values)
        hpa = one(docs, "HorizontalPodAutoscaler")
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
        assert "replicas" not in one(docs, "Deployment")["spec"]

    def test_redis_example_values(self, helm: Helm) -> None:
        """values-redis.yaml: HPA 3..12, PDB minAvailable 2, URL from the existing Secret."""
        docs = helm.template(load_values(ROOT / "examples/kubernetes/values-redis.yaml"))
        hpa = one(docs, "HorizontalPodAutoscaler")
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
        assert one(docs, "PodDisruptionBudget")["spec"] == {
            "minAvailable": 2,
            "selector": one(docs, "Deployment")["spec"]["selector"],
        }
        assert env_var(docs, "FAIRLIMIT_BACKEND")["valueFrom"]["secretKeyRef"] == {
            "name": "fairlimit-redis",
            "key": "url",
        }
        assert find(docs, "Secret") == []

    def test_memory_example_values(self, helm: Helm) -> None:
        """values-memory.yaml: one replica, no HPA, no PDB."""
        docs = helm.template(load_values(ROOT / "examples/kubernetes/values-memory.yaml"))
        assert one(docs, "Deployment")["spec"]["replicas"] == 1
        assert find(docs, "HorizontalPodAutoscaler") == find(docs, "PodDisruptionBudget") == []

    def test_backend_url_goes_through_a_secret(self, helm: Helm) -> None:
        """A Redis URL is stored in Secret <fullname>-backend, never in the pod spec."""
        url = "rediss://:s3cret@redis:6380/0"
        docs = helm.template({"backend": {"url": url}})
        assert one(docs, "Secret")["stringData"] == {"url": url}
        assert one(docs, "Secret")["metadata"]["name"] == "fairlimit-backend"
        assert env_var(docs, "FAIRLIMIT_BACKEND")["valueFrom"]["secretKeyRef"] == {
            "name": "fairlimit-backend",
            "key": "url",
        }
        assert "s3cret" not in yaml.safe_dump(one(docs, "Deployment"))


def istio_example_docs() -> list[Manifest]:
    return [doc for p in ISTIO_EXAMPLES for doc in yaml.safe_load_all(p.read_text()) if doc]


class TestRenderedOptionalResources:
    """ServiceMonitor, NetworkPolicy and the Istio EnvoyFilters, each behind its switch."""

    def test_service_monitor_scrapes_admin_metrics(self, helm: Helm) -> None:
        """serviceMonitor.enabled: monitoring.coreos.com/v1 scraping http-admin /metrics."""
        docs = helm.template({"serviceMonitor": {"enabled": True, "labels": {"release": "p"}}})
        monitor = one(docs, "ServiceMonitor")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "p"
        (endpoint,) = monitor["spec"]["endpoints"]
        assert (endpoint["port"], endpoint["path"]) == ("http-admin", "/metrics")

    def test_network_policy_admits_only_the_listed_peers(self, helm: Helm) -> None:
        """networkPolicy.enabled: gRPC from istio-system only; admin closed unless listed."""
        docs = helm.template({"networkPolicy": {"enabled": True}})
        policy = one(docs, "NetworkPolicy")["spec"]
        assert policy["policyTypes"] == ["Ingress"]
        (rule,) = policy["ingress"]
        assert rule["ports"] == [{"port": "grpc-rls", "protocol": "TCP"}]
        assert rule["from"] == load_values()["networkPolicy"]["grpcFrom"]

    def test_istio_filters_equal_the_examples(self, helm: Helm) -> None:
        """istio.enabled renders exactly examples/istio (names, namespace and spec)."""
        rendered = find(helm.template({"istio": {"enabled": True}}), "EnvoyFilter")

        def key(doc: Manifest) -> tuple[str, str, Any]:
            meta = doc["metadata"]
            return meta["namespace"], meta["name"], doc["spec"]

        assert sorted(map(key, rendered), key=str) == sorted(
            map(key, istio_example_docs()), key=str
        )

    def test_istio_cluster_follows_release_and_namespace(self, helm: Helm) -> None:
        """Another release and namespace change the Service name and Istio's cluster name."""
        docs = helm.template({"istio": {"enabled": True}}, release="rl", namespace="edge")
        service = one(docs, "Service")["metadata"]
        assert (service["name"], service["namespace"]) == ("rl-fairlimit", "edge")
        (envoy_filter,) = [
            d
            for d in find(docs, "EnvoyFilter")
            if d["metadata"]["name"].endswith("-ratelimit-filter")
        ]
        patch = envoy_filter["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
        grpc_service = patch["rate_limit_service"]["grpc_service"]["envoy_grpc"]
        assert grpc_service["cluster_name"] == "outbound|8081||rl-fairlimit.edge.svc.cluster.local"
        assert envoy_filter["metadata"]["namespace"] == "istio-system"


def deploy_section() -> str:
    """The README from its "## Deploy" heading to the next second-level heading."""
    text = README.read_text()
    start = text.index("\n## Deploy\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


class TestDeployDoc:
    """The README's Deploy section: no name left to guess."""

    def test_names_every_resource_the_walkthrough_creates(self, helm: Helm) -> None:
        """Each resource of the install with istio.enabled, and the Istio cluster, is named."""
        text = deploy_section()
        docs = helm.template({"istio": {"enabled": True}})
        for doc in docs:
            meta = doc["metadata"]
            assert f"`{meta['name']}`" in text, f"{doc['kind']} {meta['name']}"
            assert f"namespace `{meta['namespace']}`" in text, meta["namespace"]
        assert "outbound|8081||fairlimit.fairlimit.svc.cluster.local" in text
        assert "helm install fairlimit ./helm/fairlimit -n fairlimit --create-namespace" in text

    def test_files_it_mentions_exist(self) -> None:
        """Every repository path the section points to is there."""
        text = deploy_section()
        paths = set(re.findall(r"(?:examples|helm|docs)/[\w./-]+\w", text))
        assert paths, "no paths found"
        assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in logical]


def runtime_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[last_from:]


def dockerignore_patterns() -> list[tuple[bool, str]]:
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            patterns.append((negated, line.lstrip("!").strip("/")))
    return patterns


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore glob: * and ? stay within a path segment, ** crosses them."""
    out = ""
    for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
        out += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
    return re.compile(out + r"\Z")


def excluded_from_context(path: str) -> bool:
    """Whether `docker build .` leaves path out: the last pattern matching it or a parent wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, pattern in dockerignore_patterns():
        if any(pattern_regex(pattern).match(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, int]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def healthcheck_command(port: int) -> list[str]:
    """The image's HEALTHCHECK, run by this interpreter against port instead of 8081."""
    (args,) = [a for op, a in runtime_stage() if op == "HEALTHCHECK"]
    command: list[str] = json.loads(args.split(" CMD ", 1)[1])
    assert command[0] == "python"
    return [
        sys.executable,
        *(part.replace("127.0.0.1:8081", f"127.0.0.1:{port}") for part in command[1:]),
    ]


class TestDockerfile:
    """The container recipe (not built here: no Docker engine on this machine)."""

    def test_multi_stage_on_python_3_11_slim(self) -> None:
        """A builder and a runtime stage, both from python:3.11-slim by default."""
        instructions = dockerfile_instructions()
        froms = [args for op, args in instructions if op == "FROM"]
        assert froms == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]
        assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in instructions
        assert any(
            op == "COPY" and args.startswith("--from=builder") for op, args in runtime_stage()
        )

    def test_builder_installs_the_repository(self) -> None:
        """The builder runs `pip install .` into the venv the runtime copies."""
        runs = [args for op, args in dockerfile_instructions() if op == "RUN"]
        assert "/opt/fairlimit/bin/pip install ." in runs

    def test_builder_copies_what_the_package_build_reads(self) -> None:
        """pyproject's data-files sources are copied before `pip install .` runs."""
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())
        data_files = project.get("tool", {}).get("setuptools", {}).get("data-files", {})
        needed = {Path(g).parts[0] for globs in data_files.values() for g in globs}
        instructions = dockerfile_instructions()
        install = instructions.index(("RUN", "/opt/fairlimit/bin/pip install ."))
        copied = {
            Path(source).parts[0]
            for op, args in instructions[:install]
            if op == "COPY" and not args.startswith("--from")
            for source in args.split()[:-1]
        }
        assert needed <= copied
        assert {"pyproject.toml", "README.md", "server"} <= copied

    def test_runs_as_a_numeric_non_root_user(self) -> None:
        """The runtime's USER is uid 10001, numeric so that runAsNonRoot can verify it."""
        users = [args for op, args in runtime_stage() if op == "USER"]
        assert users[-1].split(":")[0] == "10001"

    def test_exposes_grpc_and_admin(self) -> None:
        """EXPOSE 8081 (gRPC) and 8080 (admin)."""
        exposed = {p for op, args in runtime_stage() if op == "EXPOSE" for p in args.split()}
        assert {"8081", "8080"} <= exposed

    def test_entrypoint_serves_with_admin_reachable(self) -> None:
        """ENTRYPOINT fairlimit, CMD serve with the admin port on all interfaces."""
        stage = dict(runtime_stage())
        assert json.loads(stage["ENTRYPOINT"]) == ["fairlimit"]
        assert json.loads(stage["CMD"]) == ["serve", "--admin-addr", "0.0.0.0:8080"]

    def test_writes_no_bytecode_and_finds_its_descriptors(self) -> None:
        """PYTHONDONTWRITEBYTECODE=1, and FAIRLIMIT_CONFIG names the baked-in descriptors."""
        env = " ".join(args for op, args in runtime_stage() if op == "ENV")
        assert "PYTHONDONTWRITEBYTECODE=1" in env
        assert f"FAIRLIMIT_CONFIG={CONFIG_DIR}" in env
        assert ("COPY", f"descriptors {CONFIG_DIR}") in runtime_stage()

    def test_build_context_keeps_what_the_build_copies(self) -> None:
        """.dockerignore keeps the copied sources and drops tests, charts and caches."""
        copied = [
            "pyproject.toml",
            "README.md",
            "server/fairlimit/__init__.py",
            "descriptors/edge.yaml",
        ]
        dropped = [
            ".git/HEAD",
            "tests/test_deploy.py",
            "helm/fairlimit/values.yaml",
            "server/fairlimit/__pycache__/cli.cpython-311.pyc",
            ".venv/bin/python",
        ]
        assert [p for p in copied if excluded_from_context(p)] == []
        assert [p for p in dropped if not excluded_from_context(p)] == []

    def test_copied_sources_exist(self) -> None:
        """Every COPY source outside --from exists in the repository."""
        for op, args in dockerfile_instructions():
            if op == "COPY" and not args.startswith("--from"):
                for source in args.split()[:-1]:
                    assert (ROOT / source).exists(), f"COPY {source}: missing"

    def test_healthcheck_follows_grpc_health(
        self, health_server: tuple[health.HealthServicer, int]
    ) -> None:
        """The HEALTHCHECK passes while health "" is SERVING and fails once it is not."""
        servicer, port = health_server
        command = healthcheck_command(port)

        def run() -> int:
            return subprocess.run(command, capture_output=True, timeout=30, check=False).returncode

        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run() == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run() == 1


def grpc_health(port: int, timeout: float) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="")
        response = health_pb2_grpc.HealthStub(channel).Check(
            request, timeout=timeout, wait_for_ready=True
        )
        status: int = response.status
        return status


def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, as Kubernetes sends it; the process's output (killed after 20 s)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[0] + "\n(no exit within 20 s of SIGTERM: killed)"


@contextlib.contextmanager
def running_fairlimit(args: list[str], env: dict[str, str], grpc_port: int) -> Iterator[None]:
    """`python -m fairlimit ARGS` from this checkout, up (gRPC health SERVING) until exit.

    Leaving the block sends SIGTERM and requires a clean exit, as Kubernetes would.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "fairlimit", *args],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT / "server")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        status = grpc_health(grpc_port, timeout=20)
    except grpc.RpcError:
        status = None
    except BaseException:
        stop(process)
        raise
    if status != health_pb2.HealthCheckResponse.SERVING:
        raise AssertionError(f"fairlimit never served:\n{stop(process)}")
    try:
        yield
    finally:
        output = stop(process)
    assert process.returncode == 0, output


def kubelet_configmap_mount(target: Path, files: dict[str, str]) -> Path:
    """Lay files out as the kubelet mounts a ConfigMap: NAME -> ..data/NAME -> ..<ts>/NAME."""
    target.mkdir()
    for name in files:
        (target / name).symlink_to(Path("..data") / name)
    kubelet_configmap_update(target, files, "..2026_01_01_00_00_00.000000001")
    return target


def kubelet_configmap_update(target: Path, files: dict[str, str], stamp: str) -> None:
    """Publish new contents as the kubelet does: a new directory, then an atomic ..data swap."""
    (target / stamp).mkdir()
    for name, text in files.items():
        (target / stamp / name).write_text(text)
    (target / "..data_tmp").symlink_to(stamp)
    (target / "..data_tmp").rename(target / "..data")


def client_limit(port: int, client: str) -> int:
    """The current_limit fairlimit reports for (route=public),(client_id=client) in edge."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = rls_pb2.RateLimitRequest(domain="edge", hits_addend=0)
        descriptor = request.descriptors.add()
        descriptor.entries.add(key="route", value="public")
        descriptor.entries.add(key="client_id", value=client)
        response = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=5)
        limit: int = response.statuses[0].current_limit.requests_per_unit
        return limit


def http_status(url: str, deadline: float) -> int | str:
    """The status of GET url, retried while nothing listens yet; the last error at deadline."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                status: int = response.status
                return status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError as error:
            if time.monotonic() > deadline:
                return f"{error}"
            time.sleep(0.05)


class TestRenderedCommandRunsHere:
    """The Deployment's container command, run against this checkout's fairlimit."""

    @pytest.fixture
    def pod(self, helm: Helm, tmp_path: Path) -> Iterator[tuple[Manifest, int, int]]:
        """Rendered args and env, with ports moved to free ones and the ConfigMap mounted."""
        docs = helm.template({})
        files = one(docs, "ConfigMap")["data"]
        mount = kubelet_configmap_mount(tmp_path / "descriptors", files)
        grpc_port, admin_port = free_port(), free_port()
        main = container(docs)
        replace = {
            CONFIG_DIR: str(mount),
            "0.0.0.0:8081": f"127.0.0.1:{grpc_port}",
            "0.0.0.0:8080": f"127.0.0.1:{admin_port}",
        }
        main["args"] = [replace.get(arg, arg) for arg in main["args"]]
        yield main, grpc_port, admin_port

    def test_container_serves_the_configmap(self, pod: tuple[Manifest, int, int]) -> None:
        """The args start fairlimit on the mounted ConfigMap; liveness passes; SIGTERM exits 0."""
        main, grpc_port, _ = pod
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        with running_fairlimit(main["args"], env, grpc_port):
            assert grpc_health(grpc_port, timeout=5) == health_pb2.HealthCheckResponse.SERVING

    def test_configmap_update_is_hot_reloaded(
        self, pod: tuple[Manifest, int, int], tmp_path: Path
    ) -> None:
        """A kubelet-style ConfigMap update (..data swap) reaches the running server."""
        main, grpc_port, _ = pod
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        edge = copy.deepcopy(load_values()["config"]["descriptors"]["edge.yaml"])
        edge["descriptors"][0]["descriptors"][0]["rate_limit"]["requests_per_unit"] = 50
        with running_fairlimit(main["args"], env, grpc_port):
            assert client_limit(grpc_port, "alice") == 100
            mount = tmp_path / "descriptors"
            kubelet_configmap_update(
                mount, {"edge.yaml": yaml.safe_dump(edge)}, "..2026_01_01_00_01_00.000000001"
            )
            deadline = time.monotonic() + 10
            while client_limit(grpc_port, "alice") != 50 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client_limit(grpc_port, "alice") == 50

    def test_http_probes_answer(self, pod: tuple[Manifest, int, int]) -> None:
        """The startup and readiness probe paths answer 200 on the admin port."""
        main, grpc_port, admin_port = pod
        env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
        with running_fairlimit(main["args"], env, grpc_port):
            for probe in ("startupProbe", "readinessProbe"):
                path = main[probe]["httpGet"]["path"]
                status = http_status(f"http://127.0.0.1:{admin_port}{path}", time.monotonic() + 5)
                assert status == 200, f"{probe} GET {path}: {status}"


class TestImageCommandRunsHere:
    """The image's ENTRYPOINT, CMD and ENV, run against this checkout's fairlimit."""

    def test_image_command_passes_its_healthcheck(self) -> None:
        """`fairlimit serve --admin-addr ...` with the image's FAIRLIMIT_CONFIG serves."""
        stage = dict(runtime_stage())
        assert json.loads(stage["ENTRYPOINT"]) == ["fairlimit"]
        grpc_port, admin_port = free_port(), free_port()
        args = [
            a.replace("0.0.0.0:8080", f"127.0.0.1:{admin_port}") for a in json.loads(stage["CMD"])
        ]
        env = {
            # The image copies descriptors/ to FAIRLIMIT_CONFIG; here the checkout's copy.
            "FAIRLIMIT_CONFIG": str(ROOT / "descriptors"),
            "FAIRLIMIT_GRPC_ADDR": f"127.0.0.1:{grpc_port}",
        }
        with running_fairlimit(args, env, grpc_port):
            result = subprocess.run(
                healthcheck_command(grpc_port), capture_output=True, timeout=30, check=False
            )
            assert result.returncode == 0, result.stderr
