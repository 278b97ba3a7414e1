"""What an envoyproxy/ratelimit deployment sees from outside: settings, /healthcheck,
response headers and dynamic metadata, and the metric names of upstream's Prometheus mapping."""

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from google.protobuf import json_format

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.admin import AdminServer, JsonCodec, config_report
from fairlimit.config.loader import load
from fairlimit.core.rules import Loaded
from fairlimit.core.upstream import labels, stat_key
from fairlimit.grpc_api.convert import request_from_proto, response_to_proto
from fairlimit.grpc_api.headers import ResponseOptions, add_extras
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.limiter import Limiter
from fairlimit.settings import Settings
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.upstream import UpstreamStats
from helpers import FakeClock, load_text

pytestmark = pytest.mark.behaviour

KEYS = Path(__file__).parents[1] / "fixtures" / "upstream" / "keys"


def _loaded(tmp_path: Path, name: str) -> Loaded:
    return load_text(tmp_path, (KEYS / name).read_text(), name)


def _message(domain: str, *descriptors: list[tuple[str, str]]) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(
        domain=domain,
        descriptors=[{"entries": [{"key": k, "value": v} for k, v in d]} for d in descriptors],
    )


async def _answer(
    limiter: Limiter, message: rls_pb2.RateLimitRequest, options: ResponseOptions
) -> rls_pb2.RateLimitResponse:
    decision = await limiter.should_rate_limit(request_from_proto(message))
    response = response_to_proto(decision)
    add_extras(response, message, decision.statuses, options)
    return response


class TestSettings:
    def test_fairlimit_variables_win_over_upstream_ones(self, tmp_path: Path) -> None:
        env = {"GRPC_PORT": "9999", "FAIRLIMIT_GRPC_ADDR": "127.0.0.1:7000",
               "SHADOW_MODE": "true", "NEAR_LIMIT_RATIO": "0.5"}  # fmt: skip
        settings = Settings.from_env(env)
        assert (settings.grpc_addr, settings.shadow) == ("127.0.0.1:7000", True)
        assert settings.near_limit_ratio == 0.5

    def test_flags_win_over_both(self) -> None:
        settings = Settings.from_env({"GRPC_PORT": "9999"}).override({"grpc_addr": "[::1]:1"})
        assert settings.grpc_addr == "[::1]:1"

    def test_the_runtime_layout_is_the_config_directory(self) -> None:
        env = {"RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "rl", "MERGE_DOMAIN_CONFIG": "1"}
        settings = Settings.from_env(env)
        assert settings.config == (Path("/data/rl/config"),)
        assert settings.merge_domains

    def test_charges_follow_upstream_where_the_config_cannot_say(self) -> None:
        """Every hit counts for xDS and under upstream's layout; fairlimit's own files keep
        "a refused request consumes nothing"; FAIRLIMIT_CHARGE_WHEN_OVER_LIMIT decides."""
        xds = {"CONFIG_TYPE": "GRPC_XDS_SOTW"}
        assert Settings.from_env(xds).charges_over_limit
        assert Settings.from_env({"RUNTIME_ROOT": "/data"}).charges_over_limit
        assert not Settings.from_env({}).charges_over_limit
        off = {**xds, "FAIRLIMIT_CHARGE_WHEN_OVER_LIMIT": "false"}
        assert not Settings.from_env(off).charges_over_limit
        flag = Settings.from_env({}).override({"charge_when_over_limit": "true"})
        assert flag.charges_over_limit

    def test_one_warning_names_every_unsupported_variable(self) -> None:
        settings = Settings.from_env({"EXTRA_TAGS": "a:b", "MEMCACHE_SRV": "x"})
        assert settings.upstream_warning() == (
            "envoyproxy/ratelimit settings not supported by fairlimit, ignored: EXTRA_TAGS, "
            "MEMCACHE_SRV (see docs/migrating-from-envoy-ratelimit.md)"
        )
        assert Settings.from_env({}).upstream_warning() is None


class TestHealthcheck:
    @pytest.fixture
    async def admin(self, tmp_path: Path) -> AsyncIterator[tuple[str, AdminServer]]:
        limiter = Limiter(_loaded(tmp_path, "modes.yaml"), MemoryStore(), FakeClock())
        server = AdminServer(
            limiter, "127.0.0.1", 0, JsonCodec(request_from_json, response_to_json),
            healthy_with_config=True,
        )  # fmt: skip
        await server.start()
        yield f"http://127.0.0.1:{server.port}/healthcheck", server
        await server.stop()

    async def test_ok_then_500_while_draining(self, admin: tuple[str, AdminServer]) -> None:
        """200 ``OK`` as upstream answers it; 500 once SIGTERM starts the drain."""
        url, server = admin
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as response:
                assert (response.status, await response.text()) == (200, "OK")
            server.draining = True
            async with http.get(url) as response:
                assert response.status == 500

    async def test_500_with_no_domain_when_a_config_is_required(
        self, admin: tuple[str, AdminServer], tmp_path: Path
    ) -> None:
        """HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED: an empty config is unhealthy."""
        url, server = admin
        (tmp_path / "none").mkdir()
        server.limiter.swap(load([tmp_path / "none"], allow_empty=True))
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            assert response.status == 500


class TestRlconfig:
    def test_upstream_keys_are_shown(self, tmp_path: Path) -> None:
        """/rlconfig shows quota_mode, share_threshold and metadata where a rule sets them."""
        report = config_report(_loaded(tmp_path, "quota_mode.yaml"), ())
        assert report["domains"][0]["descriptors"][0]["quota_mode"] is True
        files = config_report(_loaded(tmp_path, "share_threshold.yaml"), ())
        assert files["domains"][0]["descriptors"][0]["share_threshold"] is True
        tiers = config_report(_loaded(tmp_path, "metadata.yaml"), ())
        assert tiers["domains"][0]["descriptors"][1]["metadata"] == {
            "tier": "free", "nested": {"trial": True}}  # fmt: skip


class TestResponseParts:
    async def test_headers_describe_the_descriptor_closest_to_its_limit(
        self, tmp_path: Path
    ) -> None:
        limiter = Limiter(_loaded(tmp_path, "modes.yaml"), MemoryStore(), FakeClock())
        options = ResponseOptions(headers=True, reset_header="X-Reset")
        message = _message("modes", [("user", "u")], [("vip", "yes")])
        response = await _answer(limiter, message, options)
        headers = {h.key: h.value for h in response.response_headers_to_add}
        assert headers == {"RateLimit-Limit": "50", "RateLimit-Remaining": "49", "X-Reset": "40"}

    async def test_an_ordinary_descriptor_over_wins(self, tmp_path: Path) -> None:
        limiter = Limiter(_loaded(tmp_path, "modes.yaml"), MemoryStore(), FakeClock())
        message = _message("modes", [("experiment", "e")], [("closed", "x")])
        response = await _answer(limiter, message, ResponseOptions(headers=True))
        headers = {h.key: h.value for h in response.response_headers_to_add}
        assert (headers["RateLimit-Limit"], headers["RateLimit-Remaining"]) == ("0", "0")

    async def test_dynamic_metadata_merges_the_rules_that_passed(self, tmp_path: Path) -> None:
        limiter = Limiter(_loaded(tmp_path, "metadata.yaml"), MemoryStore(), FakeClock())
        message = _message("tiers", [("plan", "gold")], [("plan", "free")])
        response = await _answer(limiter, message, ResponseOptions(metadata=True))
        assert json_format.MessageToDict(response.dynamic_metadata) == {
            "domain": "tiers",
            "descriptors": [{"entries": ["plan=gold"]}, {"entries": ["plan=free"]}],
            "metadata": {"tier": "gold", "weight": 3.0, "ratio": 0.5, "labels": ["a", "b"],
                         "nested": {"beta": True, "trial": True}},
        }  # fmt: skip
        over = await _answer(limiter, _message("tiers", [("plan", "free")]),
                             ResponseOptions(metadata=True))  # fmt: skip
        assert "metadata" not in json_format.MessageToDict(over.dynamic_metadata)


class TestUpstreamMetricNames:
    def test_stat_keys_follow_value_to_metric_detailed_metric_and_share_threshold(
        self, tmp_path: Path
    ) -> None:
        rules = _loaded(tmp_path, "metrics.yaml").config.domains["metrics"].rules
        tenant, route, client, plain = rules
        assert stat_key("metrics", [("tenant", "t1"), ("method", "GET")],
                        [tenant, tenant.children[0]]) == "metrics.tenant_t1.method"  # fmt: skip
        assert stat_key("metrics", [("route", "api/v1")], [route]) == "metrics.route_api/v1"
        assert stat_key("metrics", [("client", "c9")], [client]) == "metrics.client_c9"
        assert stat_key("metrics", [("plain", "p")], [plain]) == "metrics.plain"
        shared = _loaded(tmp_path, "share_threshold.yaml").config.domains["files"].rules[0]
        assert stat_key("files", [("path", "/static/a")], [shared]) == "files.path_/static/*"
        assert stat_key("d", [("ip", "10.0.0.1")], [client]) == "d.ip_10_0_0_1"

    def test_labels_of_the_default_mapping(self) -> None:
        assert labels("edge.route_public") == {"domain": "edge", "key1": "route_public"}
        assert labels("edge.route_public.client_id.x") == {
            "domain": "edge", "key1": "route_public", "key2": "client_id"}  # fmt: skip

    async def test_counts_and_names_as_upstream(self, tmp_path: Path) -> None:
        """over_limit counts only the hits past the limit, near_limit those before it."""
        telemetry = Telemetry()
        telemetry.upstream = UpstreamStats(near_ratio=0.5)
        limiter = Limiter(_loaded(tmp_path, "metrics.yaml"), MemoryStore(), FakeClock(),
                          telemetry=telemetry)  # fmt: skip
        message = _message("metrics", [("plain", "p")])
        for hits in (40, 70):  # 40 within (none near: 50 is the threshold); then 60 over
            message.hits_addend = hits
            await limiter.should_rate_limit(request_from_proto(message))
        text = telemetry.upstream.render()
        series = '{domain="metrics",key1="plain"}'
        assert f"ratelimit_service_rate_limit_total_hits{series} 110" in text
        assert f"ratelimit_service_rate_limit_within_limit{series} 40" in text
        assert f"ratelimit_service_rate_limit_over_limit{series} 10" in text
        assert f"ratelimit_service_rate_limit_near_limit{series} 50" in text
        assert "# TYPE ratelimit_service_rate_limit_total_hits counter" in text
