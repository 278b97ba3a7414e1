"""Rendered manifests against the Kubernetes API schemas, standalone and as a subchart.

kubernetes-validate checks each built-in kind strictly (unknown fields are errors) at the
oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest it knows.
Custom resources (ServiceMonitor, PrometheusRule, EnvoyFilter) have no schema there; their
shape is checked by test_chart_render.py.
"""

from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import require, skip_or_fail

from .helpers import CHART, Helm, Manifest, Values, container, find, one

pytestmark = pytest.mark.unit

CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "EnvoyFilter"}
EVERYTHING_ON: Values = {
    "backend": {"url": "redis://redis:6379/0"},
    "autoscaling": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "networkPolicy": {"enabled": True},
    "istio": {"enabled": True},
    "tls": {"enabled": True, "secretName": "fairlimit-tls", "clientCaSecretName": "mesh-ca"},
    "extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "fairlimit"}],
    "extraVolumes": [{"name": "extra", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
    "image": {"digest": "sha256:" + "0" * 64},
    "service": {"exposeAdmin": True},
}


def kubernetes_versions() -> list[str]:
    declared = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    oldest = declared.removeprefix(">=").removesuffix("-0")
    return [oldest, "1.37.0"]


def schema_problems(docs: list[Manifest]) -> list[str]:
    """kubernetes-validate's complaints about each built-in resource, at each version."""
    try:
        import kubernetes_validate
    except ImportError:
        skip_or_fail("kubernetes-validate is not installed (the test extra installs it)")
    kv: Any = kubernetes_validate
    problems = []
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        for version in kubernetes_versions():
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as error:
                problems.append(f"{version} {doc['kind']}: {error.message} at {error.path}")
    return problems


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON], ids=["defaults", "everything-on"])
def test_standalone_manifests_match_the_kubernetes_schemas(helm: Helm, values: Values) -> None:
    """Every built-in resource the chart renders is valid at the oldest and newest Kubernetes."""
    assert schema_problems(helm.template(values)) == []


def parent_chart(tmp: Path, values: Values) -> Path:
    """A tiny umbrella chart that depends on helm/fairlimit by file:// (no repository)."""
    parent = tmp / "platform"
    parent.mkdir()
    chart = {
        "apiVersion": "v2",
        "name": "platform",
        "version": "1.0.0",
        "dependencies": [
            {"name": "fairlimit", "version": ">=0.0.0-0", "repository": f"file://{CHART}"}
        ],
    }
    (parent / "Chart.yaml").write_text(yaml.safe_dump(chart))
    (parent / "values.yaml").write_text(yaml.safe_dump(values))
    return parent


@pytest.fixture(scope="module")
def parent(helm: Helm, tmp_path_factory: pytest.TempPathFactory) -> Path:
    values = {
        "global": {"imageRegistry": "registry.example", "environment": "prod"},
        "fairlimit": {
            "networkPolicy": {"enabled": True},
            "istio": {"enabled": True, "gatewayInstall": "helm"},
        },
    }
    parent = parent_chart(tmp_path_factory.mktemp("umbrella"), values)
    helm.run("dependency", "build", str(parent))
    return parent


class TestAsASubchart:
    """helm/fairlimit under an umbrella chart, with Helm's `global` values passed down."""

    def test_dependency_build_vendors_the_chart(self, parent: Path) -> None:
        """`helm dependency build` packs helm/fairlimit into charts/, offline."""
        assert [p.name for p in (parent / "charts").iterdir()] == ["fairlimit-0.1.0.tgz"]

    def test_umbrella_lints_and_renders_with_globals(self, helm: Helm, parent: Path) -> None:
        """The schema accepts `global`; the subchart renders its workload under the parent."""
        assert helm.lint({}, chart=parent) == []
        docs = helm.template({}, release="platform", namespace="edge", chart=parent)
        deployment = one(docs, "Deployment")
        assert deployment["metadata"]["name"] == "platform-fairlimit"
        assert container(docs)["name"] == "fairlimit"
        assert find(docs, "NetworkPolicy")

    def test_subchart_manifests_match_the_kubernetes_schemas(
        self, helm: Helm, parent: Path
    ) -> None:
        """The subchart's resources are valid Kubernetes objects too."""
        docs = helm.template({}, release="platform", namespace="edge", chart=parent)
        assert schema_problems(docs) == []


def test_kubernetes_validate_catches_a_bad_manifest(helm: Helm) -> None:
    """Control: a misspelt container field is reported."""
    docs = helm.template({})
    container(docs)  # the Deployment is there
    one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "x"
    assert any("imagePullPolcy" in p for p in schema_problems(docs))


def test_helm_is_v3(helm: Helm) -> None:
    """The helm the tests run is Helm 3 (the chart is apiVersion v2)."""
    assert helm.run("version", "--short").startswith("v3.")
    require("helm", "bash tests/run.sh")
