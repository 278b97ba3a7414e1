"""The chart as `helm lint --strict` and `helm template` see it (helm v3 binary)."""

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helpers import (
    EXAMPLE_VALUES,
    NAMESPACE,
    ROOT,
    Helm,
    HelmError,
    Manifest,
    Values,
    container,
    env_var,
    find,
    flag_values,
    load_values,
    one,
)
from .test_chart_schema import BAD_VALUES

pytestmark = pytest.mark.unit

ISTIO_EXAMPLES = sorted((ROOT / "examples" / "istio").glob("ratelimit-*.yaml"))
CONFIG_DIR = "/etc/fairlimit/descriptors"


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


@pytest.fixture(scope="module")
def docs(helm: Helm) -> list[Manifest]:
    """The chart rendered with its default values."""
    return helm.template({})


class TestRenderedWorkload:
    """The Deployment and Service that `helm template` produces with default values."""

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
        """Port grpc-rls 8081 with appProtocol grpc; the admin port stays off the Service."""
        ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
        assert set(ports) == {"grpc-rls"}
        assert (ports["grpc-rls"]["port"], ports["grpc-rls"]["appProtocol"]) == (8081, "grpc")
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
        """networkPolicy.grpcFrom: gRPC from those peers only; admin closed unless listed."""
        peers = [{"namespaceSelector": {"matchLabels": {"team": "edge"}}}]
        docs = helm.template({"networkPolicy": {"enabled": True, "grpcFrom": peers}})
        policy = one(docs, "NetworkPolicy")["spec"]
        assert policy["policyTypes"] == ["Ingress"]
        (rule,) = policy["ingress"]
        assert rule["ports"] == [{"port": "grpc-rls", "protocol": "TCP"}]
        assert rule["from"] == peers

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
