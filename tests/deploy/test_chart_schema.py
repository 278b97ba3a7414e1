"""values.schema.json: every value described, bad values rejected before Helm renders."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from .helpers import (
    CHART_README,
    EXAMPLE_VALUES,
    ROOT,
    coalesce,
    load_values,
    lookup,
    schema,
    schema_errors,
    schema_leaves,
)

pytestmark = pytest.mark.unit

BAD_VALUES = {
    "negative replicas": ({"replicaCount": -1}, "/replicaCount"),
    "unknown backend scheme": ({"backend": {"url": "mongodb://x"}}, "/backend/url"),
    "unknown top-level key": ({"replicas": 3}, "'replicas' was unexpected"),
    "unknown nested key": ({"server": {"stric": True}}, "'stric' was unexpected"),
    "image digest that is not sha256": ({"image": {"digest": "latest"}}, "/image/digest"),
    "unknown gateway install": ({"istio": {"gatewayInstall": "kustomize"}}, "gatewayInstall"),
    "unknown failure mode": ({"server": {"failureMode": "maybe"}}, "/server/failureMode"),
    "root user": ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    "descriptor without domain": (
        {"config": {"descriptors": {"x.yaml": {"descriptors": []}}}},
        "'domain' is a required property",
    ),
}


class TestValuesSchema:
    def test_schema_is_valid_draft_07(self) -> None:
        """The schema itself is a valid JSON Schema draft-07 document."""
        document = schema()
        assert document["$schema"] == "http://json-schema.org/draft-07/schema#"
        jsonschema.Draft7Validator.check_schema(document)

    def test_default_values_validate(self) -> None:
        """values.yaml as shipped is valid."""
        assert schema_errors(load_values()) == []

    @pytest.mark.parametrize("path", EXAMPLE_VALUES, ids=lambda p: p.name)
    def test_example_values_validate(self, path: Path) -> None:
        """Each examples/kubernetes values file, merged over the defaults, is valid."""
        assert schema_errors(coalesce(load_values(), load_values(path))) == []

    @pytest.mark.parametrize("case", BAD_VALUES, ids=str)
    def test_bad_values_are_rejected(self, case: str) -> None:
        """Negative replicas, unknown schemes, keys and install styles fail."""
        override, expected = BAD_VALUES[case]
        errors = schema_errors(coalesce(load_values(), override))
        assert any(expected in error for error in errors), errors

    def test_global_is_accepted_for_subcharts(self) -> None:
        """A parent chart's `global` values pass the schema (Helm hands them to subcharts)."""
        override = {"global": {"imageRegistry": "r.example", "anything": {"nested": 1}}}
        assert schema_errors(coalesce(load_values(), override)) == []

    def test_every_schema_value_has_a_default(self) -> None:
        """values.yaml sets every value the schema describes (and the schema allows no other)."""
        document, values = schema(), load_values()
        for dotted in schema_leaves(document, document):
            lookup(values, dotted)

    def test_readme_documents_every_value(self) -> None:
        """The chart README's values table has a row for every value."""
        document, readme = schema(), CHART_README.read_text()
        missing = [v for v in schema_leaves(document, document) if f"| `{v}` |" not in readme]
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


GLOBAL_BUCKET = {
    "domain": "edge",
    "descriptors": [
        {"key": "generic_key", "value": "global",
         "rate_limit": {"unit": "second", "requests_per_unit": 100}}
    ],
}  # fmt: skip


class TestStrictAsTheServerHasIt:
    """server.strict says what --strict does: a contended cap is a load error, a global
    bucket a note, never an error (the README and values.yaml said a load error; issue 37)."""

    def test_a_global_bucket_loads_under_strict(self, tmp_path: Path) -> None:
        path = tmp_path / "edge.yaml"
        path.write_text(yaml.safe_dump(GLOBAL_BUCKET))
        result = fairlimit_check(path)
        assert result.returncode == 0 and result.stdout.startswith("note: ")

    def test_the_readme_and_values_say_so(self) -> None:
        row = next(
            line for line in CHART_README.read_text().splitlines()
            if line.startswith("| `server.strict` |")
        )  # fmt: skip
        comment = (CHART_README.parent / "values.yaml").read_text()
        comment = comment[comment.index("# -- --strict") : comment.index("strict: false")]
        for text in (row, " ".join(comment.replace("#", " ").split())):
            assert "global-bucket-only rule stays a note, never an error" in text, text
            assert "global bucket only, is a load error" not in text
            assert "global-bucket-only rule, is a load error" not in text


class TestChartReadme:
    def test_the_install_builds_the_image_it_installs(self) -> None:
        """The image is in no registry: the README's first commands build it with the
        chart's appVersion as tag, push it, and install the chart with that repository
        (it installed fairlimit:0.1.0 with no build step)."""
        chart = yaml.safe_load((CHART_README.parent / "Chart.yaml").read_text())
        block = re.search(r"```sh\n(.*?)```", CHART_README.read_text(), re.S)
        assert block is not None
        text = block.group(1).replace("\\\n", " ")
        built = re.search(r"docker build -t (\S+):(\S+) \.", text)
        assert built is not None and built.group(2) == chart["appVersion"]
        repository = built.group(1)
        assert f"docker push {repository}:{chart['appVersion']}" in text
        install = text.index("helm install")
        assert built.start() < install and f"--set image.repository={repository}" in text
        kind = "kind load docker-image " + f"{load_values()['image']['repository']}:"
        assert kind + chart["appVersion"] in " ".join(CHART_README.read_text().split())
