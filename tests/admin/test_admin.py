"""The HTTP admin through a real client: health, readiness, POST /json, /rlconfig, /metrics."""

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from fairlimit.admin import AdminServer, JsonCodec
from fairlimit.errors import StoreUnavailable
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.limiter import Limiter
from fairlimit.settings import FailureMode
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, desc, load_text, req

pytestmark = pytest.mark.behaviour

JSON_CODEC = JsonCodec(request_from_json, response_to_json)  # as app.py passes it

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 2}
  - key: generic_key
    value: api
    rate_limit: {unit: minute, requests_per_unit: 10}
"""


def rls_json(*pairs: tuple[str, str], domain: str = "edge") -> str:
    entries = [{"key": k, "value": v} for k, v in pairs]
    return json.dumps({"domain": domain, "descriptors": [{"entries": entries}]})


class DownStore(MemoryStore):
    """A backend that stopped answering."""

    async def admit(self, plan, now):  # type: ignore[no-untyped-def]
        raise StoreUnavailable("connection refused")

    async def ping(self) -> None:
        raise StoreUnavailable("connection refused")


Serve = Callable[..., Any]


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    """``await serve(store, **options)``: an admin server over a fresh limiter -> (URL, limiter)."""
    servers: list[AdminServer] = []

    async def start(store: MemoryStore | None = None, **options: Any) -> tuple[str, Limiter]:
        telemetry = Telemetry(MeterProvider(), TracerProvider())
        store = store if store is not None else MemoryStore()  # an empty store is falsy
        loaded = load_text(tmp_path, CONFIG)
        json_from = options.pop("json_from", "loopback")
        limiter = Limiter(loaded, store, FakeClock(), telemetry=telemetry, **options)
        server = AdminServer(limiter, "127.0.0.1", 0, JSON_CODEC, json_from=json_from)
        await server.start()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}", limiter

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class TestHealth:
    async def test_alive_and_ready(self, serve: Serve, http: aiohttp.ClientSession) -> None:
        """/healthz and /readyz answer 200 with the config loaded and the backend up."""
        base, _ = await serve()
        for path in ("/healthz", "/readyz"):
            async with http.get(base + path) as response:
                assert response.status == 200, path

    async def test_not_ready_while_the_backend_is_down(
        self, serve: Serve, http: aiohttp.ClientSession
    ) -> None:
        """/readyz is 503 when store.ping() fails; /healthz stays 200 (restarting won't help)."""
        base, _ = await serve(DownStore())
        async with http.get(base + "/readyz") as response:
            assert response.status == 503
            assert "backend unavailable" in await response.text()
        async with http.get(base + "/healthz") as response:
            assert response.status == 200


class TestJson:
    async def test_ok_then_over_limit(self, serve: Serve, http: aiohttp.ClientSession) -> None:
        """200 with the RateLimitResponse in proto3 JSON, then 429 once over."""
        base, _ = await serve()
        body = rls_json(("route", "public"), ("client_id", "alice"))
        answers = []
        for _ in range(3):
            async with http.post(base + "/json", data=body) as response:
                answers.append((response.status, await response.json()))
        assert [status for status, _ in answers] == [200, 200, 429]
        first, last = answers[0][1], answers[2][1]
        assert first["overallCode"] == "OK"
        assert first["statuses"][0]["currentLimit"] == {"requestsPerUnit": 2, "unit": "SECOND"}
        assert first["statuses"][0]["limitRemaining"] == 1
        assert last["overallCode"] == "OVER_LIMIT"

    @pytest.mark.parametrize(
        "body",
        ["not json", '{"domain": "edge", "descriptors": "x"}', '{"domain": "edge"}',
         rls_json(("route", "public"), domain=""), '{"domain": "edge", "bogus": 1}'],
        ids=["not-json", "wrong-type", "no-descriptors", "empty-domain", "unknown-field"],
    )  # fmt: skip
    async def test_bad_requests_are_400(
        self, serve: Serve, http: aiohttp.ClientSession, body: str
    ) -> None:
        """Anything that is not a usable RateLimitRequest is 400 with the reason."""
        base, _ = await serve()
        async with http.post(base + "/json", data=body) as response:
            assert response.status == 400
            assert (await response.json())["error"]

    @pytest.mark.parametrize("mode", [FailureMode.OPEN, FailureMode.CLOSED])
    async def test_backend_down_is_503(
        self, serve: Serve, http: aiohttp.ClientSession, mode: FailureMode
    ) -> None:
        """503 in either failure mode; failure-open still shows the OK that Envoy got."""
        base, _ = await serve(DownStore(), failure_mode=mode)
        async with http.post(base + "/json", data=rls_json(("generic_key", "api"))) as response:
            assert response.status == 503
            body = await response.json()
        if mode is FailureMode.OPEN:
            assert body["overallCode"] == "OK"
        else:
            assert "backend unavailable" in body["error"]

    async def test_get_is_not_allowed(self, serve: Serve, http: aiohttp.ClientSession) -> None:
        """/json takes POST only."""
        base, _ = await serve()
        async with http.get(base + "/json") as response:
            assert response.status == 405


class TestRlconfig:
    async def test_rules_with_classification_and_live_fairness(
        self, serve: Serve, http: aiohttp.ClientSession
    ) -> None:
        """The rule tree as loaded, each cap's classification, and its figures once measured."""
        base, limiter = await serve()
        async with http.get(base + "/rlconfig") as response:
            assert response.status == 200
            before = await response.json()
        cap, bucket = before["domains"][0]["descriptors"]
        assert cap["path"] == "edge/route=public"
        assert cap["fair_share"] == {"active_clients": 2, "weights": {}}
        assert cap["classification"]["mode"] == "per-client-buckets"
        assert cap["fairness"] is None  # no full period yet
        assert cap["descriptors"][0]["rate_limit"]["requests_per_unit"] == 2
        assert bucket["classification"]["mode"] == "global-bucket-only"
        message = bucket["classification"]["message"]
        assert before["warnings"] == []  # a global bucket is advice (a note), never a warning
        assert before["notes"] == [f"{before['files'][0]}: edge/generic_key=api: {message}"]
        for client in ("a", "b", "c"):  # three clients at a cap sized for two
            await limiter.should_rate_limit(
                req("edge", desc("route=public", f"client_id={client}"))
            )
        limiter.clock.advance(1)  # type: ignore[attr-defined]
        await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        async with http.get(base + "/rlconfig") as response:
            fairness = (await response.json())["domains"][0]["descriptors"][0]["fairness"]
        assert fairness["active_clients"] == 3 and fairness["over_declared"] is True
        assert fairness["jain_index"] == pytest.approx(1.0)
        assert fairness["starved_clients"] == 0
        assert fairness["fair_share_level_per_second"] is None  # uncontended


class TestMetrics:
    async def test_without_a_registry_metrics_is_404(
        self, serve: Serve, http: aiohttp.ClientSession
    ) -> None:
        """Without the CLI's SDK wiring there is nothing to render."""
        base, _ = await serve()
        async with http.get(base + "/metrics") as response:
            assert response.status == 404


class TestJsonIsNotForEveryone:
    """POST /json spends real quota: by default it is served only on an admin port bound to
    a loopback address (issue 26; the listener, not the peer, since issue 38: under Istio's
    sidecar every peer is 127.0.0.6)."""

    @pytest.mark.parametrize(
        ("allowed", "host", "status"),
        [
            ("loopback", "127.0.0.1", None),
            ("loopback", "127.0.0.2", None),
            ("loopback", "::1", None),
            ("loopback", "localhost", None),
            ("loopback", "0.0.0.0", 403),
            ("loopback", "::", 403),
            ("loopback", "10.1.2.3", 403),
            ("loopback", "fe80::1%eth0", 403),
            ("loopback", "fairlimit.example", 403),
            ("on", "0.0.0.0", None),
            ("off", "127.0.0.1", 404),
        ],
    )
    def test_where_it_is_served(self, allowed: str, host: str, status: int | None) -> None:
        from fairlimit.admin import _json_refusal

        refused = _json_refusal(allowed, host)
        assert (None if refused is None else refused.status) == status

    async def test_off_answers_404_and_spends_nothing(
        self, serve: Serve, http: aiohttp.ClientSession
    ) -> None:
        base, limiter = await serve(json_from="off")
        body = rls_json(("route", "public"), ("client_id", "alice"))
        async with http.post(base + "/json", data=body) as response:
            assert response.status == 404
            assert "--admin-json" in (await response.json())["error"]
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=alice"))
        )
        assert decision.statuses[0].limit_remaining == 1  # the first of 2: nothing spent


class TestTokens:
    @pytest.mark.parametrize(
        "query", ["", "?domain=edge", "?entry=route=public", "?domain=edge&entry=route"]
    )
    async def test_a_query_without_domain_or_entries_is_400(
        self, serve: Serve, http: aiohttp.ClientSession, query: str
    ) -> None:
        """/tokens needs a domain and key=value entries; the error says how to ask."""
        base, _ = await serve()
        async with http.get(base + "/tokens" + query) as response:
            assert response.status == 400
            assert "entry=KEY=VALUE" in (await response.json())["error"]

    async def test_entries_without_a_reservation_are_404(
        self, serve: Serve, http: aiohttp.ClientSession
    ) -> None:
        """A client whose rule reserves nothing has no token budget to show (the answer
        for a reserving rule is tests/e2e/test_e2e_tokens.py's)."""
        base, _ = await serve()
        async with http.get(base + "/tokens?domain=edge&entry=route=public"
                            "&entry=client_id=alice") as response:  # fmt: skip
            assert response.status == 404
