"""Envoy AI Gateway's QuotaPolicy, with fairlimit run as Envoy AI Gateway runs the reference.

Envoy AI Gateway's e2e (tests/e2e/testdata/backend_quota_ratelimit.yaml) deploys a second
rate-limit service for its QuotaPolicies: ``/bin/ratelimit`` with an argument of its own,
Redis, and the config over plain-text xDS as node ``envoy-ai-gateway-ratelimit`` from the
controller (our ManagementServer stands in for its internal/ratelimit/runner). The requests
come from a real Envoy whose routes carry the actions its extension server adds
(fixtures/ai_gateway/envoy.yaml): a check costing 1, then the tokens used charged after the
response, for the QuotaPolicy's RateLimitConfig (fixtures/ai_gateway/ratelimit-config.yaml).
"""

import os
import re
import sys
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
from redis_servers import RedisProcess
from servers import ROOT, ServerProcess, fairlimit_server, free_port
from xds_server import ManagementServer

pytestmark = pytest.mark.process

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ai_gateway"
GUIDE = ROOT / "docs" / "envoy-gateway.md"
COMMAND = ROOT / "docker" / "ratelimit"
ARGUMENT = "--quotaRateLimitServiceAddr=envoy-ai-gateway-ratelimit.envoy-gateway-system"
CALLS = "cluster.ai_gateway_ratelimit_cluster.upstream_rq_completed"


def deployment_env(xds_port: int, redis_port: int, grpc_port: int) -> dict[str, str]:
    """The e2e's Deployment environment, with loopback addresses; then the HTTP and debug
    listen addresses, which it leaves at their defaults (0.0.0.0:8080, :6070)."""
    deployment = {
        "LOG_LEVEL": "debug",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": f"127.0.0.1:{redis_port}",  # redis.redis-system.svc.cluster.local:6379
        "RUNTIME_ROOT": "/data",
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "USE_STATSD": "false",
        "CONFIG_TYPE": "GRPC_XDS_SOTW",
        "CONFIG_GRPC_XDS_NODE_ID": "envoy-ai-gateway-ratelimit",
        "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{xds_port}",  # ai-gateway-controller...:18002
        "GRPC_PORT": str(grpc_port),  # 8081
    }
    loopback = {"GRPC_HOST": "127.0.0.1", "HOST": "127.0.0.1", "PORT": "0",
                "DEBUG_HOST": "127.0.0.1", "DEBUG_PORT": "0"}  # fmt: skip
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**deployment, **loopback, "PATH": path}


@dataclass
class AiGateway:
    management: ManagementServer
    server: ServerProcess
    proxy: EnvoyProcess
    first_request: Any

    def chat(self, model: str, tokens: int, headers: dict[str, str] | None = None) -> int:
        """One call to ``model`` that uses ``tokens``; returns the status once Envoy has
        sent what it sends for it (the check; after a 200, the charge)."""
        before = self.proxy.stat(CALLS)
        ask = {"x-ai-eg-model": model, "x-simulated-tokens": str(tokens), **(headers or {})}
        code = http_get(self.proxy.url + "v1/chat/completions", ask)[0]
        self.proxy.wait_for_stat(CALLS, before + (2 if code == 200 else 1))
        return code


@pytest.fixture(scope="module")
def ai_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AiGateway]:
    """Redis, the controller's xDS (no force start: the first config comes first), the
    rate-limit Deployment's command, argument and environment, then the proxy."""
    tmp = tmp_path_factory.mktemp("ai-gateway")
    redis = RedisProcess(tmp).start()
    management = ManagementServer()
    text = (FIXTURES / "ratelimit-config.yaml").read_text()
    management.push(
        "1", json_format.ParseDict(yaml.safe_load(text), rls_conf_pb2.RateLimitConfig())
    )
    env = deployment_env(management.port, redis.port, free_port())
    command = ["sh", str(COMMAND), ARGUMENT]
    try:
        with fairlimit_server(env=env, loopback_ports=False, serve=command) as server:
            first = management.request()
            management.acked("1")
            bootstrap = (FIXTURES / "envoy.yaml").read_text()
            with envoy_on(bootstrap, server.grpc_port, tmp) as proxy:
                yield AiGateway(management, server, proxy, first)
    finally:
        management.stop()
        redis.stop()


class TestDeployment:
    def test_the_controllers_node_and_the_ignored_argument(self, ai_gateway: AiGateway) -> None:
        first = ai_gateway.first_request
        assert (first.node.id, first.type_url) == ("envoy-ai-gateway-ratelimit", TYPE_URL)
        ignored = [line for line in ai_gateway.server.lines if "ignores its arguments" in line]
        assert len(ignored) == 1 and ARGUMENT in ignored[0]


class TestPerModelQuota:
    def test_tokens_used_past_the_quota_refuse_the_next_call(self, ai_gateway: AiGateway) -> None:
        """The e2e's sequence: 10 tokens an hour; a call that uses 20 passes (its check
        came first), the next is refused."""
        assert ai_gateway.chat("quota-test-model", 20) == 200
        assert ai_gateway.chat("quota-test-model", 5) == 429

    def test_a_bucket_rule_and_the_default_bucket_in_shared_mode(
        self, ai_gateway: AiGateway
    ) -> None:
        """Default bucket 10 a day, premium 40 a day: a standard caller has only the
        default bucket (1+8, then 1+8: the third check finds 19); a premium caller is in
        both, and passes while the premium bucket has room, though the default is over
        (1+30, 1+30: the third check finds 63)."""
        standard = [ai_gateway.chat("quota-bucket-model", 8) for _ in range(3)]
        assert standard == [200, 200, 429]
        premium = {"x-api-tier": "premium"}
        calls = [ai_gateway.chat("quota-bucket-model", 30, premium) for _ in range(3)]
        assert calls == [200, 200, 429]


class TestGuide:
    def test_the_guides_deployment_is_the_tested_one(self) -> None:
        """docs/envoy-gateway.md's Deployment: the command and variables run here (their
        addresses aside)."""
        blocks = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S)
        (manifest,) = [b for b in blocks if "kind: Deployment" in b]
        deployment = next(d for d in yaml.safe_load_all(manifest) if d["kind"] == "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert (container["command"], container["args"]) == (["/bin/ratelimit"], [ARGUMENT])
        env = {e["name"]: e["value"] for e in container["env"]}
        tested = deployment_env(18002, 6379, 8081)
        addresses = {"REDIS_URL", "CONFIG_GRPC_XDS_SERVER_URL"}
        loopback = {"GRPC_HOST", "HOST", "PORT", "DEBUG_HOST", "DEBUG_PORT", "PATH"}
        assert env.keys() == tested.keys() - loopback
        assert {k: v for k, v in env.items() if k not in addresses} == {
            k: tested[k] for k in env.keys() - addresses}  # fmt: skip
