"""The chart's escape hatches and cross-value rules, as `helm template` renders them."""

import pytest
import yaml

from .helpers import (
    CHART_README,
    Helm,
    HelmError,
    Manifest,
    Values,
    container,
    find,
    flag_values,
    one,
    pod_spec,
)

pytestmark = pytest.mark.unit

MEMORY_WHY = "the memory:// backend keeps its counters inside one process"


def volume_names(docs: list[Manifest]) -> set[str]:
    return {v["name"] for v in pod_spec(docs)["volumes"]}


def mounts(docs: list[Manifest]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}


class TestRenderTimeRules:
    """Rules across values fail the render with a sentence that says why."""

    @pytest.mark.parametrize(
        ("values", "start"),
        [
            ({"replicaCount": 3}, "replicaCount is 3 with backend.url memory://: "),
            ({"autoscaling": {"enabled": True}}, "autoscaling.enabled with backend.url memory://"),
            ({"server": {"workers": 2}}, "server.workers is 2 with backend.url memory://: "),
        ],
        ids=["replicas", "autoscaling", "workers"],
    )
    def test_memory_backend_beyond_one_process_says_why(
        self, helm: Helm, values: Values, start: str
    ) -> None:
        """memory:// with more than one process: refused, naming the value and the reason."""
        with pytest.raises(HelmError) as refused:
            helm.template(values)
        assert start in str(refused.value) and MEMORY_WHY in str(refused.value)
        assert "use a redis:// backend" in str(refused.value).lower()

    @pytest.mark.parametrize(
        "backend",
        [
            {"url": "redis://r:6379/0"},
            {"url": "rediss://:pw@r:6380"},
            {"url": "redis+sentinel://s:26379/mymaster"},
            {"url": "redis+cluster://c:6379"},
            {"existingSecret": "redis-url"},
        ],
        ids=["redis", "rediss", "sentinel", "cluster", "existing-secret"],
    )
    def test_redis_backends_allow_many_processes(self, helm: Helm, backend: Values) -> None:
        """Every Redis scheme (or a URL in a Secret) renders with replicas, workers, an HPA."""
        values = {"backend": backend, "replicaCount": 3, "server": {"workers": 2}}
        assert one(helm.template(values), "Deployment")["spec"]["replicas"] == 3
        hpa = helm.template({**values, "autoscaling": {"enabled": True}})
        assert find(hpa, "HorizontalPodAutoscaler")

    def test_local_failure_mode_passes_the_pod_count(self, helm: Helm) -> None:
        """failureMode local: --replicas is replicaCount, or minReplicas under an HPA (the
        processes the others see count too); no --replicas otherwise."""
        redis = {"backend": {"url": "redis://r:6379/0"}, "replicaCount": 3}
        local = {**redis, "server": {"failureMode": "local", "workers": 2}}
        pairs = flag_values(container(helm.template(local))["args"])
        assert (pairs["--failure-mode"], pairs["--replicas"]) == ("local", "3")
        scaled = helm.template({**local, "autoscaling": {"enabled": True, "minReplicas": 4}})
        assert flag_values(container(scaled)["args"])["--replicas"] == "4"
        assert "--replicas" not in container(helm.template(redis))["args"]

    def test_tls_without_a_secret_says_what_is_missing(self, helm: Helm) -> None:
        """tls.enabled with no tls.secretName is refused, naming the Secret's keys."""
        with pytest.raises(HelmError, match=r"tls.enabled needs tls.secretName"):
            helm.template({"tls": {"enabled": True}})

    def test_network_policy_that_would_cut_everyone_off_is_refused(self, helm: Helm) -> None:
        """networkPolicy on, no grpcFrom and no Istio: refused, saying Envoy would fail open."""
        with pytest.raises(HelmError, match="fail"):
            helm.template({"networkPolicy": {"enabled": True}})


class TestEscapeHatches:
    def test_extra_env_volumes_and_mounts(self, helm: Helm) -> None:
        """extraEnv, extraVolumes and extraVolumeMounts land next to the chart's own."""
        values = {
            "extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "rl"}],
            "extraVolumes": [{"name": "certs", "configMap": {"name": "corp-ca"}}],
            "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/corp-ca"}],
        }
        docs = helm.template(values)
        env = {e["name"]: e for e in container(docs)["env"]}
        assert env["OTEL_SERVICE_NAME"]["value"] == "rl" and "FAIRLIMIT_BACKEND" in env
        assert {"descriptors", "tmp", "certs"} <= volume_names(docs)
        assert mounts(docs)["/etc/corp-ca"] == "certs"

    def test_pod_security_context_merges_over_the_chart(self, helm: Helm) -> None:
        """podSecurityContext adds fields; runAsNonRoot and seccomp stay."""
        values = {"podSecurityContext": {"fsGroupChangePolicy": "OnRootMismatch"}}
        context = pod_spec(helm.template(values))["securityContext"]
        assert context["fsGroupChangePolicy"] == "OnRootMismatch"
        assert context["runAsNonRoot"] is True
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert (context["runAsUser"], context["fsGroup"]) == (10001, 10001)

    def test_pre_stop_sleep_fits_in_the_grace_period(self, helm: Helm) -> None:
        """A preStop sleep by default, shorter than terminationGracePeriodSeconds."""
        docs = helm.template({})
        command = container(docs)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        assert int(command[1]) < pod_spec(docs)["terminationGracePeriodSeconds"]
        custom = {"lifecycle": {"preStop": {"exec": {"command": ["sleep", "15"]}}}}
        assert container(helm.template(custom))["lifecycle"] == custom["lifecycle"]

    def test_image_digest(self, helm: Helm) -> None:
        """image.digest pins the image: repository:tag@digest."""
        digest = "sha256:" + "ab" * 32
        values = {"image": {"repository": "r.example/fairlimit", "tag": "0.1.0", "digest": digest}}
        assert container(helm.template(values))["image"] == f"r.example/fairlimit:0.1.0@{digest}"

    def test_topology_spread_constraints_verbatim(self, helm: Helm) -> None:
        """topologySpreadConstraints replaces the ones topologySpread builds."""
        constraint = {
            "maxSkew": 2,
            "topologyKey": "topology.kubernetes.io/region",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "x"}},
        }
        docs = helm.template({"topologySpreadConstraints": [constraint]})
        assert pod_spec(docs)["topologySpreadConstraints"] == [constraint]


@pytest.fixture(scope="module")
def tls_docs(helm: Helm) -> list[Manifest]:
    tls = {"enabled": True, "secretName": "rl-tls", "clientCaSecretName": "mesh-ca"}
    return helm.template({"tls": tls})


class TestTls:
    def test_secrets_are_mounted_and_flags_point_at_them(self, tls_docs: list[Manifest]) -> None:
        """tls.crt/tls.key and ca.crt are mounted read-only; serve gets the three TLS flags."""
        volumes = {v["name"]: v for v in pod_spec(tls_docs)["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "rl-tls"
        assert volumes["client-ca"]["secret"]["secretName"] == "mesh-ca"
        assert mounts(tls_docs)["/etc/fairlimit/tls"] == "tls"
        args = container(tls_docs)["args"]
        for flag, path in [
            ("--tls-cert", "/etc/fairlimit/tls/tls.crt"),
            ("--tls-key", "/etc/fairlimit/tls/tls.key"),
            ("--tls-client-ca", "/etc/fairlimit/client-ca/ca.crt"),
        ]:
            assert args[args.index(flag) + 1] == path

    def test_liveness_uses_admin_http_under_tls(self, tls_docs: list[Manifest]) -> None:
        """The kubelet's gRPC probe speaks plaintext: under TLS liveness is GET /healthz."""
        probe = container(tls_docs)["livenessProbe"]
        assert "grpc" not in probe
        assert probe["httpGet"] == {"path": "/healthz", "port": "http-admin"}


class TestIstioInstallStyles:
    """istio.gatewayInstall picks the gateway's namespace and labels; explicit values win."""

    @pytest.mark.parametrize(
        ("istio", "namespace", "labels"),
        [
            ({}, "istio-system", {"istio": "ingressgateway"}),
            ({"gatewayInstall": "helm"}, "istio-ingress", {"istio": "ingress"}),
            (
                {"gatewayNamespace": "edge-gw", "gatewaySelector": {"app": "gw"}},
                "edge-gw",
                {"app": "gw"},
            ),
        ],
        ids=["istioctl", "helm", "explicit"],
    )
    def test_filters_and_network_policy_follow_the_gateway(
        self, helm: Helm, istio: Values, namespace: str, labels: dict[str, str]
    ) -> None:
        """EnvoyFilters go to the gateway's namespace; the NetworkPolicy admits its pods."""
        values = {"istio": {"enabled": True, **istio}, "networkPolicy": {"enabled": True}}
        docs = helm.template(values)
        for envoy_filter in find(docs, "EnvoyFilter"):
            assert envoy_filter["metadata"]["namespace"] == namespace
            assert envoy_filter["spec"]["workloadSelector"]["labels"] == labels
        (rule,) = one(docs, "NetworkPolicy")["spec"]["ingress"]
        assert rule["from"] == [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "podSelector": {"matchLabels": labels},
            }
        ]


class TestAdminPort:
    def test_off_the_service_by_default_on_the_pod_always(self, helm: Helm) -> None:
        """Probes reach the pod's http-admin; the Service does not carry it by default."""
        docs = helm.template({})
        assert [p["name"] for p in one(docs, "Service")["spec"]["ports"]] == ["grpc-rls"]
        assert "http-admin" in {p["name"] for p in container(docs)["ports"]}

    @pytest.mark.parametrize(
        "values",
        [{"service": {"exposeAdmin": True}}, {"serviceMonitor": {"enabled": True}}],
        ids=["exposeAdmin", "serviceMonitor"],
    )
    def test_on_the_service_when_asked_or_scraped(self, helm: Helm, values: Values) -> None:
        """service.exposeAdmin, or a ServiceMonitor that scrapes it, adds http-admin 8080."""
        ports = {
            p["name"]: p["port"] for p in one(helm.template(values), "Service")["spec"]["ports"]
        }
        assert ports == {"grpc-rls": 8081, "http-admin": 8080}


def _flag_values(docs: list[Manifest]) -> dict[str, str]:
    args = container(docs)["args"]
    return {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}


BUDGET_FLAGS = {
    "--grpc-max-concurrent": "grpc_max_concurrent",
    "--rlqs-max-streams": "rlqs_max_streams",
    "--rlqs-max-buckets-per-stream": "rlqs_max_buckets_per_stream",
    "--rlqs-max-buckets": "rlqs_max_buckets",
    "--grpc-max-streams-per-connection": "grpc_max_streams_per_connection",
    "--grpc-read-timeout": "grpc_read_timeout",
    "--grpc-max-receive-bytes": "grpc_max_receive_bytes",
}


class TestCallBudgets:
    """The budgets per kind of call are passed as flags, the server's own defaults unless set."""

    def test_the_defaults_are_the_servers(self, helm: Helm) -> None:
        from fairlimit.settings import Settings

        flags = _flag_values(helm.template({}))
        defaults = Settings()
        passed = {flag: flags[flag] for flag in BUDGET_FLAGS}
        expected = {flag: getattr(defaults, name) for flag, name in BUDGET_FLAGS.items()}
        assert {f: float(v) for f, v in passed.items()} == expected

    def test_values_set_them(self, helm: Helm) -> None:
        limits = {"maxConcurrent": 100, "rlqsMaxStreams": 500, "streamsPerConnection": 50,
                  "readTimeout": 2.5, "maxReceiveBytes": 1048576,
                  "rlqsMaxBucketsPerStream": 2000, "rlqsMaxBuckets": 20000}  # fmt: skip
        flags = _flag_values(helm.template({"server": {"limits": limits}}))
        assert [flags[f] for f in BUDGET_FLAGS] == ["100", "500", "2000", "20000", "50", "2.5",
                                                    "1048576"]  # fmt: skip


API_FILES = {
    "edge.yaml": None,  # Helm drops a key set to null from the merged map
    "api.yaml": {
        "domain": "api",
        "descriptors": [
            {"key": "client_id", "rate_limit": {"unit": "second", "requests_per_unit": 10}}
        ],
    },
}


def configmap_domains(docs: list[Manifest]) -> set[str]:
    """The domains of the descriptor files the rendered ConfigMap ships."""
    data = one(docs, "ConfigMap")["data"]
    return {yaml.safe_load(text)["domain"] for text in data.values()}


def gateway_domain(docs: list[Manifest]) -> str:
    (envoy_filter,) = [
        d for d in find(docs, "EnvoyFilter") if d["metadata"]["name"].endswith("-filter")
    ]
    patch = envoy_filter["spec"]["configPatches"][0]["patch"]
    return str(patch["value"]["typed_config"]["domain"])


class TestIstioDomain:
    """With Istio on, the gateway's domain is one the shipped descriptors have, or the render
    fails saying so: a domain no file has leaves every request unlimited (issue 37)."""

    def test_the_default_gateway_asks_about_the_shipped_domain(self, helm: Helm) -> None:
        docs = helm.template({"istio": {"enabled": True}})
        assert gateway_domain(docs) in configmap_domains(docs)

    def test_own_descriptors_with_the_default_domain_are_refused(self, helm: Helm) -> None:
        """The README's way to replace edge.yaml, istio.domain left at edge: refused."""
        with pytest.raises(HelmError) as refused:
            helm.template({"istio": {"enabled": True}, "config": {"descriptors": API_FILES}})
        assert (
            'istio.domain is "edge", but no file of config.descriptors has that domain '
            "(theirs: api): the gateway would ask about a domain fairlimit does not know, "
            "and every request would pass unlimited."
        ) in str(refused.value)

    def test_own_descriptors_with_their_domain_render(self, helm: Helm) -> None:
        values = {"istio": {"enabled": True, "domain": "api"},
                  "config": {"descriptors": API_FILES}}  # fmt: skip
        docs = helm.template(values)
        assert configmap_domains(docs) == {"api"} and gateway_domain(docs) == "api"

    def test_files_added_beside_edge_yaml_keep_it(self, helm: Helm) -> None:
        """Helm merges config.descriptors key by key (the README said it replaced it)."""
        added = {"api.yaml": API_FILES["api.yaml"]}
        docs = helm.template({"istio": {"enabled": True}, "config": {"descriptors": added}})
        assert configmap_domains(docs) == {"api", "edge"} and gateway_domain(docs) == "edge"

    def test_an_existing_configmap_is_not_checked(self, helm: Helm) -> None:
        """The chart cannot see an existing ConfigMap's files: it renders as asked."""
        values = {"istio": {"enabled": True}, "config": {"existingConfigMap": "mine"}}
        assert gateway_domain(helm.template(values)) == "edge"

    def test_the_readmes_example_renders_with_its_domain(self, helm: Helm) -> None:
        text = CHART_README.read_text()
        after = text[text.index("A values file's `config.descriptors`") :]
        start = after.index("```yaml\n") + len("```yaml\n")
        docs = helm.template(yaml.safe_load(after[start : after.index("```", start)]))
        assert configmap_domains(docs) == {"api"} and gateway_domain(docs) == "api"
