"""Shared helpers of the deployment specs: paths, values, the helm binary, manifests, Dockerfile.

The tools (helm, promtool, envoy, mkdocs) come from `bash tests/run.sh`, which puts helm into
.tools/bin; a missing tool skips the test locally and fails it under CI=true.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"
CHART = ROOT / "helm" / "fairlimit"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
CHART_README = CHART / "README.md"
EXAMPLE_VALUES = sorted((ROOT / "examples" / "kubernetes").glob("values-*.yaml"))
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

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


def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA.read_text())
    return loaded


def schema_errors(values: Values) -> list[str]:
    validator = jsonschema.Draft7Validator(schema())
    return [
        f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(values)
    ]


def schema_leaves(node: dict[str, Any], root: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of every value the schema describes, down to free-form maps and lists."""
    if "$ref" in node:
        node = root["definitions"][node["$ref"].rsplit("/", 1)[-1]]
    if node.get("additionalProperties") is False and "properties" in node:
        for key, child in node["properties"].items():
            yield from schema_leaves(child, root, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


def lookup(values: Values, dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"{dotted} has no default in values.yaml"
        node = node[part]
    return node


class HelmError(Exception):
    """Helm refused the chart or its values."""


class Helm:
    """The helm v3 binary, with its cache, config and data kept in a scratch directory."""

    def __init__(self, path: str, workdir: Path) -> None:
        self.path, self.workdir = path, workdir
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(workdir / "cache"),
            "HELM_CONFIG_HOME": str(workdir / "config"),
            "HELM_DATA_HOME": str(workdir / "data"),
        }

    def run(self, *args: str, values: Values | None = None) -> str:
        """helm ARGS (with ``values`` as a -f file); stdout, or HelmError with the output."""
        command = [self.path, *args]
        if values is not None:
            values_file = self.workdir / "values.yaml"
            values_file.write_text(yaml.safe_dump(values))
            command += ["-f", str(values_file)]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=120, env=self.env, check=False
        )
        if result.returncode != 0:
            raise HelmError(result.stdout + result.stderr)
        return result.stdout

    def template(
        self,
        values: Values,
        release: str = RELEASE,
        namespace: str = NAMESPACE,
        chart: Path = CHART,
    ) -> list[Manifest]:
        out = self.run("template", release, str(chart), "--namespace", namespace, values=values)
        return [doc for doc in yaml.safe_load_all(out) if doc]

    def lint(self, values: Values, chart: Path = CHART) -> list[str]:
        """helm lint --strict; the output when it fails, else nothing."""
        try:
            self.run("lint", "--strict", str(chart), values=values)
        except HelmError as error:
            return [str(error)]
        return []


def find(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[Manifest], kind: str) -> Manifest:
    (doc,) = find(docs, kind)
    return doc


def pod_spec(docs: list[Manifest]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def container(docs: list[Manifest]) -> dict[str, Any]:
    (main,) = pod_spec(docs)["containers"]
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
