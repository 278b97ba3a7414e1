"""The xDS config source (CONFIG_TYPE=GRPC_XDS_SOTW) against a management server of our own."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from envoy_proxy import EnvoyProcess, envoy_on, http_get
from envoy_proxy import bootstrap as envoy_bootstrap
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit._proto.ratelimit.config.ratelimit.v3 import rls_conf_pb2
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError
from fairlimit.grpc_api.xds import TYPE_URL, XdsConfigSource, load_resources
from fairlimit.settings.xds import XdsSection
from helpers import STARTUP_SECONDS
from servers import ROOT, fairlimit_server, free_port
from xds_server import ManagementServer, response

pytestmark = pytest.mark.behaviour

RLC = rls_conf_pb2


def _config(name: str, domain: str, per_minute: int, *, shared: bool = False) -> Any:
    """One RateLimitConfig: ``key=client`` limited per minute (``value`` when ``shared``)."""
    descriptor = RLC.RateLimitDescriptor(
        key="client",
        value="team-*" if shared else "",
        rate_limit=RLC.RateLimitPolicy(unit=RLC.MINUTE, requests_per_unit=per_minute),
        quota_mode=shared,
    )
    descriptor.metadata.update({"tier": "gold"})
    return RLC.RateLimitConfig(name=name, domain=domain, descriptors=[descriptor])


@pytest.fixture
def management() -> Iterator[ManagementServer]:
    server = ManagementServer()
    yield server
    server.stop()


class TestResources:
    def test_a_config_loads_as_its_yaml_would(self) -> None:
        loaded = load_resources([response("1", _config("a", "edge", 5)).resources[0]])
        rule = loaded.config.domains["edge"].rules[0]
        assert (rule.key, rule.value, rule.rate_limit.requests_per_unit) == ("client", None, 5)  # type: ignore[union-attr]
        assert rule.metadata == {"tier": "gold"} and not rule.quota_mode

    def test_problems_name_the_resource(self) -> None:
        with pytest.raises(ConfigError) as caught:
            load_resources(list(response("1", _config("a", "", 1), _config("b", "e", 1))
                                .resources))  # fmt: skip
        assert caught.value.problems == ["a: (file): config file cannot have empty domain"]

    def test_a_set_that_limits_nothing_loads(self) -> None:
        """No resource (Envoy Gateway's snapshot once no Gateway has a policy), or rules
        that limit nothing (unlimited): a config like any other, as upstream loads it."""
        unlimited = RLC.RateLimitDescriptor(key="client", rate_limit=RLC.RateLimitPolicy(
            unlimited=True))  # fmt: skip
        only = RLC.RateLimitConfig(name="a", domain="edge", descriptors=[unlimited])
        assert list(load_resources([]).config.domains) == []
        assert list(load_resources(list(response("1", only).resources)).config.domains) == [
            "edge"]  # fmt: skip


class TestStream:
    async def test_apply_and_ack_then_nack_a_bad_set(self, management: ManagementServer) -> None:
        """v1 is applied and ACKed; a v2 with a duplicate domain is NACKed, v1 stays."""
        applied: list[Loaded] = []
        rejected: list[ConfigError] = []
        settings = XdsSection(f"127.0.0.1:{management.port}", "node-7", (("zone", "eu"),),
                              (("x-token", "t"),), retry_seconds=0.1)  # fmt: skip
        source = XdsConfigSource(settings, strict=False, merge_domains=False,
                                 apply=applied.append, reject=rejected.append)  # fmt: skip
        running = asyncio.ensure_future(source.run())
        try:
            first = await asyncio.to_thread(management.request)
            assert (first.node.id, first.type_url, first.version_info) == ("node-7", TYPE_URL, "")
            assert first.node.metadata["zone"] == "eu"
            management.to_send.put(response("1", _config("a", "edge", 5)))
            ack = await asyncio.to_thread(management.request)
            assert (ack.version_info, ack.response_nonce) == ("1", "n1")
            assert not ack.HasField("error_detail") and management.metadata["x-token"] == "t"
            assert [sorted(x.config.domains) for x in applied] == [["edge"]]
            management.to_send.put(response("2", _config("a", "edge", 5), _config("b", "edge", 1)))
            nack = await asyncio.to_thread(management.request)
            assert (nack.version_info, nack.response_nonce) == ("1", "n2")
            assert "duplicate domain 'edge'" in nack.error_detail.message
            assert len(applied) == 1 and len(rejected) == 1
        finally:
            source.stop()
            await running

    async def test_an_empty_set_is_applied_and_acked(self, management: ManagementServer) -> None:
        """v1 limits; an empty v2 (every resource gone: the last policy deleted) is applied
        and ACKed, as upstream takes it; nothing is rejected."""
        applied: list[Loaded] = []
        rejected: list[ConfigError] = []
        settings = XdsSection(f"127.0.0.1:{management.port}", retry_seconds=0.1)
        source = XdsConfigSource(settings, strict=False, merge_domains=False,
                                 apply=applied.append, reject=rejected.append)  # fmt: skip
        running = asyncio.ensure_future(source.run())
        try:
            await asyncio.to_thread(management.request)
            management.to_send.put(response("1", _config("a", "edge", 5)))
            await asyncio.to_thread(management.acked, "1")
            management.to_send.put(response("2"))
            answer = await asyncio.to_thread(management.request)
        finally:
            source.stop()
            await running
        assert answer.version_info == "2" and not answer.HasField("error_detail")
        assert (source.version, rejected) == ("2", [])
        assert [sorted(x.config.domains) for x in applied] == [["edge"], []]

    async def test_an_empty_first_set_is_a_first_config(
        self, management: ManagementServer
    ) -> None:
        """A first snapshot that limits nothing (no Gateway has a policy yet) is applied and
        ACKed, and sets ``applied``: the app starts serving, limiting nothing."""
        applied: list[Loaded] = []
        settings = XdsSection(f"127.0.0.1:{management.port}", retry_seconds=0.1)
        source = XdsConfigSource(settings, strict=False, merge_domains=False,
                                 apply=applied.append, reject=lambda _: None)  # fmt: skip
        running = asyncio.ensure_future(source.run())
        try:
            await asyncio.to_thread(management.request)
            management.to_send.put(response("1"))
            await asyncio.to_thread(management.acked, "1")
            assert source.applied.is_set() and [list(x.config.domains) for x in applied] == [[]]
        finally:
            source.stop()
            await running


class TestServing:
    def test_fairlimit_serves_what_the_management_server_pushes(
        self, management: ManagementServer
    ) -> None:
        """Only upstream variables; it starts serving once the first config has arrived."""
        management.to_send.put(response("1", _config("edge-config", "edge", 2)))
        env = {"CONFIG_TYPE": "GRPC_XDS_SOTW",
               "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{management.port}",
               "CONFIG_GRPC_XDS_NODE_ID": "fairlimit-test"}  # fmt: skip
        with fairlimit_server(env=env) as server, grpc.insecure_channel(server.target) as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            request = rls_pb2.RateLimitRequest(
                domain="edge", descriptors=[{"entries": [{"key": "client", "value": "c"}]}]
            )
            codes = [stub.ShouldRateLimit(request, timeout=5).overall_code for _ in range(3)]
            assert codes == [rls_pb2.RateLimitResponse.OK] * 2 + [
                rls_pb2.RateLimitResponse.OVER_LIMIT]  # fmt: skip
        requests = [management.request(), management.request()]
        assert requests[0].node.id == "fairlimit-test"
        assert requests[1].version_info == "1"  # the ACK

    def test_over_mtls_with_upstreams_tls_variables(self, tls_files: dict[str, Path]) -> None:
        """CONFIG_GRPC_XDS_SERVER_USE_TLS with a client certificate: Envoy Gateway's setup."""
        management = ManagementServer(tls_files)
        try:
            management.to_send.put(response("7", _config("edge-config", "edge", 1)))
            env = {"CONFIG_TYPE": "GRPC_XDS_SOTW",
                   "CONFIG_GRPC_XDS_SERVER_URL": f"localhost:{management.port}",
                   "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
                   "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": str(tls_files["ca.crt"]),
                   "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": str(tls_files["client.crt"]),
                   "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": str(tls_files["client.key"]),
                   "CONFIG_GRPC_XDS_SERVER_TLS_SAN": "localhost"}  # fmt: skip
            with fairlimit_server(env=env):
                pass  # it serves only once the first config was applied
            requests = [management.request(), management.request()]
            assert requests[1].version_info == "7" and not requests[1].HasField("error_detail")
        finally:
            management.stop()


def _xds_env(management: ManagementServer, **more: str) -> dict[str, str]:
    return {"CONFIG_TYPE": "GRPC_XDS_SOTW",
            "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{management.port}",
            "CONFIG_GRPC_XDS_NODE_ID": "envoy-ratelimit", **more}  # fmt: skip


def _codes(target: str, domain: str, calls: int) -> list[int]:
    with grpc.insecure_channel(target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        request = rls_pb2.RateLimitRequest(
            domain=domain, descriptors=[{"entries": [{"key": "client", "value": "c"}]}]
        )
        return [stub.ShouldRateLimit(request, timeout=5).overall_code for _ in range(calls)]


def _metrics(admin_port: int) -> str:
    return http_get(f"http://127.0.0.1:{admin_port}/metrics")[2].decode()


class TestLoadCount:
    def test_the_first_config_counts_once(self, management: ManagementServer) -> None:
        """config_load_success is 1 after the first snapshot, 2 after the next."""
        management.to_send.put(response("1", _config("edge-config", "edge", 2)))
        env = _xds_env(management, FAIRLIMIT_METRICS_COMPAT="true")
        with fairlimit_server(env=env) as server:
            assert "ratelimit_service_config_load_success 1\n" in _metrics(server.admin_port)
            management.to_send.put(response("2", _config("edge-config", "edge", 3)))
            while management.request().version_info != "2":  # the ACK follows the apply
                pass
            assert "ratelimit_service_config_load_success 2\n" in _metrics(server.admin_port)


class TestEmptySet:
    def test_a_pushed_set_without_limits_is_applied_and_the_limits_go(
        self, management: ManagementServer
    ) -> None:
        """An empty snapshot after v1 is ACKed, counted as a successful load and logged;
        /readyz stays plainly ready, and v1's limit no longer applies."""
        management.to_send.put(response("1", _config("edge-config", "edge", 2)))
        env = _xds_env(management, FAIRLIMIT_METRICS_COMPAT="true")
        with fairlimit_server(env=env) as server:
            management.acked("1")
            assert _codes(server.target, "edge", 3)[-1] == rls_pb2.RateLimitResponse.OVER_LIMIT
            management.to_send.put(response("2"))
            ack = management.acked("2")
            server.wait_for(r"config reloaded: no rate limit in any domain")
            status, _, ready = http_get(f"http://127.0.0.1:{server.admin_port}/readyz")
            metrics = _metrics(server.admin_port)
            codes = _codes(server.target, "edge", 3)
        assert ack.response_nonce == "n2" and not ack.HasField("error_detail")
        assert (status, ready) == (200, b"ready\n")
        assert "ratelimit_service_config_load_success 2\n" in metrics
        assert "ratelimit_service_config_load_error 0\n" in metrics
        assert codes == [rls_pb2.RateLimitResponse.OK] * 3


class TestForceStart:
    """FORCE_START_WITHOUT_INITIAL_CONFIG=true, as Envoy Gateway sets it: serve at once,
    before the management server has sent anything (it sends nothing until a Gateway with
    a rate limit exists), and take the config when it comes."""

    def test_serves_before_the_first_config_then_applies_it(
        self, management: ManagementServer
    ) -> None:
        env = _xds_env(management, FORCE_START_WITHOUT_INITIAL_CONFIG="true",
                       FAIRLIMIT_METRICS_COMPAT="true")  # fmt: skip
        with fairlimit_server(env=env) as server:
            health = http_get(f"http://127.0.0.1:{server.admin_port}/healthcheck")
            assert (health[0], health[2]) == (200, b"OK")
            assert _codes(server.target, "edge", 3) == [rls_pb2.RateLimitResponse.OK] * 3
            assert "ratelimit_service_config_load_success 0\n" in _metrics(server.admin_port)
            assert management.request().node.id == "envoy-ratelimit"  # it asked meanwhile
            management.to_send.put(response("1", _config("edge-config", "edge", 2)))
            assert management.request().version_info == "1"  # the ACK: applied
            codes = _codes(server.target, "edge", 3)
            assert codes == [rls_pb2.RateLimitResponse.OK] * 2 + [
                rls_pb2.RateLimitResponse.OVER_LIMIT]  # fmt: skip
            assert "ratelimit_service_config_load_success 1\n" in _metrics(server.admin_port)

    def test_ready_only_with_a_domain_when_asked(self, management: ManagementServer) -> None:
        """With HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED too, /healthcheck says 500 until a
        config with a domain has arrived, then 200: the ports are open from the start."""
        env = _xds_env(management, FORCE_START_WITHOUT_INITIAL_CONFIG="true",
                       HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED="true")  # fmt: skip
        with fairlimit_server(env=env) as server:
            url = f"http://127.0.0.1:{server.admin_port}/healthcheck"
            assert http_get(url)[0] == 500
            management.request()
            management.to_send.put(response("1", _config("edge-config", "edge", 2)))
            assert management.request().version_info == "1"
            deadline = time.monotonic() + STARTUP_SECONDS
            while http_get(url)[0] != 200:  # readiness follows the apply on the loop
                assert time.monotonic() < deadline, "".join(server.lines)
                time.sleep(0.02)  # polls; asserts no duration


class TestWaiting:
    def test_sigterm_while_waiting_for_the_first_config_ends_it(
        self, management: ManagementServer
    ) -> None:
        """Without force start it waits for the first config; a SIGTERM meanwhile (a probe
        giving up, a rollout) ends it at once with 0, not after the grace period's SIGKILL."""
        env = {**os.environ, "PYTHONPATH": str(ROOT / "server"), **_xds_env(management)}
        command = [sys.executable, "-m", "fairlimit", "serve", "--grpc-addr", "127.0.0.1:0",
                   "--admin-addr", "127.0.0.1:0"]  # fmt: skip
        process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert process.stderr is not None
            lines = []
            for line in process.stderr:  # ends at EOF should it exit early
                lines.append(line)
                if "waiting for the first config" in line:
                    break
            assert management.request().node.id == "envoy-ratelimit"
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=STARTUP_SECONDS)
            rest = process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stderr is not None:
                process.stderr.close()
        assert code == 0, "".join(lines) + rest
        assert "stopped before serving" in rest and "Traceback" not in rest


class TestCharges:
    """A RateLimitConfig cannot say charge_when_over_limit: pushed over xDS, every hit
    counts, refused or not, as upstream counts it (Envoy Gateway's cost.response)."""

    def test_a_charge_past_the_limit_is_counted(self, management: ManagementServer) -> None:
        """1000/h charged +600 twice: the second is OVER_LIMIT with 0 left, and so is the
        check (hits_addend 0) after it."""
        hourly = RLC.RateLimitDescriptor(
            key="client", rate_limit=RLC.RateLimitPolicy(unit=RLC.HOUR, requests_per_unit=1000)
        )
        config = RLC.RateLimitConfig(name="edge-config", domain="edge", descriptors=[hourly])
        management.to_send.put(response("1", config))
        answers = []
        with (
            fairlimit_server(env=_xds_env(management)) as server,
            grpc.insecure_channel(server.target) as channel,
        ):
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            for hits in (600, 600, 0):
                entries = [{"key": "client", "value": "c"}]
                descriptor = {"entries": entries, "hits_addend": {"value": hits}}
                request = rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor])
                answer = stub.ShouldRateLimit(request, timeout=5)
                answers.append((answer.overall_code, answer.statuses[0].limit_remaining))
        ok, over = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
        assert answers == [(ok, 400), (over, 0), (over, 0)]


# examples/envoy/tokens.yaml (a check with hits_addend 0, then the response's x-tokens-used
# charged at stream end) with the descriptors Envoy AI Gateway's QuotaPolicy sends: the
# backend, then the model (there from ext_proc's dynamic metadata, here from headers).
TOKENS = ROOT / "examples" / "envoy" / "tokens.yaml"
AI_GATEWAY_EDITS = {
    "domain: edge": "domain: ai-gateway-quota",
    "generic_key: {descriptor_key: provider, descriptor_value: llm}":
        "generic_key: {descriptor_key: backend_name, descriptor_value: default/testupstream}",
    "request_headers: {header_name: x-tenant, descriptor_key: tenant}":
        "request_headers: {header_name: x-ai-eg-model, descriptor_key: model_name_override}",
    "headers: [{name: x-tenant, present_match: true}]":
        "headers: [{name: x-ai-eg-model, present_match: true}]",
}  # fmt: skip
COMMAND = ROOT / "docker" / "ratelimit"


def _quota_config(tokens_per_hour: int) -> Any:
    """What Envoy AI Gateway's controller pushes for a QuotaPolicy's per-model default
    bucket (mode Shared): backend, then model, quota_mode, per hour."""
    model = RLC.RateLimitDescriptor(
        key="model_name_override", value="quota-test-model", quota_mode=True,
        rate_limit=RLC.RateLimitPolicy(unit=RLC.HOUR, requests_per_unit=tokens_per_hour),
    )  # fmt: skip
    backend = RLC.RateLimitDescriptor(
        key="backend_name", value="default/testupstream", descriptors=[model]
    )
    return RLC.RateLimitConfig(
        name="ai-gateway-quota", domain="ai-gateway-quota", descriptors=[backend]
    )


def _rls_calls(proxy: EnvoyProcess) -> int:
    """Rate-limit calls Envoy has completed (its fairlimit cluster's finished requests)."""
    _, _, body = http_get(f"http://127.0.0.1:{proxy.admin}/stats?format=json&filter=^cluster")
    stats = {s["name"]: s.get("value", 0) for s in json.loads(body)["stats"] if "name" in s}
    return int(stats.get("cluster.fairlimit.upstream_rq_completed", 0))


class TestEnvoyAiGatewayQuota:
    @pytest.mark.process
    def test_a_models_token_quota_stops_the_next_call(
        self, management: ManagementServer, tmp_path: Path
    ) -> None:
        """Envoy AI Gateway's quota e2e: 10 tokens an hour for the model; a call that used
        20 passes (its check came first), the next gets 429. /bin/ratelimit with the
        Deployment's environment and argument, the config pushed over xDS, a real Envoy."""
        management.to_send.put(response("1", _quota_config(10)))
        port = free_port()
        env = {
            "LOG_LEVEL": "debug", "REDIS_SOCKET_TYPE": "tcp", "RUNTIME_ROOT": "/data",
            "RUNTIME_SUBDIRECTORY": "ratelimit", "USE_STATSD": "false",
            "CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_NODE_ID": "envoy-ai-gateway-ratelimit",
            "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{management.port}",
            "GRPC_HOST": "127.0.0.1", "GRPC_PORT": str(port), "HOST": "127.0.0.1", "PORT": "0",
            "DEBUG_HOST": "127.0.0.1", "DEBUG_PORT": "0",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }  # fmt: skip
        command = ["sh", str(COMMAND), "--quotaRateLimitServiceHost=envoy-ai-gateway-ratelimit"]
        text = envoy_bootstrap(TOKENS, AI_GATEWAY_EDITS)
        with (
            fairlimit_server(env=env, loopback_ports=False, serve=command) as server,
            envoy_on(text, server.grpc_port, tmp_path) as proxy,
        ):
            ask = {"x-ai-eg-model": "quota-test-model", "x-simulated-tokens": "20"}
            first = http_get(proxy.url, ask)
            deadline = time.monotonic() + STARTUP_SECONDS
            while _rls_calls(proxy) < 2:  # the check, then the charge after the response
                assert time.monotonic() < deadline, "the charge never reached fairlimit"
                time.sleep(0.02)  # polls Envoy's counter; asserts no duration
            second = http_get(proxy.url, ask)
        assert (first[0], first[1]["x-tokens-used"]) == (200, "20")
        assert second[0] == 429
