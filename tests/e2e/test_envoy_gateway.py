"""Envoy Gateway's global rate limiting, with fairlimit run as Envoy Gateway runs the reference.

Envoy Gateway deploys envoyproxy/ratelimit itself; the only way in is the image, which it
starts as ``/bin/ratelimit`` with the environment of its
internal/infrastructure/kubernetes/ratelimit/resource.go (here with a Redis backend and
Prometheus on, loopback addresses and the test certificates in place of /certs). The config
comes over ADS with a client certificate, as node ``envoy-ratelimit``, in versioned
snapshots (our ManagementServer standing in for its globalratelimit runner); the requests
come from a real Envoy whose routes carry the rate-limit actions Envoy Gateway's translator
emits (fixtures/envoy_gateway/envoy.yaml), for the RateLimitConfigs it builds
(fixtures/envoy_gateway/ratelimit-configs.yaml). Each test is one of the sequences of
Envoy Gateway's test/e2e/tests/ratelimit.go.
"""

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from envoy_proxy import EnvoyProcess, envoy_on, http_get
from fairlimit._proto.ratelimit.config.ratelimit.v3 import rls_conf_pb2
from fairlimit.grpc_api.xds import TYPE_URL
from helpers import b64url, hs256_jwt
from redis_servers import RedisProcess
from servers import ROOT, ServerProcess, fairlimit_server, free_port
from xds_server import ManagementServer

pytestmark = pytest.mark.process

FIXTURES = Path(__file__).parents[1] / "fixtures" / "envoy_gateway"
GUIDE = ROOT / "docs" / "envoy-gateway.md"
COMMAND = ROOT / "docker" / "ratelimit"
NS = "gateway-conformance-infra"
LISTENER = f"{NS}/same-namespace/http"  # the first Gateway's listener, and its domain
MERGE_LISTENER = 10001  # the second Gateway's (eg-rate-limit/http-8080), a literal port
SECRET = b"fairlimit-test-only-hs256-key-32-bytes!!"
# The jwt.io example's claims, as the tokens of Envoy Gateway's e2e carry them.
JOHN = {"sub": "1234567890", "name": "John Doe", "admin": True, "iat": 1516239022}
TOM = {**JOHN, "name": "Tom"}


def route(name: str) -> str:
    """Envoy Gateway's name of an HTTPRoute's first rule and match, with no hostname."""
    return f"httproute/{NS}/{name}/rule/0/match/0/*"


def _without_printer_fields(node: Any) -> Any:
    """Envoy Gateway prints value_to_metric and share_threshold (its YAML form's); the
    RateLimitConfig resource it pushes has no such fields."""
    if isinstance(node, list):
        return [_without_printer_fields(item) for item in node]
    if isinstance(node, dict):
        return {k: _without_printer_fields(v) for k, v in node.items()
                if k not in ("value_to_metric", "share_threshold")}  # fmt: skip
    return node


def eg_configs() -> list[Any]:
    """fixtures/envoy_gateway/ratelimit-configs.yaml as RateLimitConfig resources."""
    text = (FIXTURES / "ratelimit-configs.yaml").read_text()
    return [json_format.ParseDict(_without_printer_fields(doc), rls_conf_pb2.RateLimitConfig())
            for doc in yaml.safe_load_all(text)]  # fmt: skip


def deployment_env(
    xds_port: int, redis_port: int, metrics_port: int, certs: Path
) -> dict[str, str]:
    """The ratelimit container's environment as resource.go writes it (Redis backend,
    Prometheus on), with loopback addresses and ``certs`` for /certs; then the listen
    addresses, which Envoy Gateway leaves at their defaults (0.0.0.0:8081, :8080, :6070)."""
    eg = {
        "RUNTIME_ROOT": "/data",
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_IGNOREDOTFILES": "true",
        "RUNTIME_WATCH_ROOT": "false",
        "LOG_LEVEL": "info",
        "USE_STATSD": "false",
        "CONFIG_TYPE": "GRPC_XDS_SOTW",
        "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{xds_port}",  # envoy-gateway:18001
        "CONFIG_GRPC_XDS_NODE_ID": "envoy-ratelimit",
        "GRPC_SERVER_USE_TLS": "true",
        "GRPC_SERVER_TLS_CERT": str(certs / "tls.crt"),
        "GRPC_SERVER_TLS_KEY": str(certs / "tls.key"),
        "GRPC_SERVER_TLS_CA_CERT": str(certs / "ca.crt"),  # upstream reads no such variable
        "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
        "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": str(certs / "tls.crt"),
        "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": str(certs / "tls.key"),
        "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": str(certs / "ca.crt"),
        "FORCE_START_WITHOUT_INITIAL_CONFIG": "true",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": f"127.0.0.1:{redis_port}",
        "USE_PROMETHEUS": "true",
        "PROMETHEUS_ADDR": f"127.0.0.1:{metrics_port}",  # :19001
        "PROMETHEUS_MAPPER_YAML": "/etc/statsd-exporter/conf.yaml",
    }
    loopback = {"GRPC_HOST": "127.0.0.1", "GRPC_PORT": "0", "HOST": "127.0.0.1", "PORT": "0",
                "DEBUG_HOST": "127.0.0.1", "DEBUG_PORT": "0"}  # fmt: skip
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**eg, **loopback, "PATH": path}


def _certs(tls_files: dict[str, Path], directory: Path) -> Path:
    """Secret envoy-rate-limit as the pod mounts it (tls.crt, tls.key, ca.crt: the same
    pair serves gRPC and is the xDS client's), and the proxy's own pair beside it."""
    directory.mkdir()
    for name, source in (("tls.crt", "client.crt"), ("tls.key", "client.key"),
                         ("ca.crt", "ca.crt"), ("envoy.crt", "server.crt"),
                         ("envoy.key", "server.key")):  # fmt: skip
        shutil.copy(tls_files[source], directory / name)
    return directory


def _bootstrap(certs: Path) -> str:
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "k": b64url(SECRET)}]}
    text = (FIXTURES / "envoy.yaml").read_text().replace("/certs/", f"{certs}/")
    return text.replace("inline_string: JWKS", f"inline_string: '{json.dumps(jwks)}'")


_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Gateway:
    """The deployment: fairlimit, its management server and the proxy in front."""

    management: ManagementServer
    server: ServerProcess
    proxy: EnvoyProcess
    metrics_port: int
    configs: list[Any]
    first_request: Any  # the first DiscoveryRequest
    health_before_config: int  # /healthcheck before any config was pushed
    redis: RedisProcess

    def get(self, path: str, headers: dict[str, str] | None = None, *, merge: bool = False,
            source: str | None = None) -> tuple[int, dict[str, str]]:  # fmt: skip
        """GET ``path`` on the first Gateway (``merge``: on eg-rate-limit) from ``source``."""
        port = self.proxy.ports[MERGE_LISTENER] if merge else self.proxy.port
        code, answer, _ = http_get(f"http://127.0.0.1:{port}{path}", headers, source=source)
        return code, answer

    def codes(self, path: str, calls: int, headers: dict[str, str] | None = None,
              **how: Any) -> list[int]:  # fmt: skip
        return [self.get(path, headers, **how)[0] for _ in range(calls)]

    def health(self) -> int:
        return http_get(f"http://127.0.0.1:{self.server.admin_port}/healthcheck")[0]

    def metric(self, name: str, **labels: str) -> float:
        """``ratelimit_service_<name>`` with these labels, from PROMETHEUS_ADDR (0 if absent)."""
        text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")[2].decode()
        for line in text.splitlines():
            sample = _SAMPLE.match(line)
            if not sample or sample[1] != f"ratelimit_service_{name}":
                continue
            if labels.items() <= dict(_LABEL.findall(sample[2] or "")).items():
                return float(sample[3])
        return 0.0


@pytest.fixture(scope="module")
def gateway(
    tls_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """Redis, the management server over mTLS, /bin/ratelimit with Envoy Gateway's
    environment (serving before any config, as FORCE_START_WITHOUT_INITIAL_CONFIG says),
    snapshot 1 pushed and ACKed, then the proxy."""
    tmp = tmp_path_factory.mktemp("envoy-gateway")
    certs = _certs(tls_files, tmp / "certs")
    redis = RedisProcess(tmp).start()
    management = ManagementServer(tls_files)
    metrics_port, configs = free_port(), eg_configs()
    env = deployment_env(management.port, redis.port, metrics_port, certs)
    try:
        with fairlimit_server(env=env, loopback_ports=False, serve=["sh", str(COMMAND)]) as rls:
            health = http_get(f"http://127.0.0.1:{rls.admin_port}/healthcheck")[0]
            first = management.request()
            management.push("1", *configs)
            management.acked("1")
            with envoy_on(_bootstrap(certs), rls.grpc_port, tmp, [MERGE_LISTENER]) as proxy:
                yield Gateway(management, rls, proxy, metrics_port, configs, first, health,
                              redis)  # fmt: skip
    finally:
        management.stop()
        redis.stop()


@pytest.fixture(autouse=True)
def _answered(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the gateway: every call Envoy made was answered (none failed
    open)."""
    yield
    if "gateway" in request.fixturenames:
        proxy = request.getfixturevalue("gateway").proxy
        assert proxy.stat("cluster.backend.ratelimit.error") == 0
        assert proxy.stat("cluster.backend.ratelimit.failure_mode_allowed") == 0


def _limit(answer: dict[str, str]) -> str | None:
    return answer.get("x-ratelimit-limit")


class TestDeployment:
    def test_it_serves_at_once_and_asks_as_envoy_ratelimit(self, gateway: Gateway) -> None:
        """Ready before any config (the readiness probe fails after one miss), the ADS
        stream as node envoy-ratelimit for RateLimitConfig, snapshot 1 loaded once; the
        one startup warning names what has no effect here."""
        assert gateway.health_before_config == 200
        first = gateway.first_request
        assert (first.node.id, first.type_url, first.version_info) == (
            "envoy-ratelimit", TYPE_URL, "")  # fmt: skip
        assert gateway.metric("config_load_success") == 1
        assert gateway.health() == 200
        log = "".join(gateway.server.lines)
        assert "ignored: PROMETHEUS_MAPPER_YAML" in log, log


class TestHeaderMatch:
    """RateLimitHeaderMatch: x-user-id=one and x-user-org=acme, 3 a day."""

    def test_all_matched_headers_are_limited(self, gateway: Gateway) -> None:
        both = {"x-user-id": "one", "x-user-org": "acme"}
        answers = [gateway.get("/get", both) for _ in range(4)]
        assert [code for code, _ in answers] == [200, 200, 200, 429]
        assert _limit(answers[0][1]) == "3, 3;w=86400"

    def test_one_matched_header_is_not(self, gateway: Gateway) -> None:
        answers = [gateway.get("/get", {"x-user-id": "one"}) for _ in range(4)]
        assert [code for code, _ in answers] == [200] * 4
        assert _limit(answers[0][1]) is None  # no descriptor: no call


class TestSourceCidr:
    """RateLimitCIDRMatch, RateLimitCIDRInvertMatchAlwaysEnforce and
    RateLimitHeadersAndCIDRMatch: masked_remote_address values, remote_address below."""

    def test_distinct_addresses_in_a_cidr_each_have_their_limit(self, gateway: Gateway) -> None:
        """0.0.0.0/0 Distinct, 3 a month: 127.0.0.1 is refused the fourth, 127.0.0.2 is
        another client; the over_limit count carries the mask, dots as underscores."""
        answers = [gateway.get("/cidr") for _ in range(4)]
        assert [code for code, _ in answers] == [200, 200, 200, 429]
        assert _limit(answers[0][1]) == "3, 3;w=2592000"
        assert gateway.get("/cidr", source="127.0.0.2")[0] == 200
        over = gateway.metric("rate_limit_over_limit", domain=LISTENER,
                              key1=f"{route('cidr-ratelimit')}_{route('cidr-ratelimit')}",
                              key2="masked_remote_address_0_0_0_0/0")  # fmt: skip
        assert over == 1

    def test_an_inverted_cidr_limits_addresses_outside_it(self, gateway: Gateway) -> None:
        """All but 192.0.2.0/24, 2 a year: 127.0.0.1 is outside, so limited."""
        answers = [gateway.get("/invert") for _ in range(3)]
        assert [code for code, _ in answers] == [200, 200, 429]
        assert _limit(answers[0][1]) == "2, 2;w=31536000"
        over = gateway.metric("rate_limit_over_limit", domain=LISTENER,
                              key2="masked_remote_address_invert_192_0_2_0/24")  # fmt: skip
        assert over == 1

    def test_headers_and_cidr_together(self, gateway: Gateway) -> None:
        both = {"x-user-id": "one", "x-user-org": "acme"}
        assert gateway.codes("/header-and-cidr", 4, both) == [200, 200, 200, 429]
        assert gateway.get("/header-and-cidr", both, source="127.0.0.2")[0] == 200
        assert gateway.codes("/header-and-cidr", 4, {"x-user-id": "one"}) == [200] * 4


class TestJwtClaims:
    """RateLimitBasedJwtClaims: the claim name, as header x-claim-name, is "John Doe"."""

    def test_a_claim_is_limited_and_another_is_not(self, gateway: Gateway) -> None:
        john = {"authorization": f"Bearer {hs256_jwt(JOHN, SECRET)}"}
        tom = {"authorization": f"Bearer {hs256_jwt(TOM, SECRET)}"}
        assert gateway.get("/bar")[0] == 200  # the route without a policy
        answers = [gateway.get("/foo", john) for _ in range(4)]
        assert [code for code, _ in answers] == [200, 200, 200, 429]
        assert _limit(answers[0][1]) == "3, 3;w=86400"
        assert gateway.codes("/foo", 4, tom) == [200] * 4
        assert gateway.get("/foo")[0] == 401  # no token
        name = route("http-ratelimit-based-jwt-claims")
        over = gateway.metric("rate_limit_over_limit", domain=LISTENER, key1=f"{name}_{name}",
                              key2="rule-0-match-0_rule-0-match-0")  # fmt: skip
        assert over == 1


class TestShadowMode:
    """RateLimitGlobalShadowModeTest: GET, 3 an hour, shadowMode: counted, never refused."""

    def test_requests_over_the_limit_pass(self, gateway: Gateway) -> None:
        answers = [gateway.get("/shadow") for _ in range(5)]
        assert [code for code, _ in answers] == [200] * 5
        assert _limit(answers[0][1]) == "3, 3;w=3600"
        shadowed = gateway.metric("rate_limit_shadow_mode", domain=LISTENER,
                                  key2="rule-0-method_rule-0-method")  # fmt: skip
        assert shadowed == 2


class TestCosts:
    """RateLimitGlobalSharedWithCost and UsageRateLimit: hits_addend a number, and a
    response cost from dynamic metadata charged after the response."""

    def test_a_request_cost_on_a_shared_rule_counts_across_routes(self, gateway: Gateway) -> None:
        """4 a day, shared by /cost/foo and /cost/bar, each request costing 2."""
        who = {"x-user-id": "cost-test"}
        first = gateway.get("/cost/foo", who)
        assert (first[0], _limit(first[1])) == (200, "4, 4;w=86400")
        assert [gateway.get("/cost/bar", who)[0] for _ in range(2)] == [200, 429]
        assert gateway.get("/cost/foo")[0] == 200  # another client: not this rule

    def test_a_response_cost_charged_past_the_limit_refuses_the_next(
        self, gateway: Gateway
    ) -> None:
        """21 a day; the check costs 0, each response 10 (ext_proc's metadata): 0, 10 and
        20 pass, then 30 is over. Each charge reaches fairlimit before the next request."""
        codes, calls = [], "cluster.ratelimit_cluster.upstream_rq_completed"
        for _ in range(4):
            before = gateway.proxy.stat(calls)
            codes.append(gateway.get("/usage", {"x-user-id": "one"})[0])
            # the check, and after a 200 the charge (a 429 has no cost to charge)
            gateway.proxy.wait_for_stat(calls, before + (2 if codes[-1] == 200 else 1))
        assert codes == [200, 200, 200, 429]


class TestLimits:
    def test_requests_zero_refuses_every_request(self, gateway: Gateway) -> None:
        """Envoy Gateway accepts requests: 0 (and pushes requests_per_unit 0)."""
        code, answer = gateway.get("/blocked")
        assert (code, answer.get("x-ratelimit-remaining")) == (429, "0")

    def test_a_live_update_changes_the_limit_and_keeps_the_count(self, gateway: Gateway) -> None:
        """1 a year, then snapshot 2 says 3: the two hits counted stay, so one more
        passes. /healthcheck stays 200 and the config load is counted."""
        assert gateway.codes("/update", 2) == [200, 429]
        changed = [rls_conf_pb2.RateLimitConfig() for _ in gateway.configs]
        for copy, config in zip(changed, gateway.configs, strict=True):
            copy.CopyFrom(config)
        (listener,) = [c for c in changed if c.domain == LISTENER]
        (update,) = [d for d in listener.descriptors if d.key == route("live-update")]
        update.descriptors[0].rate_limit.requests_per_unit = 3
        gateway.management.push("2", *changed)
        assert gateway.management.acked("2").response_nonce == "n2"
        assert gateway.health() == 200
        answers = [gateway.get("/update") for _ in range(2)]
        assert [code for code, _ in answers] == [200, 429]
        assert _limit(answers[0][1]) == "3, 3;w=31536000"
        assert gateway.metric("config_load_success") == 2


class TestMerge:
    """RateLimitGlobalMergeTest on Gateway eg-rate-limit: a route policy merged with the
    Gateway's, over /foo and /bar, in the e2e's order (every request counts towards the
    Gateway's rule without selectors)."""

    def test_shared_and_unshared_rules_of_both_policies(self, gateway: Gateway) -> None:
        def codes(path: str, calls: int, user: str | None = None) -> list[int]:
            headers = {"x-user-id": user} if user else None
            return gateway.codes(path, calls, headers, merge=True)

        # one: the route policy's shared rule, 3 a day across both routes
        assert codes("/bar", 2, "one") + codes("/foo", 2, "one") == [200, 200, 200, 429]
        # two: the route policy's unshared rule, 3 a day on each route
        assert codes("/foo", 4, "two") + codes("/bar", 4, "two") == [200, 200, 200, 429] * 2
        # three: the Gateway policy's shared rule
        assert codes("/bar", 2, "three") + codes("/foo", 2, "three") == [200, 200, 200, 429]
        # four: the Gateway policy's unshared rule
        assert codes("/foo", 4, "four") + codes("/bar", 4, "four") == [200, 200, 200, 429] * 2
        # no header: only the Gateway policy's rule for every request, 40 a day
        code, answer = gateway.get("/bar", merge=True)
        assert (code, _limit(answer)) == (200, "40, 40;w=86400")
        left = int(answer["x-ratelimit-remaining"])
        assert left == 40 - 25  # every request above counted, the refused ones too
        assert codes("/bar", left + 1) == [200] * left + [429]


class TestPolicyDeleted:
    """A policy deleted, then the last one: Envoy Gateway pushes the snapshot without it,
    then an empty snapshot (its globalratelimit runner's answer when no Gateway has a
    rate-limit policy). Each is applied, ACKed and counted; the deleted limits go."""

    def test_policy_delete_then_empty_snapshot_lifts_the_limits(self, gateway: Gateway) -> None:
        loads = gateway.metric("config_load_success")
        errors = gateway.metric("config_load_error")
        assert gateway.get("/blocked")[0] == 429  # block-all: requests 0
        assert gateway.codes("/cidr", 4, source="127.0.0.9") == [200, 200, 200, 429]
        without = [rls_conf_pb2.RateLimitConfig() for _ in gateway.configs]
        for copy, config in zip(without, gateway.configs, strict=True):
            copy.CopyFrom(config)
        (listener,) = [c for c in without if c.domain == LISTENER]
        (blocked,) = [d for d in listener.descriptors if d.key == route("block-all")]
        listener.descriptors.remove(blocked)  # BackendTrafficPolicy block-all deleted
        gateway.management.push("3", *without)
        assert not gateway.management.acked("3").HasField("error_detail")
        assert gateway.get("/blocked")[0] == 200
        assert gateway.get("/cidr", source="127.0.0.9")[0] == 429  # the others still hold
        gateway.management.push("4")  # the last policy deleted: an empty snapshot
        ack = gateway.management.acked("4")
        gateway.server.wait_for(r"config reloaded: no rate limit in any domain")
        codes = gateway.codes("/cidr", 2, source="127.0.0.9") + gateway.codes("/blocked", 2)
        health = gateway.health()
        counted = gateway.metric("config_load_success") - loads
        failed = gateway.metric("config_load_error") - errors
        gateway.management.push("5", *gateway.configs)  # the policies back, for what follows
        gateway.management.acked("5")
        assert not ack.HasField("error_detail") and ack.response_nonce == "n4"
        assert codes == [200] * 4 and health == 200
        assert (counted, failed) == (2, 0)


# A script that keeps Redis busy for ARGV[1] microseconds: no other call is served meanwhile.
BUSY = ("local s = redis.call('TIME') repeat local n = redis.call('TIME') until"
        " (n[1] - s[1]) * 1000000 + (n[2] - s[2]) > tonumber(ARGV[1]) return 1")  # fmt: skip


class TestStalledRedis:
    def test_a_request_redis_answers_late_is_never_counted_twice(
        self, gateway: Gateway
    ) -> None:
        """Redis busy for 0.35 s (a slow script; a loaded machine does the same) while
        Envoy's call for a request waits: past the client's socket timeout (0.25 s) the
        call is given up (the failure mode answers) or answered, and counted at most once.
        The client sent it again on that timeout, so the admission script ran twice: the
        request was charged twice (Envoy Gateway's tests under load saw extra hits: a cost
        of 10 counted as 20, the next request refused)."""
        counts = []
        for source in ("127.0.0.30", "127.0.0.31", "127.0.0.32"):  # /cidr: 3 a month each

            def stall() -> None:
                with gateway.redis.client() as client:
                    client.eval(BUSY, 0, 350_000)

            holder = threading.Thread(target=stall)
            holder.start()
            time.sleep(0.05)  # the script is running
            code, _ = gateway.get("/cidr", source=source)
            holder.join()
            time.sleep(0.3)  # a call sent before it gave up runs in Redis after the script
            with gateway.redis.client() as client:
                keys = list(client.scan_iter(f"*remote_address={source}}}c:*"))
                counts.append((code, sum(int(client.hget(k, "n") or 0) for k in keys)))
        assert [code for code, _ in counts] == [200] * 3
        assert max(n for _, n in counts) <= 1, counts


class TestGuide:
    def test_it_names_every_variable_run_here_and_the_image_setting(self) -> None:
        """docs/envoy-gateway.md's table has each of Envoy Gateway's variables the tests set;
        its values file sets the image where Envoy Gateway's chart reads it."""
        text = GUIDE.read_text()
        loopback = {"GRPC_HOST", "GRPC_PORT", "HOST", "PORT", "DEBUG_HOST", "DEBUG_PORT", "PATH"}
        names = deployment_env(18001, 6379, 19001, Path("/certs")).keys() - loopback
        assert [name for name in sorted(names) if f"`{name}" not in text] == []
        blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
        values = yaml.safe_load(next(b for b in blocks if b.startswith("# eg-fairlimit.yaml")))
        kubernetes = values["config"]["envoyGateway"]["provider"]["kubernetes"]
        assert kubernetes["rateLimitDeployment"]["container"]["image"]
