"""Client identity: examples that key clients on something a caller cannot forge.

Every example must count a request that carries no identity (as one anonymous client),
never let it through unlimited; one example runs end to end through a real Envoy.
"""

import copy
import json
import ssl
import subprocess
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from envoy_proxy import envoy_on, http_get
from helpers import b64url, hs256_jwt
from servers import fairlimit_server

from .helpers import ROOT, load_values
from .processes import StubRateLimitService
from .test_examples import (
    action_path,
    apply_envoy_filter,
    descriptor_paths,
    gateway_bootstrap,
    http_filters,
    reaches,
    validate,
    virtual_hosts,
    with_test_certs,
)

pytestmark = pytest.mark.process

EXAMPLES = ROOT / "examples"
JWT_EXAMPLE = EXAMPLES / "envoy" / "identity-jwt.yaml"
IDENTITY_EXAMPLES = {
    "identity-jwt.yaml": ROOT / "descriptors" / "edge.yaml",
    "identity-mtls.yaml": ROOT / "descriptors" / "edge.yaml",
    "identity-remote-address.yaml": EXAMPLES / "envoy" / "descriptors" / "remote-address.yaml",
    "envoy.yaml": ROOT / "descriptors" / "edge.yaml",
}
SOURCE_PRINCIPAL = EXAMPLES / "istio" / "identity-source-principal.yaml"
# Actions that always produce their entry, whatever the request carries.
ALWAYS = {"generic_key", "remote_address"}

RateLimits = list[dict[str, Any]]


def envoy_rate_limits(path: Path) -> RateLimits:
    listener = yaml.safe_load(path.read_text())["static_resources"]["listeners"][0]
    (host,) = virtual_hosts(listener)
    limits: RateLimits = host["rate_limits"]
    return limits


def istio_rate_limits(path: Path) -> RateLimits:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    merges = [p for p in doc["spec"]["configPatches"] if p["applyTo"] == "VIRTUAL_HOST"]
    return [entry for p in merges for entry in p["patch"]["value"]["rate_limits"]]


def unidentified_fallback(entry: dict[str, Any], limits: RateLimits) -> bool:
    """Whether a request without the header an entry reads is caught by a sibling entry.

    Envoy drops an entry whose request_headers action finds no header; a sibling with the
    same fixed actions and a header_value_match(expect_match false, present_match) on that
    header then sends the request as one anonymous client instead.
    """
    headers = [
        a["request_headers"]["header_name"] for a in entry["actions"] if "request_headers" in a
    ]
    fixed = [a for a in entry["actions"] if "generic_key" in a]
    for header in headers:
        wanted = {"name": header, "present_match": True}
        if not any(
            [a for a in other["actions"] if "generic_key" in a] == fixed
            and any(
                a.get("header_value_match", {}).get("expect_match") is False
                and a["header_value_match"]["headers"] == [wanted]
                for a in other["actions"]
            )
            for other in limits
        ):
            return False
    return True


def never_unlimited(limits: RateLimits) -> list[str]:
    """Why some request could go uncounted: an action that can fail with no fallback."""
    problems = []
    for entry in limits:
        for action in entry["actions"]:
            (kind,) = action
            if kind == "metadata" and not action[kind].get("default_value"):
                problems.append(f"metadata {action[kind]['descriptor_key']} has no default_value")
            elif kind not in ALWAYS | {"metadata", "request_headers", "header_value_match"}:
                problems.append(f"unmodelled action {kind}")
        if not unidentified_fallback(entry, limits):
            problems.append(f"no anonymous fallback for {entry['actions']}")
    return problems


ALL_RATE_LIMITS = {
    **{f"envoy/{name}": envoy_rate_limits(EXAMPLES / "envoy" / name) for name in IDENTITY_EXAMPLES},
    "istio/ratelimit-actions.yaml": istio_rate_limits(
        EXAMPLES / "istio" / "ratelimit-actions.yaml"
    ),
    "istio/identity-source-principal.yaml": istio_rate_limits(SOURCE_PRINCIPAL),
    "chart istio.rateLimits": load_values()["istio"]["rateLimits"],
}


class TestNoIdentityIsStillCounted:
    @pytest.mark.parametrize("name", ALL_RATE_LIMITS, ids=str)
    def test_every_request_gets_a_descriptor(self, name: str) -> None:
        """Each action either always applies, has a default, or has an anonymous fallback."""
        assert never_unlimited(ALL_RATE_LIMITS[name]) == []

    def test_the_check_catches_a_missing_fallback(self) -> None:
        """Control: the header example without its anonymous entry is reported."""
        limits = envoy_rate_limits(EXAMPLES / "envoy" / "envoy.yaml")[:1]
        assert never_unlimited(limits) != []

    @pytest.mark.parametrize("name", IDENTITY_EXAMPLES, ids=str)
    def test_descriptors_reach_a_rule_of_the_config_they_name(self, name: str) -> None:
        """Every descriptor an example sends hits a rule of its descriptor file."""
        config = yaml.safe_load(IDENTITY_EXAMPLES[name].read_text())
        rules = descriptor_paths(config["descriptors"])
        for entry in envoy_rate_limits(EXAMPLES / "envoy" / name):
            assert reaches(action_path(entry["actions"]), rules), entry

    def test_jwt_identity_is_the_verified_sub_claim(self) -> None:
        """The JWT example reads `sub` from jwt_authn's verified payload, anonymous by default."""
        (entry,) = envoy_rate_limits(JWT_EXAMPLE)
        metadata = entry["actions"][1]["metadata"]
        assert metadata["metadata_key"] == {
            "key": "envoy.filters.http.jwt_authn",
            "path": [{"key": "jwt_payload"}, {"key": "sub"}],
        }
        assert (metadata["default_value"], metadata["source"]) == ("anonymous", "DYNAMIC")
        listener = yaml.safe_load(JWT_EXAMPLE.read_text())["static_resources"]["listeners"][0]
        names = [f["name"] for f in http_filters(listener)]
        assert names.index("envoy.filters.http.jwt_authn") < names.index(
            "envoy.filters.http.ratelimit"
        )


class TestIstioSourcePrincipal:
    def test_patched_sidecar_is_valid_envoy_config(self, envoy: str, tmp_path: Path) -> None:
        """header_mutation, then ratelimit, then the router; the merged actions load in Envoy."""
        bootstrap = gateway_bootstrap()
        (envoy_filter,) = [d for d in yaml.safe_load_all(SOURCE_PRINCIPAL.read_text()) if d]
        apply_envoy_filter(bootstrap, envoy_filter)
        listener = bootstrap["static_resources"]["listeners"][0]
        assert [f["name"] for f in http_filters(listener)] == [
            "envoy.filters.http.header_mutation",
            "envoy.filters.http.ratelimit",
            "envoy.filters.http.router",
        ]
        cluster = copy.deepcopy(bootstrap["static_resources"]["clusters"][0])
        cluster["name"] = "outbound|8081||fairlimit.fairlimit.svc.cluster.local"
        cluster["load_assignment"]["cluster_name"] = cluster["name"]
        bootstrap["static_resources"]["clusters"].append(cluster)
        validate(envoy, bootstrap, tmp_path)


SECRET = b"fairlimit-test-only-hs256-key-32-bytes!!"
E2E_CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: hour, requests_per_unit: 1000}
    fair_share: {active_clients: 3}
    descriptors:
      - key: client_id
        rate_limit: {unit: hour, requests_per_unit: 3}
"""


def token(sub: str, key: bytes = SECRET) -> str:
    """An HS256 JWT for the example's issuer and audience."""
    claims: dict[str, object] = {
        "iss": "https://idp.example.com",
        "aud": "api.example.com",
        "sub": sub,
        "exp": int(time.time()) + 3600,
    }
    return hs256_jwt(claims, key)


def jwt_example_with_a_local_key() -> str:
    """identity-jwt.yaml with the IdP's JWKS swapped for an inline test key."""
    config = yaml.safe_load(JWT_EXAMPLE.read_text())
    listener = config["static_resources"]["listeners"][0]
    (jwt,) = [f for f in http_filters(listener) if f["name"] == "envoy.filters.http.jwt_authn"]
    provider = jwt["typed_config"]["providers"]["idp"]
    del provider["remote_jwks"]
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "k": b64url(SECRET)}]}
    provider["local_jwks"] = {"inline_string": json.dumps(jwks)}
    return yaml.safe_dump(config, sort_keys=False)


class TestJwtEndToEnd:
    """HTTP -> a real Envoy (identity-jwt.yaml) -> a real fairlimit: 3 per hour per client."""

    def test_each_subject_and_the_anonymous_client_get_their_own_limit(
        self, envoy: str, tmp_path: Path
    ) -> None:
        """alice: 3 then 429; bob unaffected; no token: one shared client, 3 then 429."""
        descriptors = tmp_path / "edge.yaml"
        descriptors.write_text(textwrap.dedent(E2E_CONFIG))
        for _ in range(2):  # an hour boundary mid-test spoils an attempt
            with (
                fairlimit_server("--config", str(descriptors)) as server,
                envoy_on(jwt_example_with_a_local_key(), server.grpc_port, tmp_path) as proxy,
            ):
                alice = [http_get(proxy.url, bearer("alice")) for _ in range(4)]
                bob = http_get(proxy.url, bearer("bob"))
                anonymous = [http_get(proxy.url) for _ in range(4)]
                forged = http_get(proxy.url, bearer("eve", b"x" * 40))
            resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in [*alice, bob, *anonymous]]
            if resets != sorted(resets, reverse=True):
                continue
            assert [code for code, _, _ in alice] == [200, 200, 200, 429]
            assert bob[0] == 200 and bob[1]["x-ratelimit-remaining"] == "2"
            assert [code for code, _, _ in anonymous] == [200, 200, 200, 429]
            assert anonymous[0][1]["x-ratelimit-limit"].startswith("3, 3;w=3600")
            assert forged[0] == 401
            return
        raise AssertionError("both attempts straddled an hour boundary")


REMOTE_ADDRESS_CONFIG = E2E_CONFIG.replace("key: client_id", "key: remote_address")
# What a client sends to pass for another caller: each request claims a new address.
FORGED = ("x-forwarded-for", "x-envoy-external-address", "x-real-ip", "forwarded")


class TestRemoteAddressEndToEnd:
    """HTTP -> a real Envoy (identity-remote-address.yaml) -> a real fairlimit: 3 per hour
    per caller address, the TCP peer's."""

    def test_forged_forwarding_headers_do_not_make_a_new_client(
        self, envoy: str, tmp_path: Path
    ) -> None:
        """Every request claims another address in the headers proxies use to pass the
        caller's on; all come from 127.0.0.1, so they are one client: 3, then 429."""
        descriptors = tmp_path / "edge.yaml"
        descriptors.write_text(textwrap.dedent(REMOTE_ADDRESS_CONFIG))
        example = (EXAMPLES / "envoy" / "identity-remote-address.yaml").read_text()
        for _ in range(2):  # an hour boundary mid-test spoils an attempt
            with (
                fairlimit_server("--config", str(descriptors)) as server,
                envoy_on(example, server.grpc_port, tmp_path) as proxy,
            ):
                answers = []
                for i in range(6):
                    address = f"203.0.113.{i + 1}"
                    headers = {name: address for name in FORGED}
                    headers["forwarded"] = f"for={address}"
                    answers.append(http_get(proxy.url, headers))
            resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in answers]
            if resets != sorted(resets, reverse=True):
                continue
            assert [code for code, _, _ in answers] == [200, 200, 200, 429, 429, 429]
            assert answers[0][1]["x-ratelimit-limit"].startswith("3, 3;w=3600")
            return
        raise AssertionError("both attempts straddled an hour boundary")


def bearer(sub: str, key: bytes = SECRET) -> dict[str, str]:
    return {"authorization": f"Bearer {token(sub, key)}"}


SPIFFE_ID = "spiffe://cluster.local/ns/shop/sa/checkout"


def workload_certificate(tls_files: dict[str, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A client certificate with a SPIFFE URI SAN, signed by the test CA (openssl)."""
    ca = tls_files["ca.crt"]
    (tmp_path / "uri.ext").write_text(f"subjectAltName=URI:{SPIFFE_ID}\n")
    key, csr, crt = tmp_path / "workload.key", tmp_path / "workload.csr", tmp_path / "workload.crt"

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", "/CN=checkout")  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca.with_suffix(".key")),
            "-CAcreateserial", "-out", str(crt), "-days", "2",
            "-extfile", str(tmp_path / "uri.ext"))  # fmt: skip
    return crt, key


def https_get(port: int, ca: Path, cert: tuple[Path, Path], headers: dict[str, str]) -> int:
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(cert[0]), str(cert[1]))
    request = urllib.request.Request(f"https://127.0.0.1:{port}/", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as error:
        return error.code


class TestMtlsEndToEnd:
    """HTTPS with client certificates -> a real Envoy (identity-mtls.yaml) -> a recording RLS."""

    def test_the_client_is_the_verified_uri_san_and_cannot_be_spoofed(
        self,
        envoy: str,
        stub_rls: tuple[StubRateLimitService, int],
        tls_files: dict[str, Path],
        tmp_path: Path,
    ) -> None:
        """A SPIFFE certificate is its principal; no URI SAN, or a forged header, is anonymous."""
        service, rls_port = stub_rls
        workload = workload_certificate(tls_files, tmp_path)
        plain = (tls_files["client.crt"], tls_files["client.key"])
        config = with_test_certs(EXAMPLES / "envoy" / "identity-mtls.yaml", tls_files, tmp_path)
        with envoy_on(config.read_text(), rls_port, tmp_path) as proxy:
            ca = tls_files["ca.crt"]
            codes = [
                https_get(proxy.port, ca, workload, {}),
                https_get(proxy.port, ca, plain, {}),
                https_get(proxy.port, ca, plain, {"x-fairlimit-principal": SPIFFE_ID}),
            ]
        assert codes == [200, 200, 200]
        route = ("route", "public")
        assert service.calls == [
            ("edge", [[route, ("client_id", SPIFFE_ID)]]),
            ("edge", [[route, ("client_id", "anonymous")]]),
            ("edge", [[route, ("client_id", "anonymous")]]),
        ]
